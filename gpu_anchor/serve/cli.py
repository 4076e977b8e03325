"""The engine side of ``gpu-anchor serve``: its arguments, its ``EngineConfig`` (one per
rank of a tensor-parallel group), the fault plan, what a warm standby engine does before and
at take-over, and following a migration.

The supervisor (frontend process, engine forks and restarts, decisions, job record) is
``gpu_anchor.launch.serve``; it calls into this module, never the other way round.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import random

from . import options

log = logging.getLogger("gpu_anchor.serve")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="model directory (config.json + *.safetensors [+ tokenizer.json]), or a Hugging "
                                 "Face Hub id (Qwen/Qwen3-8B: from the local cache, fetched if missing); with "
                                 "--random-weights, a config.json or a directory holding one")
    p.add_argument("--revision", default=None, help="the hub revision (branch, tag or commit) of a hub id")
    p.add_argument("--download-dir", default=None, help="the Hugging Face cache to use (default: HF_HUB_CACHE)")
    p.add_argument("--random-weights", action="store_true", help="seeded random weights instead of safetensors")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument("--tokenizer", default=None, help="directory with tokenizer.json, or a hub id (default: the "
                                                     "model's)")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--host", default="127.0.0.1",
                   help="the address to listen on (default 127.0.0.1, this machine only; vLLM listens on every "
                        "interface: 0.0.0.0)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--port-file", default=None, help="write the bound HTTP port here (for --port 0)")
    p.add_argument("--device", default=None, help="cuda:N or cpu (default: cuda:0 if available)")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 | float64 (default: bf16 on CUDA)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks (one way to size the KV cache)")
    p.add_argument("--kv-cache-gib", type=float, default=None, help="KV cache size in GiB (another way)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="fraction of the device's memory for weights, activations and KV cache; the KV cache gets "
                        "the rest, as in vLLM (default: 0.9 on CUDA; on the CPU, 1 GiB of KV cache, and a fraction "
                        "given here is of the host's RAM)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="tokens per engine step (default 2048)")
    p.add_argument("--max-batched-tokens", dest="max_batched_tokens_deprecated", type=int, default=None,
                   help="deprecated alias of --max-num-batched-tokens")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=None,
                   help="engine processes, one per device (cuda:K..K+N-1 from --device cuda:K; on the CPU all on "
                        "the host), each with its shard of the weights and KV cache; default 1")
    p.add_argument("--chat-template", default=None,
                   help="Jinja chat template: a file, or the template itself (default: the model directory's)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="parse the tool calls in chat replies to requests with tools (tool_choice \"auto\"); "
                        "needs --tool-call-parser (as in vLLM)")
    p.add_argument("--tool-call-parser", default=None,
                   help="the format of the model's tool calls: hermes (<tool_call>{...}</tool_call>: Qwen2.5, "
                        "Qwen3, Hermes), llama3_json ({\"name\": ..., \"parameters\": {...}}: Llama 3.1 / 3.2) or "
                        "pythonic ([f(a=1), g()]: Llama 3.2 / 4, ToolACE) or mistral ([TOOL_CALLS] [{...}]: "
                        "Mistral 7B v0.3)")
    p.add_argument("--structured-outputs-config", default=None,
                   help="vLLM's structured-output settings as JSON: backend (llguidance enforces every one here), "
                        "disable_any_whitespace, enable_in_reasoning")
    p.add_argument("--guided-decoding-backend", default=None, help="vLLM's older name of the structured-output "
                                                                   "backend (llguidance enforces every one here)")
    p.add_argument("--reasoning-parser", default=None,
                   help="return the reasoning of chat replies (<think> ... </think>: qwen3, deepseek_r1) as the "
                        "message's reasoning, apart from its content (as in vLLM)")
    p.add_argument("--generation-config", default="auto",
                   help="sampling defaults for requests that leave them out: auto (the model's "
                        "generation_config.json, as vLLM), vllm (vLLM's own: temperature 1, no top-p / top-k), or a "
                        "directory holding a generation_config.json")
    p.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters (--lora-modules) beside the base model; a request names one as its "
                        "model (as in vLLM)")
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="the adapters: NAME=PATH, or JSON {\"name\": ..., \"path\": ...}, each a directory as peft's "
                        "save_pretrained writes it (LoRA on the decoder's projections)")
    p.add_argument("--max-lora-rank", type=int, default=16, help="the largest adapter rank accepted (default 16)")
    p.add_argument("--max-loras", type=int, default=None,
                   help="the adapters on the device at once, the most that running requests use together (any "
                        "mix of them shares a step; default: as many as --lora-modules gives, at least 1). On one "
                        "GPU, without --deterministic, more may be served (given, or loaded with /v1/load_lora_adapter when "
                        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True): they wait on the host, and one is put in the slot "
                        "of the least recently used adapter no running request uses when a request needs it; "
                        "each projection has room for one of --max-lora-rank in each slot")
    p.add_argument("--max-cpu-loras", type=int, default=None,
                   help="the adapters whose tensors the host keeps, at least --max-loras (as in vLLM; default: "
                        "every served one); a parked adapter beyond them is read again from its files when a "
                        "request needs it, and its requests are refused, naming it, if the files changed")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 and /admin (default: $VLLM_API_KEY, if set)")
    p.add_argument("--namespace", default=None, help="anchor namespace (default: serve-<model name>)")
    p.add_argument("--socket", default=None, help="daemon socket (default: the device's standard one)")
    p.add_argument("--cpu-threads", type=int, default=None, help="torch threads of the engine on the CPU")
    p.add_argument("--no-anchor", action="store_true", help="plain allocations, no journal (baseline)")
    p.add_argument("--no-cuda-graphs", "--enforce-eager", action="store_true",
                   help="decode steps run the eager forward (default on CUDA: replayed CUDA graphs)")
    p.add_argument("--deterministic", action="store_true",
                   help="batch-invariant kernels for every matmul, norm and attention: a request's tokens do not "
                        "depend on the batch it runs in, so a run with engine or daemon failures gives the same "
                        "tokens as a fault-free one, also on a GPU in bf16 (off by default: it costs throughput; "
                        "docs/serving.md, 'Determinism')")
    p.add_argument("--blas-library", choices=("auto", "cublas", "cublaslt"), default=None,
                   help="the CUDA matmul library of the engine process (default auto: cuBLASLt when --max-num-seqs "
                        "is at most 64, where its decode matmuls were 3-5 %% faster on the H200, else cuBLAS; "
                        "docs/serving.md, 'The matmul library')")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="in steady decode, launch the next step before reading this one's tokens, so the GPU does "
                        "not wait for the host's bookkeeping between steps (as vLLM's --async-scheduling; prefill "
                        "and mixed steps, log-probabilities and tensor parallelism stay synchronous; default: "
                        "on for one GPU, off on the CPU; docs/serving.md, 'Asynchronous scheduling')")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="a request whose first blocks of tokens (system prompt, earlier turns) another request "
                        "computed shares their KV instead of computing it again (vLLM's option; "
                        "docs/serving.md, 'Prefix caching')")
    p.add_argument("--warm-pool", action="store_true",
                   help="keep a standby engine process (CUDA context created, kernels warmed) that takes over "
                        "at once when the engine dies, instead of a fork + CUDA init")
    p.add_argument("--prewarm", action=argparse.BooleanOptionalAction, default=None,
                   help="with --warm-pool (implied): the standby also runs a 1-layer scratch engine of the same "
                        "shapes through prefill and decode before any failure, so the first step after a "
                        "take-over finds its kernels loaded (never touches the live engine's state); the KV "
                        "cache's sizing reserves its peak (default: as --hot-standby)")
    p.add_argument("--hot-standby", action=argparse.BooleanOptionalAction, default=None,
                   help="implies --warm-pool: once the engine is ready, the standby also maps its weights and KV "
                        "cache (read-only until it takes over), builds the model and captures its decode graphs, so "
                        "a take-over is a journal read and the next step (docs/serving.md, 'Hot takeover'); "
                        "default: on for one GPU with anchoring, off on the CPU, with --tensor-parallel-size > 1 "
                        "and with --no-anchor")
    p.add_argument("--fault-plan", default=None, metavar="SEED:MAXSTEP[:LIMIT]",
                   help="testing: each engine SIGKILLs itself at a random step <= MAXSTEP and phase, "
                        "for the first LIMIT engines (default: all); with tensor parallelism, one random "
                        "rank of each engine group does")


def fault_for(plan: str | None, incarnation: int, ranks: int = 1) -> dict[int, tuple[int, str]]:
    """``{rank: (step, phase)}``: where this incarnation's engine (group) kills itself."""
    if not plan:
        return {}
    from .engine_config import PHASES
    parts = [int(x) for x in plan.split(":")]
    seed, maxstep = parts[0], parts[1]
    if len(parts) > 2 and incarnation >= parts[2]:
        return {}
    rng = random.Random(seed * 1_000_003 + incarnation)
    fault = (rng.randint(0, maxstep), rng.choice(PHASES))
    return {rng.randrange(ranks) if ranks > 1 else 0: fault}


