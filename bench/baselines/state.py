"""Training state as a flat list of named tensors, and a flat byte layout for it.

Every checkpoint baseline saves and restores the same thing: the model's parameters
(tied weights once), its persistent buffers, and the optimizer's per-parameter state
(AdamW: ``step``, ``exp_avg``, ``exp_avg_sq``).  The raw baselines (CheckFreq,
in-memory) copy these tensors into one byte buffer at fixed offsets, so saving is one
batched copy and restoring one batched copy back, with no serialisation.
"""
from __future__ import annotations

import json

import torch

ALIGN = 4096


def ensure_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """Create AdamW/Adam state the way the first ``step()`` would (zeros), so that it can
    be restored into before the first step.  Other optimizers: not supported here."""
    for group in opt.param_groups:
        on_dev = group.get("fused") or group.get("capturable")
        for p in group["params"]:
            st = opt.state[p]
            if st:
                continue
            st["step"] = torch.zeros((), dtype=torch.float32, device=p.device if on_dev else "cpu")
            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def named_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) for everything a restart needs, in a stable order."""
    out, seen = [], set()
    names = {}
    for n, p in model.named_parameters():  # named_parameters skips tied duplicates
        names[id(p)] = n
        out.append((f"model.{n}", p.detach()))
        seen.add(id(p))
    for n, b in model.state_dict(keep_vars=True).items():
        if id(b) not in seen and isinstance(b, torch.Tensor):
            seen.add(id(b))
            out.append((f"model.{n}", b.detach()))
    for group in opt.param_groups:
        for p in group["params"]:
            for k, t in sorted(opt.state[p].items()):
                if isinstance(t, torch.Tensor):
                    out.append((f"optim.{names[id(p)]}.{k}", t))
    return out


def layout(named: list[tuple[str, torch.Tensor]]) -> tuple[list[dict], int]:
    """Offsets for each tensor in one buffer (4 KiB aligned); returns (entries, total bytes)."""
    entries, off = [], 0
    for n, t in named:
        nbytes = t.numel() * t.element_size()
        entries.append({"name": n, "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
                        "offset": off, "nbytes": nbytes})
        off += (nbytes + ALIGN - 1) // ALIGN * ALIGN
    return entries, max(off, ALIGN)


def layout_json(entries: list[dict]) -> str:
    return json.dumps(entries, sort_keys=True)


def views(buf: torch.Tensor, entries: list[dict]) -> list[torch.Tensor]:
    """Typed views into the uint8 buffer ``buf`` at each entry's offset."""
    out = []
    for e in entries:
        raw = buf[e["offset"]:e["offset"] + e["nbytes"]]
        out.append(raw.view(getattr(torch, e["dtype"])).view(e["shape"]))
    return out


def copy_batched(dst: list[torch.Tensor], src: list[torch.Tensor], non_blocking: bool = True) -> None:
    """dst[i].copy_(src[i]) for all i, grouped so that device↔host copies stay batched."""
    same = [(d, s) for d, s in zip(dst, src) if d.device == s.device and d.dtype == s.dtype]
    other = [(d, s) for d, s in zip(dst, src) if not (d.device == s.device and d.dtype == s.dtype)]
    for d, s in other:
        d.copy_(s, non_blocking=non_blocking)
    if same:
        torch._foreach_copy_([d for d, _ in same], [s for _, s in same], non_blocking=non_blocking)


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
