"""``gpu-anchor serve MODEL_DIR [--random-weights]``: frontend process + engine supervisor.

Process tree::

    gpu-anchor serve            supervisor + zygote: imports torch/transformers, runs no torch op
      ├── frontend              python -m gpu_anchor.serve.frontend (torch-free, owns HTTP clients)
      └── engine (forked)       maps anchored weights/KV, restores, serves; re-forked when it dies

The supervisor forks each engine from an interpreter that has imported torch and
transformers but never started a thread pool or touched CUDA, so a new engine is ready in
well under a second plus its bind/restore.  It ensures the device's anchor daemon runs
(``--no-anchor`` skips it: the benchmark baseline; a restarted engine then starts empty and
the frontend re-sends every open request).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time

log = logging.getLogger("gpu_anchor.serve")


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="OpenAI-compatible server whose requests survive engine crashes",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=main)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="model directory (config.json + *.safetensors [+ tokenizer.json]); with "
                                 "--random-weights, a config.json or a directory holding one")
    p.add_argument("--random-weights", action="store_true", help="seeded random weights instead of safetensors")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument("--tokenizer", default=None, help="directory with tokenizer.json (default: the model dir)")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--port-file", default=None, help="write the bound HTTP port here (for --port 0)")
    p.add_argument("--device", default=None, help="cuda:N or cpu (default: cuda:0 if available)")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 | float64 (default: bf16 on CUDA)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks (default: from --kv-cache-gib)")
    p.add_argument("--kv-cache-gib", type=float, default=1.0)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--namespace", default=None, help="anchor namespace (default: serve-<model name>)")
    p.add_argument("--socket", default=None, help="daemon socket (default: the device's standard one)")
    p.add_argument("--cpu-threads", type=int, default=None, help="torch threads of the engine on the CPU")
    p.add_argument("--no-anchor", action="store_true", help="plain allocations, no journal (baseline)")
    p.add_argument("--no-cuda-graphs", "--enforce-eager", action="store_true",
                   help="decode steps run the eager forward (default on CUDA: replayed CUDA graphs)")
    p.add_argument("--warm-pool", action="store_true",
                   help="keep a standby engine process (CUDA context created, kernels warmed) that takes over "
                        "at once when the engine dies, instead of a fork + CUDA init")
    p.add_argument("--prewarm", action="store_true",
                   help="with --warm-pool (implied): the standby also runs a 1-layer scratch engine of the same "
                        "shapes through prefill and decode before any failure, so the first step after a "
                        "take-over finds its kernels loaded (never touches the live engine's state)")
    p.add_argument("--fault-plan", default=None, metavar="SEED:MAXSTEP[:LIMIT]",
                   help="testing: each engine SIGKILLs itself at a random step <= MAXSTEP and phase, "
                        "for the first LIMIT engines (default: all)")


def _fault_for(plan: str | None, incarnation: int):
    if not plan:
        return None
    from .engine import PHASES
    parts = [int(x) for x in plan.split(":")]
    seed, maxstep = parts[0], parts[1]
    if len(parts) > 2 and incarnation >= parts[2]:
        return None
    rng = random.Random(seed * 1_000_003 + incarnation)
    return (rng.randint(0, maxstep), rng.choice(PHASES))


STANDBY_AFTER_S = 2.0


def _dtype(name: str):
    from .engine import DTYPES
    return DTYPES.get(name)


def _standby_prepare(cfg, prewarm: bool) -> dict:
    """A standby's start-up, on scratch tensors only: CUDA context and cuBLAS, then (``--prewarm``)
    the scratch engine of ``serve.prewarm``."""
    from gpu_anchor.runtime.warm import warm_cuda
    info = warm_cuda(cfg.device, _dtype(cfg.dtype))
    if prewarm:
        from .prewarm import warm_engine
        info.update(warm_engine(cfg))
    return info


def _standby_run(cfg, esock: str, go: dict, worker) -> None:
    """The standby takes over: what is only known now comes in ``go``."""
    import dataclasses
    c = dataclasses.replace(cfg, device=go["device"], socket=go["socket"],
                            fault=tuple(go["fault"]) if go.get("fault") else None)
    worker.run(c, esock, started_at=go["started"], standby=True)


def _follow_migration(cfg, path: str) -> None:
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
    import torch
    from .engine import EngineConfig
    from .model_runner import head_dim
    if args.device is None:
        # The NVML check does not initialise the CUDA driver here: forked engines could not use it.
        os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    device = args.device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    num_blocks = args.num_blocks
    if num_blocks is None:
        per_block = 2 * mc.num_hidden_layers * args.block_size * mc.num_key_value_heads * head_dim(mc)
        per_block *= {"float64": 8, "float32": 4}.get(dtype, 2)
        num_blocks = max(4, int(args.kv_cache_gib * (1 << 30) // per_block))
    name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
    return EngineConfig(model=args.model, random_weights=args.random_weights, seed=args.seed, device=device,
                        dtype=dtype, block_size=args.block_size, num_blocks=num_blocks,
                        max_num_seqs=args.max_num_seqs, max_batched_tokens=args.max_batched_tokens,
                        max_model_len=args.max_model_len, anchor=not args.no_anchor,
                        namespace=args.namespace or f"serve-{name}", socket=args.socket,
                        cpu_threads=args.cpu_threads, cuda_graphs=False if args.no_cuda_graphs else None)


def main(args) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s serve %(levelname)s %(message)s")
    args.warm_pool |= args.prewarm
    # The zygote role: import the heavy modules once, run nothing that starts threads.
    import torch  # noqa: F401
    from .model_runner import load_config
    try:
        mc = load_config(args.model)
    except (ValueError, FileNotFoundError) as e:
        print(f"gpu-anchor serve: {e}", file=sys.stderr)
        return 2
    from . import worker
    from .model_runner import meta_model
    meta_model(mc)        # imports the modeling code once, here, for every forked engine
    cfg = engine_config(args, mc)
    if cfg.anchor:
        from gpu_anchor.client import control
        from gpu_anchor.paths import default_socket, normalize_device
        dev = "cpu" if cfg.device == "cpu" else normalize_device(cfg.device)
        path = args.socket or default_socket(dev)
        if control.ping(dev, path) is None:
            control.start(dev, path)
            log.info("started the anchor daemon for %s at %s", dev, path)
        cfg.socket = path
    rundir = tempfile.mkdtemp(prefix="gpu-anchor-serve-")
    esock = os.path.join(rundir, "engine.sock")
    name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
    tok = args.tokenizer or (args.model if os.path.isdir(args.model) else None)
    fe_cmd = [sys.executable, "-m", "gpu_anchor.serve.frontend", "--engine-socket", esock,
              "--vocab-size", str(mc.vocab_size), "--model-name", name, "--max-model-len", str(cfg.max_model_len),
              "--host", args.host, "--port", str(args.port)]
    if tok:
        fe_cmd += ["--tokenizer", tok]
    if args.port_file:
        fe_cmd += ["--port-file", args.port_file]
    frontend = subprocess.Popen(fe_cmd)
    if threading.active_count() != 1:
        log.warning("%d threads before forking engines: fork may be unsafe", threading.active_count())
    stopping = False

    def on_signal(signum, frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    from gpu_anchor.runtime import Standby, wait_exit
    incarnation, engine, quick_failures = 0, None, 0
    standby = None
    started = 0.0
    try:
        while not stopping:
            if frontend.poll() is not None:
                log.error("frontend exited (%s); stopping", frontend.returncode)
                break
            if engine is None:
                cfg.fault = _fault_for(args.fault_plan, incarnation)
                _follow_migration(cfg, worker.placement_path(esock))
                started = time.time()
                if standby is not None and standby.ready(timeout=10.0):
                    try:
                        engine = standby.go({"started": started, "device": cfg.device, "socket": cfg.socket,
                                             "fault": cfg.fault})
                    except OSError:              # the standby died meanwhile: start one the usual way
                        log.warning("the warm standby is gone; forking an engine")
                if engine is None:
                    if standby is not None:
                        standby.close()
                    engine = os.fork()
                    if engine == 0:
                        signal.signal(signal.SIGTERM, signal.SIG_DFL)
                        signal.signal(signal.SIGINT, signal.SIG_DFL)
                        code = 0
                        try:
                            worker.run(cfg, esock, started_at=started)
                        except BaseException:
                            logging.getLogger("gpu_anchor.serve").exception("engine failed")
                            code = 1
                        finally:
                            os._exit(code)
                standby = None
                incarnation += 1
            if args.warm_pool and standby is None and time.time() - started > STANDBY_AFTER_S:
                # made once the engine has started, so its CUDA init does not slow that one's
                standby = Standby(lambda: _standby_prepare(cfg, args.prewarm),
                                  lambda go: _standby_run(cfg, esock, go, worker))
            r = wait_exit(engine, 0.25)      # a pidfd: the death is seen when it happens
            if r is None:
                continue
            pid, status = r
            engine = None
            how = (f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit {os.WEXITSTATUS(status)}")
            log.warning("engine %d died (%s) after %.2f s; restarting", pid, how, time.time() - started)
            if os.WIFEXITED(status) and os.WEXITSTATUS(status) != 0 and time.time() - started < 30:
                quick_failures += 1
                if quick_failures >= 3:
                    log.error("the engine failed 3 times in a row at start-up; giving up")
                    return 1
            else:
                quick_failures = 0
    finally:
        if standby is not None:
            standby.close()
        if engine:
            os.kill(engine, signal.SIGKILL)
            os.waitpid(engine, 0)
        if frontend.poll() is None:
            frontend.terminate()
            try:
                frontend.wait(10)
            except subprocess.TimeoutExpired:
                frontend.kill()
    return 0


def cli(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="gpu-anchor")
    sub = ap.add_subparsers(dest="cmd", required=True)
    add_parser(sub)
    args = ap.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)