def _dtype(name: str):
    from .engine import DTYPES
    return DTYPES.get(name)


# A hot standby's engine, attached to the live engine's state (``Engine(standby=True)``): made by
# ``standby_prepare`` in the standby process, handed to ``worker.run`` by ``standby_run``.
_hot = None


def standby_prepare(cfg, prewarm: bool, hot: bool = False, fence=None) -> dict:
    """A standby's start-up: CUDA context and cuBLAS, then (``--prewarm``) the scratch engine of
    ``serve.prewarm`` — scratch tensors only —, then (``--hot-standby``) the engine attached to
    the live engine's state, which it writes nothing of (``Engine(standby=True)``; the supervisor
    asks for it only once the live engine is built).  A state it cannot attach to leaves an
    ordinary warm standby (``info["hot"]`` is False and says why).  ``fence``: the server's
    step fence, which a hot standby maps into its CUDA context now rather than at take-over."""
    from gpu_anchor.runtime.warm import warm_cuda
    info = warm_cuda(cfg.device, _dtype(cfg.dtype))
    if prewarm:
        from .prewarm import warm_engine
        info.update(warm_engine(cfg))
    if hot:
        info.update(_attach(cfg))
        if info.get("hot") and fence is not None and cfg.device.startswith("cuda"):
            fence.map_device()
    if cfg.device.startswith("cuda"):
        info.update(_device_memory(cfg.device))
    return info


