"""A standby engine's pre-warm: run a scratch engine before any failure, so the real
engine's first step after a take-over finds its kernels loaded.

A restarted engine's first step is slow for reasons that have nothing to do with its state:
on an H200 (Qwen3-8B shape, 64 streams) it took 0.74–1.04 s against ~0.04 s for a steady
decode step, in every recovery method alike (``bench recovery_serve``), because the new
process meets every kernel, Triton launcher and cuBLAS heuristic for the first time.  A
warm standby (``gpu-anchor serve --warm-pool``) exists before the failure, so it can pay
for that then — but it must not touch the live engine's weights or KV cache.

``warm_engine`` therefore builds a *scratch* engine of the same architecture with one
decoder layer, seeded random weights, a small KV cache of its own and no anchoring, runs
``max_num_seqs`` sequences through one prefill and a few eager decode steps (the first
steps after a take-over are eager: ``EngineConfig.graph_after_steps``), and frees it.
Same widths, heads, vocabulary and dtype mean the same kernels (Triton specialises on the
head layout and dtype, not on the batch), the same cuBLAS handles and most of the same
GEMM heuristics.  Cost: the standby is ready a few seconds later, and while it runs it
holds one layer's weights, the embedding (the LM head is tied to it) and a small KV cache.
"""
from __future__ import annotations

import gc
import json
import math
import os
import tempfile
import time

from .engine import Engine, EngineConfig
from .model_runner import load_config
from .sequence import SamplingParams

DECODE_STEPS = 3


def scratch_config(cfg: EngineConfig, config_path: str) -> EngineConfig:
    """``cfg``'s engine shape with a 1-layer random model at ``config_path``: no anchoring,
    no CUDA graphs, a KV cache just big enough for one prefill + decode of every sequence."""
    per_seq = -(-(cfg.block_size + DECODE_STEPS + 1) // cfg.block_size)
    return EngineConfig(model=config_path, random_weights=True, seed=1, device=cfg.device, dtype=cfg.dtype,
                        block_size=cfg.block_size, num_blocks=cfg.max_num_seqs * per_seq + 1,
                        max_num_seqs=cfg.max_num_seqs,
                        max_batched_tokens=max(cfg.max_batched_tokens, cfg.max_num_seqs * cfg.block_size),
                        max_model_len=cfg.max_model_len, anchor=False, cuda_graphs=False,
                        cpu_threads=cfg.cpu_threads, deterministic=cfg.deterministic,
                        blas_library=cfg.blas_library)


def scratch_model(cfg: EngineConfig) -> dict:
    """The scratch engine's model config: ``cfg``'s, with one decoder layer and the LM head tied
    to the embedding (the same ``[vocab, hidden]`` GEMM, so the same kernels, and one such
    matrix less in memory: 1.2 GB at the 8B shape)."""
    return scratch_dict(load_config(cfg.model).to_dict())


def scratch_dict(hf: dict) -> dict:
    """``scratch_model`` of a model config given as a dict."""
    hf = dict(hf)
    hf["num_hidden_layers"] = 1
    hf["tie_word_embeddings"] = True
    for key in ("layer_types", "mlp_only_layers"):  # per-layer lists must match the layer count
        if isinstance(hf.get(key), list):
            hf[key] = hf[key][:1]
    return hf


def peak_bytes(mc, block_size: int, max_num_seqs: int, max_batched_tokens: int, dtype_bytes: int) -> int:
    """An upper estimate of what ``warm_engine`` holds at its peak, from the shapes (the KV
    sizing reserves it while a standby pre-warms beside the live engine): the scratch engine's
    weights, its largest float32 random draw, its working memory and its KV cache."""
    from .model_runner import DRAW_ELEMENTS, head_dim, param_specs
    from .options import activation_bytes
    smc = type(mc).from_dict(scratch_dict(mc.to_dict()))
    sizes = [math.prod(shape) for _, shape, _ in param_specs(smc, None)]
    per_seq = -(-(block_size + DECODE_STEPS + 1) // block_size)
    kv = (max_num_seqs * per_seq + 1) * 2 * block_size * smc.num_key_value_heads * head_dim(smc) * dtype_bytes
    act = activation_bytes(smc, max(max_batched_tokens, max_num_seqs * block_size), max_num_seqs, dtype_bytes)
    return sum(sizes) * dtype_bytes + min(DRAW_ELEMENTS, max(sizes)) * 4 + act + kv


def warm_engine(cfg: EngineConfig) -> dict:
    """Run the scratch engine for ``cfg`` (see the module docstring); returns timings."""
    import torch
    t0 = time.perf_counter()
    hf = scratch_model(cfg)
    with tempfile.TemporaryDirectory(prefix="ga-prewarm-") as tmp:
        path = os.path.join(tmp, "config.json")
        with open(path, "w") as f:
            json.dump(hf, f)
        scratch = Engine(scratch_config(cfg, path))
    vocab = scratch.mc.vocab_size
    n = cfg.max_num_seqs
    prompts = [[(7 * i + j) % (vocab - 3) + 3 for j in range(cfg.block_size)] for i in range(n)]
    scratch.generate(prompts, [SamplingParams(max_tokens=DECODE_STEPS + 1, temperature=0.0 if i % 2 else 0.8,
                                              seed=i) for i in range(n)])
    del scratch
    gc.collect()    # a cycle in it (the run-ahead state's, now a weak proxy) once kept 1.70 GB allocated (H200)
    if cfg.device.startswith("cuda"):
        torch.cuda.synchronize(cfg.device)
        torch.cuda.empty_cache()      # its blocks go back; the loaded kernels stay
    return {"engine_prewarm_s": time.perf_counter() - t0}
