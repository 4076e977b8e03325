"""``gpu-anchor serve``'s vLLM-compatible options, checked and resolved before anything starts.

- ``--tensor-parallel-size N``: N engine processes, one per device (``serve/tp.py``); N must
  divide the model's attention heads, KV heads and MLP width (``shards.check``), and on CUDA
  the devices ``cuda:K .. cuda:K+N-1`` must exist.  Not with ``--warm-pool`` / ``--hot-standby``
  (one standby per rank is not built) nor, on CUDA, with ``--socket`` (each device has its own daemon).
- ``--max-num-batched-tokens`` (vLLM's name); ``--max-batched-tokens`` still works, with a
  deprecation warning.
- KV-cache size, one of: ``--num-blocks N``; ``--kv-cache-gib G``; ``--gpu-memory-utilization F``
  (as vLLM: the server may use the fraction F of the device's total memory for weights,
  activations and KV cache; the KV cache gets what is left).  Default: F = 0.9 on CUDA (vLLM's
  default), 1 GiB of KV cache on the CPU; on the CPU, F is a fraction of the host's RAM
  (``MemTotal``).  vLLM profiles a forward pass to learn its activation memory; the supervisor
  here runs no torch op (it is the engines' fork server), so activations are estimated from
  the model's shapes and the batch limits, plus a fixed allowance on CUDA for the CUDA
  context, cuBLAS workspaces, CUDA graphs and a warm standby's context.  The device's total
  memory comes from NVML (no CUDA context) on CUDA and ``/proc/meminfo`` on the CPU.
- ``--chat-template``: a file, or the template itself inline (as vLLM).
- ``--api-key``, else the ``VLLM_API_KEY`` environment variable (as vLLM).
- ``--generation-config auto`` (the default, as vLLM's): the model's ``generation_config.json``
  sets the sampling defaults of requests that leave them out (``generation_defaults``);
  ``vllm``: vLLM's own defaults; or a directory holding a ``generation_config.json``.
- ``--enable-auto-tool-choice`` needs ``--tool-call-parser`` (one of ``tool_calls.PARSERS``), as in vLLM;
  ``--reasoning-parser``: one of ``reasoning.PARSERS``.
- ``--structured-outputs-config`` (vLLM's, as JSON): ``backend`` (any of vLLM's names: llguidance
  enforces every constraint here), ``disable_any_whitespace`` (JSON replies without optional
  whitespace unless a request says otherwise), ``enable_in_reasoning`` (with
  ``--reasoning-parser``, the grammar constrains the reasoning too); ``--guided-decoding-backend``
  (vLLM's older option) is its ``backend``.  ``structured_config``.
- ``--hot-standby`` / ``--prewarm``: on by default for one GPU with anchoring (``resolve_standby``);
  off by default on the CPU, with tensor parallelism and with ``--no-anchor``, and refused there
  when asked for.
- ``--enable-lora --lora-modules NAME=PATH ...`` (vLLM's; ``--max-lora-rank``, default 16): peft
  adapters served by name, each read and checked now (``lora.from_options``); not with tensor parallelism.
- ``--deterministic``: on CUDA in float32 / bfloat16 / float16, with Triton, and at most 2
  tensor-parallel ranks (``batch_invariant.py`` says why); on the CPU it is always accepted.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys

from .reasoning import PARSERS as REASONING_PARSERS
from .tool_calls import PARSERS

log = logging.getLogger("gpu_anchor.serve")

GIB = 1 << 30
DEFAULT_CUDA_UTILIZATION = 0.9
DEFAULT_CPU_KV_GIB = 1.0
CUDA_FIXED_BYTES = 3 * GIB    # contexts (engine, daemon), cuBLAS workspace, graph pool, allocator slack, a standby; 2 GiB measured 0.905 of an H200 in use


class OptionError(ValueError):
    """A bad command line: ``serve`` prints it and exits with status 2."""


def check(args) -> None:
    """Checks that need nothing loaded; fills in the deprecated alias."""
    tp = args.tensor_parallel_size
    if tp is not None and tp < 1:
        raise OptionError(f"--tensor-parallel-size must be >= 1, got {tp}")
    if tp is not None and tp > 1 and (getattr(args, "warm_pool", False) or getattr(args, "prewarm", False)
                                      or getattr(args, "hot_standby", False)):   # None: the default, off here
        raise OptionError(f"--warm-pool / --prewarm / --hot-standby with --tensor-parallel-size {tp}: a standby per "
                          "rank is not built yet; drop them (a rank's death restarts the group from the fork server)")
    if getattr(args, "hot_standby", False) and getattr(args, "no_anchor", False):
        raise OptionError("--hot-standby with --no-anchor: a hot standby maps the engine's anchored state, and "
                          "--no-anchor has none; use --warm-pool")
    old = args.max_batched_tokens_deprecated
    if old is not None:
        if args.max_num_batched_tokens is not None and args.max_num_batched_tokens != old:
            raise OptionError(f"--max-batched-tokens {old} and --max-num-batched-tokens "
                              f"{args.max_num_batched_tokens} disagree; give --max-num-batched-tokens only")
        log.warning("--max-batched-tokens is deprecated; use --max-num-batched-tokens (vLLM's name)")
        args.max_num_batched_tokens = old
    if args.max_num_batched_tokens is None:
        args.max_num_batched_tokens = 2048
    if args.max_num_batched_tokens < 1:
        raise OptionError("--max-num-batched-tokens must be >= 1")
    given = [f"--{n.replace('_', '-')}" for n in ("num_blocks", "kv_cache_gib", "gpu_memory_utilization")
             if getattr(args, n) is not None]
    if len(given) > 1:
        raise OptionError(f"{' and '.join(given)}: give one way to size the KV cache")
    u = args.gpu_memory_utilization
    if u is not None and not 0.0 < u <= 1.0:
        raise OptionError(f"--gpu-memory-utilization must be in (0, 1], got {u}")
    if args.kv_cache_gib is not None and args.kv_cache_gib <= 0:
        raise OptionError(f"--kv-cache-gib must be > 0, got {args.kv_cache_gib}")
    if args.num_blocks is not None and args.num_blocks < 1:
        raise OptionError(f"--num-blocks must be >= 1, got {args.num_blocks}")
    parser = getattr(args, "tool_call_parser", None)
    if parser is not None and parser not in PARSERS:
        raise OptionError(f"--tool-call-parser {parser!r}: this server has {', '.join(PARSERS)}")
    rp = getattr(args, "reasoning_parser", None)
    if rp is not None and rp not in REASONING_PARSERS:
        raise OptionError(f"--reasoning-parser {rp!r}: this server has {', '.join(REASONING_PARSERS)}")
    args.structured = structured_config(args)
    if getattr(args, "enable_auto_tool_choice", False) and parser is None:
        raise OptionError("--enable-auto-tool-choice needs --tool-call-parser (hermes for Qwen2.5 / Qwen3, "
                          "llama3_json for Llama 3.1 / 3.2)")


def check_tensor_parallel(args, mc, device: str) -> None:
    """``--tensor-parallel-size`` against the model and the devices."""
    from . import shards
    n = args.tensor_parallel_size or 1
    try:
        shards.check(mc, n)
    except ValueError as e:
        raise OptionError(str(e)) from None
    if n == 1 or device == "cpu":
        return
    if args.socket:
        raise OptionError(f"--socket with --tensor-parallel-size {n} on CUDA: each device's daemon is found at its "
                          "own default socket (set GPU_ANCHOR_SOCKET_DIR to move them all)")
    import torch
    base = int(device.split(":")[1]) if ":" in device else 0
    have = torch.cuda.device_count()        # NVML first: no CUDA context in the fork server
    if base + n > have:
        raise OptionError(f"--tensor-parallel-size {n} from {device} needs cuda:{base}..cuda:{base + n - 1}; "
                          f"{have} CUDA device(s) are visible")


def check_kernel_shapes(args, mc, device: str) -> None:
    """On CUDA the paged attention is a Triton kernel that gathers whole KV blocks and tiles
    by the head dimension: the block size must be a power of two, the head dimension a power
    of two >= 16.  Said at start-up, not by every engine's first step (which the supervisor
    would count as a crash loop)."""
    if device == "cpu":
        return
    from .model_runner import head_dim
    bs, d = args.block_size, head_dim(mc)
    if bs < 1 or bs & (bs - 1):
        raise OptionError(f"--block-size {bs} on {device}: the CUDA attention kernel needs a power of two "
                          "(vLLM's default is 16)")
    if d < 16 or d & (d - 1):
        raise OptionError(f"head_dim {d} of the model is not a power of two >= 16: the CUDA attention kernel "
                          "cannot serve it (serve it on --device cpu)")


def resolve_standby(args, device: str) -> None:
    """``--hot-standby`` / ``--prewarm`` left unset (None) become their defaults: on for one GPU
    with anchoring, where a take-over by an attached, pre-warmed standby costs ~50 ms against a
    fresh engine's 1.4-1.7 s on the H200 (docs/serving.md), and where the whole server with it
    stays within --gpu-memory-utilization (the pre-warm's peak is reserved by the KV sizing);
    off on the CPU (a second engine's host memory, for a restart that forks in well under a
    second there), with tensor parallelism (no standby per rank) and with --no-anchor (nothing
    to attach to).  An explicit choice is kept."""
    on = (device.startswith("cuda") and (args.tensor_parallel_size or 1) == 1
          and not getattr(args, "no_anchor", False))
    if getattr(args, "hot_standby", None) is None:
        args.hot_standby = on
    if getattr(args, "prewarm", None) is None:
        args.prewarm = args.hot_standby


def check_deterministic(args, device: str, dtype: str) -> None:
    """What ``--deterministic`` needs: at most 2 tensor-parallel ranks; on CUDA, Triton and a
    float32 / bfloat16 / float16 dtype (``batch_invariant.py``)."""
    if not getattr(args, "deterministic", False):
        return
    tp = args.tensor_parallel_size or 1
    if tp > 2:
        raise OptionError(f"--deterministic with --tensor-parallel-size {tp}: NCCL sums the ranks' partial "
                          "products in an order that depends on the message size (the batch) when more than 2 "
                          "ranks take part, so tokens would not be batch-invariant; use -tp 1 or 2")
    if device.startswith("cuda"):
        import torch

        from .batch_invariant import supported
        from .engine import DTYPES
        why = supported(torch.device(device), DTYPES.get(dtype, torch.float32))
        if why:
            raise OptionError(why)


# generation_config.json -> request field; a value equal to transformers' own default is not a
# recommendation of the model's (as vLLM reads the file: GenerationConfig's diff from its defaults)
GENERATION_FIELDS = {"temperature": ("temperature", 1.0, 0.0, 100.0), "top_p": ("top_p", 1.0, 1e-9, 1.0),
                     "top_k": ("top_k", 50, -1, None), "min_p": ("min_p", None, 0.0, 1.0),
                     "repetition_penalty": ("repetition_penalty", 1.0, 1e-9, 100.0),
                     "max_new_tokens": ("max_tokens", None, 1, None)}


def generation_defaults(value: str, model_dir: str | None) -> dict:
    """The sampling defaults ``--generation-config`` gives requests (``{}``: vLLM's own)."""
    if value == "vllm":
        return {}
    folder = model_dir if value == "auto" else value
    path = os.path.join(folder, "generation_config.json") if folder and os.path.isdir(folder) else None
    if path is None or not os.path.exists(path):
        if value != "auto":
            raise OptionError(f"--generation-config {value}: no generation_config.json there (give a directory "
                              "holding one, auto or vllm)")
        return {}
    import json
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise OptionError(f"{path}: {e}") from None
    out = {}
    for key, (field, hf_default, lo, hi) in GENERATION_FIELDS.items():
        v = cfg.get(key)
        if v is None or v == hf_default:
            continue
        integral = key in ("top_k", "max_new_tokens")
        if isinstance(v, bool) or not isinstance(v, int if integral else (int, float)) \
                or v < lo or hi is not None and v > hi:
            raise OptionError(f"{path}: {key} = {v!r} is not a valid default (--generation-config vllm ignores "
                              "the file)")
        out[field] = max(0, v) if key == "top_k" else v
    return out


STRUCTURED_KEYS = {"backend": str, "disable_any_whitespace": bool, "enable_in_reasoning": bool,
                   "disable_fallback": bool, "disable_additional_properties": bool}


def structured_config(args) -> dict:
    """``--structured-outputs-config`` / ``--guided-decoding-backend`` checked; what the frontend
    needs of them (``disable_any_whitespace``, ``enable_in_reasoning``)."""
    import json

    from .structured_output import BACKENDS
    raw = getattr(args, "structured_outputs_config", None)
    try:
        cfg = json.loads(raw) if raw else {}
    except ValueError as e:
        raise OptionError(f"--structured-outputs-config must be JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise OptionError("--structured-outputs-config must be a JSON object")
    old = getattr(args, "guided_decoding_backend", None)
    if old is not None:
        cfg.setdefault("backend", old)
    for k, v in cfg.items():
        if k not in STRUCTURED_KEYS or not isinstance(v, STRUCTURED_KEYS[k]):
            raise OptionError(f"--structured-outputs-config: {k} = {v!r} is not served (give "
                              + ", ".join(f"{n} ({t.__name__})" for n, t in STRUCTURED_KEYS.items()) + ")")
    if cfg.get("backend", "auto") not in BACKENDS:
        raise OptionError(f"structured-output backend {cfg['backend']!r}: one of {', '.join(BACKENDS)} (llguidance "
                          "enforces each here)")
    if cfg.get("disable_additional_properties"):
        raise OptionError("--structured-outputs-config: disable_additional_properties is not served")
    return {k: True for k in ("disable_any_whitespace", "enable_in_reasoning") if cfg.get(k)}


def api_key(args) -> str | None:
    return args.api_key or os.environ.get("VLLM_API_KEY") or None


def chat_template_file(value: str | None, rundir: str) -> str | None:
    """``--chat-template``: a file path, or (like vLLM) the template text itself, which is then
    written into the server's run directory.  Returns the file for the frontend."""
    from .tokenizer import compile_template
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value) as f:
            text, path = f.read(), value
    elif any(c in value for c in "{}\n"):
        text, path = value, os.path.join(rundir, "chat_template.jinja")
        with open(path, "w") as f:
            f.write(value)
    else:
        raise OptionError(f"--chat-template {value!r}: no such file (and it does not look like a Jinja template)")
    try:
        compile_template(text)
    except ValueError as e:
        raise OptionError(f"--chat-template: {e}") from None
    return path


def device_memory(device: str) -> tuple[int, int]:
    """(total, available) bytes of ``device`` without creating a CUDA context."""
    if device == "cpu":
        info = {}
        with open("/proc/meminfo") as f:
            for line in f:
                k, v = line.split(":", 1)
                info[k] = int(v.split()[0]) * 1024
        return info["MemTotal"], info.get("MemAvailable", info["MemFree"])
    # NVML starts threads of its own (seen on an H200: a driver thread and a jemalloc one), and the
    # supervisor forks engines: ask in a short-lived child, so that no thread is left behind here.
    out = subprocess.run([sys.executable, "-c", _NVML_QUERY, device], capture_output=True, text=True, timeout=60,
                         env=os.environ)
    if out.returncode != 0:
        raise OptionError("sizing the KV cache from --gpu-memory-utilization (the default on CUDA) reads the GPU's "
                          "memory with NVML: pip install nvidia-ml-py (in gpu-anchor[cuda]); or give "
                          f"--kv-cache-gib / --num-blocks ({(out.stderr.strip().splitlines() or ['?'])[-1]})")
    total, free = (int(x) for x in out.stdout.split())
    return total, free


_NVML_QUERY = """
import os, sys
import pynvml
pynvml.nvmlInit()
device = sys.argv[1]
index = int(device.split(":")[1]) if ":" in device else 0
visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
if index < len(visible):        # CUDA_VISIBLE_DEVICES renumbers devices; NVML does not
    v = visible[index]
    h = pynvml.nvmlDeviceGetHandleByIndex(int(v)) if v.isdigit() else pynvml.nvmlDeviceGetHandleByUUID(v)
else:
    h = pynvml.nvmlDeviceGetHandleByIndex(index)
mem = pynvml.nvmlDeviceGetMemoryInfo(h)
print(int(mem.total), int(mem.free))
"""


def activation_bytes(mc, max_batched_tokens: int, max_num_seqs: int, dtype_bytes: int) -> int:
    """An upper estimate of the engine's working memory besides weights and KV cache: a
    step's hidden states, attention and MLP intermediates (twice, for temporaries) and the
    float32 logits of the sampled rows with the sampler's copies of them."""
    from .model_runner import head_dim
    d = head_dim(mc)
    per_token = (2 * mc.hidden_size + 3 * mc.intermediate_size + mc.num_attention_heads * d
                 + 2 * mc.num_key_value_heads * d)
    return 2 * max_batched_tokens * per_token * dtype_bytes + 4 * max_num_seqs * mc.vocab_size * 4


def kv_cache_blocks(args, mc, device: str, dtype: str, lora_numel: int = 0) -> int:
    """The number of KV blocks from ``--num-blocks``, ``--kv-cache-gib`` or
    ``--gpu-memory-utilization`` (see the module's doc); logs how it was sized.  With tensor
    parallelism the sizes are per device: a block holds ``1/N`` of the KV heads, and the
    weights are rank 0's shard (the largest: ranks differ only in the vocabulary's last rows).
    ``lora_numel``: the elements of the LoRA adapters' stacked tensors, counted with the weights."""
    import torch

    from .engine import DTYPES
    from .model_runner import head_dim, param_specs
    from .shards import shard_specs
    tdt = DTYPES.get(dtype)
    if tdt is None:
        raise OptionError(f"--dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    b = tdt.itemsize
    tp = args.tensor_parallel_size or 1
    per_block = 2 * mc.num_hidden_layers * args.block_size * (mc.num_key_value_heads // tp) * head_dim(mc) * b
    if args.num_blocks is not None:
        return args.num_blocks
    cuda = device.startswith("cuda")
    util = args.gpu_memory_utilization
    if args.kv_cache_gib is None and util is None and cuda:
        util = DEFAULT_CUDA_UTILIZATION
    if util is None:
        gib = args.kv_cache_gib if args.kv_cache_gib is not None else DEFAULT_CPU_KV_GIB
        n = max(4, int(gib * GIB // per_block))
        log.info("KV cache: %d blocks x %d tokens = %d tokens (%.2f GiB, from %s)", n, args.block_size,
                 n * args.block_size, n * per_block / GIB,
                 f"--kv-cache-gib {gib}" if args.kv_cache_gib is not None else "the CPU default of 1 GiB")
        return n
    total, available = device_memory("cpu" if not cuda else device)
    if not cuda:         # the ranks of a group share the host's memory
        total, available = total // tp, available // tp
    weights = sum(torch.Size(shape).numel() for _, shape, _ in shard_specs(param_specs(mc, tdt), mc.vocab_size, 0, tp))
    weights = (weights + lora_numel) * b
    act = activation_bytes(mc, args.max_num_batched_tokens, args.max_num_seqs, b)
    fixed = CUDA_FIXED_BYTES if cuda else 0
    prewarm = 0
    if getattr(args, "prewarm", False):   # a standby's scratch engine runs beside the live engine
        from .prewarm import peak_bytes
        prewarm = peak_bytes(mc, args.block_size, args.max_num_seqs, args.max_num_batched_tokens, b)
    budget = int(util * total)
    kv = budget - weights - act - fixed - prewarm
    need = -(-args.max_model_len // args.block_size) * per_block
    where = f"{util} of {total / GIB:.1f} GiB = {budget / GIB:.2f} GiB: weights " \
            f"{weights / GIB:.2f} GiB{' (LoRA adapters included)' if lora_numel else ''}, " \
            f"activations ~{act / GIB:.2f} GiB (estimated), {fixed / GIB:.1f} GiB reserved" \
            + (f", a standby's pre-warm ~{prewarm / GIB:.2f} GiB (estimated)" if prewarm else "")
    if kv < need:
        raise OptionError(f"--gpu-memory-utilization {where}, leaves {max(kv, 0) / GIB:.2f} GiB for the KV cache; "
                          f"one sequence of --max-model-len {args.max_model_len} needs {need / GIB:.2f} GiB: raise "
                          "--gpu-memory-utilization, lower --max-model-len / --max-num-batched-tokens, "
                          + ("give --no-prewarm (the standby then skips its pre-warm, and its first step after a "
                             "take-over loads its kernels), " if prewarm and kv + prewarm >= need else "")
                          + "or give --kv-cache-gib")
    n = int(kv // per_block)
    if budget > available:
        log.warning("the device has %.2f GiB available and --gpu-memory-utilization %s asks for %.2f GiB: fine if "
                    "the anchor daemon already holds this model's weights and KV cache from an earlier run; "
                    "otherwise allocation will fail (lower it, or stop what else uses the device)",
                    available / GIB, util, budget / GIB)
    log.info("KV cache: %d blocks x %d tokens = %d tokens (%.2f GiB; %.1f sequences of %d tokens), from "
             "--gpu-memory-utilization %s", n, args.block_size, n * args.block_size, n * per_block / GIB,
             n * args.block_size / args.max_model_len, args.max_model_len, where)
    return n