def _device_memory(device: str) -> dict:
    """What this standby holds of the device once prepared, and its allocator's peak while it
    prepared (the KV cache's sizing does not count a standby beyond a fixed reserve:
    ``options.CUDA_FIXED_BYTES``): ``device_bytes`` (NVML, this process, CUDA context
    included; absent without pynvml), ``allocator_bytes`` and ``allocator_peak_bytes`` (torch)."""
    import torch
    out = {"allocator_bytes": torch.cuda.memory_reserved(device),
           "allocator_peak_bytes": torch.cuda.max_memory_reserved(device)}
    try:
        import pynvml
        pynvml.nvmlInit()
        index = torch.device(device).index or 0
        visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
        h = pynvml.nvmlDeviceGetHandleByIndex(int(visible[index]) if index < len(visible) and
                                               visible[index].isdigit() else index)
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
            if p.pid == os.getpid() and p.usedGpuMemory is not None:
                out["device_bytes"] = int(p.usedGpuMemory)
    except Exception:  # noqa: BLE001  (NVML is optional: the allocator's figures stay)
        pass
    return out


def _attach(cfg) -> dict:
    global _hot
    from .engine import Engine
    from .state import NotAttachable
    try:
        _hot = Engine(cfg, standby=True)
    except NotAttachable as e:
        log.warning("standby %d cannot attach to the engine's state (%s): it stays a warm standby", os.getpid(), e)
        return {"hot": False, "not_attachable": str(e)}
    graphs = (f"{_hot.graphs.stats['graphs']} decode graphs captured in {_hot.timings['standby_capture_s']:.2f} s"
              if _hot.graphs is not None and _hot.graphs.capture else "no decode graphs (eager)")
    log.info("hot standby %d attached to namespace %r in %.2f s (%s)", os.getpid(), cfg.namespace,
             _hot.timings["standby_attach_s"], graphs)
    return {"hot": True, "attach_s": _hot.timings["standby_attach_s"], "capture_s": _hot.timings["standby_capture_s"]}


def standby_idle() -> None:
    """A waiting hot standby keeps up with the adapters loaded while serving (``follow_adapters``)."""
    if _hot is not None:
        _hot.follow_adapters()


