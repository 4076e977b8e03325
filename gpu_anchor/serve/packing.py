"""Packed projections: a layer's q/k/v (and gate/up) weights in one tensor, multiplied as one.

A decode step multiplies 32–128 rows by every weight, so each GEMM is a pass over the weight
and its speed is the bandwidth cuBLAS reaches on that shape.  On the H200 (Qwen3-8B, 64
rows) it reached ~1.4 TB/s on the 1024-row ``k_proj`` / ``v_proj`` against ~3.5 TB/s on the
12 288-row ``gate_proj`` (``bench/serve_throughput.py --profile``): one 6 144-row ``qkv``
GEMM instead of three, and one ``gate_up`` instead of two, as vLLM and TensorRT-LLM load them.

The engine binds the packed tensor under its own name (``…self_attn.qkv_proj.weight``,
``…mlp.gate_up_proj.weight``, and ``qkv_proj.bias`` when q/k/v have biases) and keeps the
Hugging Face names as row views of it, so loading, random initialisation and the CPU forward
see the checkpoint's names and shapes unchanged.  A tensor-parallel rank packs its own shards
(its heads of q, k and v; its rows of gate and up), so every rank's packed GEMM is its
column-parallel part.  Groups whose members are missing or differ in dtype or width stay apart.
"""
from __future__ import annotations

import torch

# (module prefix, members in row order, packed name)
GROUPS = (("self_attn.", ("q_proj", "k_proj", "v_proj"), "qkv_proj"),
          ("mlp.", ("gate_proj", "up_proj"), "gate_up_proj"))

Spec = tuple[str, tuple, torch.dtype]


def pack_specs(specs: list[Spec]) -> tuple[list[Spec], dict[str, list[str]]]:
    """``(specs to bind, {packed name: member names in row order})``: every complete group of
    ``specs`` replaced by one tensor, at the place of its first member."""
    by = {n: (tuple(shape), dt) for n, shape, dt in specs}
    packed: dict[str, list[str]] = {}
    for name in by:
        for prefix, members, pname in GROUPS:
            for suffix in (".weight", ".bias"):
                head = prefix + members[0] + suffix
                if not name.endswith(head):
                    continue
                base = name[: -len(members[0] + suffix)]
                names = [base + m + suffix for m in members]
                if all(m in by for m in names) and len({(by[m][0][1:], by[m][1]) for m in names}) == 1:
                    packed[base + pname + suffix] = names
    first = {ms[0]: p for p, ms in packed.items()}
    inside = {m for ms in packed.values() for m in ms}
    out = []
    for name, shape, dt in specs:
        if name in first:
            p = first[name]
            rows = sum(by[m][0][0] for m in packed[p])
            out.append((p, (rows,) + tuple(shape[1:]), dt))
        elif name not in inside:
            out.append((name, tuple(shape), dt))
    return out, packed


def member_views(tensors: dict[str, torch.Tensor], packed: dict[str, list[str]],
                 specs: list[Spec]) -> dict[str, torch.Tensor]:
    """Each member of a packed tensor as its row view (the Hugging Face name and shape)."""
    rows = {n: shape[0] for n, shape, _ in specs}
    views = {}
    for p, members in packed.items():
        r = 0
        for m in members:
            views[m] = tensors[p][r:r + rows[m]]
            r += rows[m]
    return views