def standby_run(cfg, esock: str, go: dict, worker, on_progress=None, fence=None) -> None:
    """The standby takes over: what is only known now comes in ``go``.  A hot standby's engine
    is used when it was attached for this placement and fault plan; otherwise it is dropped and
    the engine is built the usual way (a warm take-over)."""
    import dataclasses
    global _hot
    c = dataclasses.replace(cfg, device=go["device"], socket=go["socket"],
                            fault=tuple(go["fault"]) if go.get("fault") else None)
    eng, _hot = _hot, None
    if eng is not None and (eng.cfg.device, eng.cfg.socket, eng.cfg.fault) != (c.device, c.socket, c.fault):
        log.warning("hot standby %d attached to %s (daemon %s, fault %s), asked to serve %s (daemon %s, fault %s): "
                    "building the engine anew", os.getpid(), eng.cfg.device, eng.cfg.socket, eng.cfg.fault,
                    c.device, c.socket, c.fault)
        eng = None
        discard_engine()
    worker.run(c, esock, started_at=go["started"], standby=True, on_progress=on_progress, engine=eng, fence=fence,
               predecessor=go.get("predecessor"), writers_gone=bool(go.get("writers_gone")))


def discard_engine() -> None:
    """After a hot engine was dropped: its graph pool goes back to the device (its mappings, which
    never owned their objects, free nothing in the daemon)."""
    import gc
    gc.collect()
    import torch
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def follow_migration(cfg, path: str) -> None:
    """A finished ``gpu-anchor migrate`` moved the engine: the next one starts where it went."""
    try:
        with open(path) as f:
            p = json.load(f)
    except FileNotFoundError:
        return
    if (p["device"], p["socket"]) != (cfg.device, cfg.socket):
        log.info("engine placement: %s (daemon %s), after a migration", p["device"], p["socket"])
        cfg.device, cfg.socket = p["device"], p["socket"]


def engine_config(args, mc):
    """Rank 0's configuration (the only one without tensor parallelism; ``rank_configs``
    derives the others).  Raises ``options.OptionError`` for a bad combination."""
    import torch

    from .engine import EngineConfig
    from .model_runner import check_window
    if args.device is None:
        # The NVML check does not initialise the CUDA driver here: forked engines could not use it.
        os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    device = args.device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    tp = args.tensor_parallel_size or 1
    options.check_tensor_parallel(args, mc, device)
    options.check_kernel_shapes(args, mc, device)
    try:
        check_window(mc, args.max_model_len)
    except ValueError as e:
        raise options.OptionError(str(e)) from None
    dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    options.check_deterministic(args, device, dtype)
    options.resolve_standby(args, device)
    name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
    from .lora import AdapterError, from_options
    try:
        lora, max_loras, runtime_lora, lora_numel = from_options(args, mc, name)
    except AdapterError as e:
        raise options.OptionError(str(e)) from None
    # a hot standby stacks its own copy of the adapters beside the live engine's
    num_blocks = options.kv_cache_blocks(args, mc, device, dtype, lora_numel * (2 if args.hot_standby else 1))
    return EngineConfig(model=args.model, random_weights=args.random_weights, seed=args.seed, device=device,
                        tokenizer=args.tokenizer, lora=lora, max_lora_rank=args.max_lora_rank,
                        max_loras=max_loras, runtime_lora=runtime_lora, max_cpu_loras=args.max_cpu_loras,
                        dtype=dtype, block_size=args.block_size, num_blocks=num_blocks,
                        max_num_seqs=args.max_num_seqs, max_batched_tokens=args.max_num_batched_tokens,
                        max_model_len=args.max_model_len, anchor=not args.no_anchor,
                        namespace=args.namespace or f"serve-{name}", socket=args.socket,
                        cpu_threads=args.cpu_threads, cuda_graphs=False if args.no_cuda_graphs else None,
                        tensor_parallel_size=tp, deterministic=args.deterministic,
                        **({} if args.async_scheduling is None else {"async_scheduling": args.async_scheduling}),
                        **({} if args.enable_prefix_caching is None else {"prefix_caching": args.enable_prefix_caching}),
                        **({} if args.blas_library is None else {"blas_library": args.blas_library}))


def rank_configs(cfg) -> list:
    """One configuration per rank of the engine group: rank ``r`` on ``cuda:K+r`` (rank 0 on
    ``cuda:K``) with that device's daemon, or on the CPU with the same host daemon (each rank
    in its own namespace there: ``Anchor``)."""
    import dataclasses

    from gpu_anchor.paths import default_socket
    out = [cfg]
    for r in range(1, cfg.tensor_parallel_size):
        if cfg.device == "cpu":
            out.append(dataclasses.replace(cfg, rank=r))
        else:
            base = int(cfg.device.split(":")[1]) if ":" in cfg.device else 0
            dev = f"cuda:{base + r}"
            out.append(dataclasses.replace(cfg, rank=r, device=dev, socket=default_socket(dev) if cfg.anchor else None))
    return out
