"""``gpu-anchor serve MODEL_DIR [--random-weights]``: the frontend process and the engine,
under the one supervisor (the decision table and job record of ``run``; its crash-loop rule is
serving's own, ``serve_state.EngineFailures``).

Process tree::

    gpu-anchor serve            supervisor + fork server: imports torch/transformers, runs no torch op
      ├── frontend              python -m gpu_anchor.serve.frontend (torch-free, owns HTTP clients)
      └── engine (forked)       maps anchored weights/KV, restores, serves; re-forked when it dies
          [ranks 1..N-1]        with --tensor-parallel-size N: one engine process per device

The supervisor forks each engine (``gpu_anchor.runtime.fork``) from an interpreter that has
imported torch and transformers but never started a thread pool or touched CUDA, so a new
engine is ready in well under a second plus its bind/restore; ``--warm-pool`` keeps a
``runtime.Standby`` engine instead.  When the engine dies the supervisor decides as for
training (``classify.decide``): shallow (daemon alive, same instance, journal consistent) →
restart in place, the new engine reattaches; the anchored state lost (the daemon died or was
replaced, the namespace dropped, the state marked inconsistent) → a fresh daemon or namespace
and an engine that loads the weights and recomputes every open request from the tokens its
client already has, which the frontend re-sends (serving's "restore"); engines that keep
failing before publishing a token → give up: every open request ends with an error event and
``/health`` answers 503 until the server is stopped.  While an engine runs, its daemon is
watched (an idle connection: its death is seen at once; the namespace once a second), so a
state lost under a live engine is acted on before the engine trips over it.  The state machine
and its invariants: docs/serving.md, "Destructive failures".  On SIGINT/SIGTERM the server ends
every open stream with an error event, frees its namespace and stops the daemon it started
(``--keep-state`` keeps both).  The job record (``gpu-anchor status``) shows the engine, its
restarts and decisions.  The engines' lifecycle (start, watch, exits, restarts, shutdown):
``launch/serve_engines.py``; the standby, the engines' lifelines and the take-over at a
lifeline's end (before the dead engine's exit): ``launch/serve_standby.py``.  ``--no-anchor`` (the
benchmark baseline) starts no daemon; a
restarted engine starts empty.  The engine side (arguments, engine configuration, the
standby's warm-up) is ``gpu_anchor.serve.cli``.

With ``--tensor-parallel-size N`` the engine is a group of N processes (``serve/tp.py``),
forked together and watched together: the death of any rank is one failure of the whole
group (its process group is broken), so the others are killed, the group's exits are
classified once, and a new group is forked; every daemon the group uses is watched, and a
lost one restores the whole group (docs/serving.md, "Tensor parallelism").
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time

from . import jobstate
from .serve_engines import EngineSupervisor
from .serve_state import AnchorGroup

log = logging.getLogger("gpu_anchor.serve")


def add_parser(subparsers) -> argparse.ArgumentParser:
    from gpu_anchor.serve.cli import add_arguments
    p = subparsers.add_parser("serve", help="OpenAI-compatible server whose requests survive engine crashes",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.add_argument("--max-restarts", type=int, default=None,
                   help="stop after this many engine restarts (default: no limit)")
    p.add_argument("--keep-state", action="store_true",
                   help="on SIGINT/SIGTERM keep the namespace (weights, KV cache) and the daemon this server "
                        "started, so the next `gpu-anchor serve` of the model maps them again instead of loading "
                        "(default: free the namespace and stop the daemon it started)")
    p.set_defaults(func=main)
    return p


def main(args) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s serve %(levelname)s %(message)s")
    started_at = time.time()
    from gpu_anchor.serve import cli as engine_cli
    from gpu_anchor.serve import options
    try:
        options.check(args)
    except options.OptionError as e:
        print(f"gpu-anchor serve: {e}", file=sys.stderr)
        return 2
    from gpu_anchor.serve import hub
    try:
        hub.resolve(args)        # a hub id: its files, fetched before torch and before any fork
    except hub.ModelNotFound as e:
        print(f"gpu-anchor serve: {e}", file=sys.stderr)
        return 2
    # The fork server's role: import the heavy modules once, run nothing that starts threads.
    import torch  # noqa: F401
    from gpu_anchor.serve.model_runner import load_config, meta_model
    try:
        mc = load_config(args.model)
    except (ValueError, FileNotFoundError) as e:
        print(f"gpu-anchor serve: {e}", file=sys.stderr)
        return 2
    from gpu_anchor.checkpoint import migrate
    from gpu_anchor.serve import migration, worker
    migration.provide(migrate)   # `gpu-anchor migrate` moves engine state with the checkpoint library
    meta_model(mc)        # imports the modeling code once, here, for every forked engine
    try:
        cfg = engine_cli.engine_config(args, mc)
    except options.OptionError as e:
        print(f"gpu-anchor serve: {e}", file=sys.stderr)
        return 2
    args.warm_pool |= bool(args.prewarm or args.hot_standby)     # engine_config resolved their defaults
    log.info("standby: %s", "hot, pre-warmed" if args.hot_standby and args.prewarm else "hot" if args.hot_standby
             else "warm, pre-warmed" if args.prewarm else "warm" if args.warm_pool else
             "none (a fresh engine is forked after a failure)")
    if cfg.anchor:
        from gpu_anchor.paths import default_socket, normalize_device
        cfg.socket = args.socket or default_socket(normalize_device(cfg.device))
    try:
        lock = jobstate.lock(cfg.namespace)
    except jobstate.JobBusy as e:
        print(f"gpu-anchor serve: {e}", file=sys.stderr)
        return 2
    rundir = tempfile.mkdtemp(prefix="gpu-anchor-serve-")
    try:
        template = options.chat_template_file(args.chat_template, rundir)
    except options.OptionError as e:
        print(f"gpu-anchor serve: {e}", file=sys.stderr)
        lock.close()
        return 2
    try:
        defaults = options.generation_defaults(args.generation_config, args.model if not args.random_weights else None)
    except options.OptionError as e:
        print(f"gpu-anchor serve: {e}", file=sys.stderr)
        lock.close()
        return 2
    structured = args.structured          # checked with the other options (options.check)
    if defaults:
        log.info("sampling defaults from the model's generation config: %s (requests that give a field keep "
                 "theirs; --generation-config vllm uses vLLM's own defaults)", json.dumps(defaults))
    ranks = engine_cli.rank_configs(cfg)
    anchor = AnchorGroup(ranks)
    anchor.ensure()
    esock = os.path.join(rundir, "engine.sock")
    name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
    tok = args.tokenizer or (args.model if os.path.isdir(args.model) else None)
    # the supervisor's line to the frontend: "restore" and "fatal" go down it; its end closing
    # tells the frontend that the supervisor is gone
    control, fe_end = socket.socketpair()
    fe_cmd = [sys.executable, "-m", "gpu_anchor.serve.frontend", "--engine-socket", esock,
              "--vocab-size", str(mc.vocab_size), "--model-name", name, "--max-model-len", str(cfg.max_model_len),
              "--host", args.host, "--port", str(args.port), "--started-at", repr(started_at),
              "--control-fd", str(fe_end.fileno())]
    if tok:
        fe_cmd += ["--tokenizer", tok]
    if template:
        fe_cmd += ["--chat-template", template]
    if args.enable_auto_tool_choice:
        fe_cmd += ["--tool-call-parser", args.tool_call_parser]
    if args.reasoning_parser:
        fe_cmd += ["--reasoning-parser", args.reasoning_parser]
    if structured:
        fe_cmd += ["--structured-outputs", json.dumps(structured)]
    if defaults:
        fe_cmd += ["--sampling-defaults", json.dumps(defaults)]
    if cfg.lora:
        fe_cmd += ["--lora-modules", json.dumps(dict(cfg.lora))]
    if cfg.runtime_lora:
        fe_cmd += ["--runtime-lora"]
    if args.port_file:
        fe_cmd += ["--port-file", args.port_file]
    key = options.api_key(args)      # in the environment: a command line is visible to every user
    frontend = subprocess.Popen(fe_cmd, env=dict(os.environ, GPU_ANCHOR_SERVE_API_KEY=key or ""),
                                pass_fds=[fe_end.fileno()])
    fe_end.close()
    state = jobstate.JobState(cfg.namespace, ["gpu-anchor", "serve", *sys.argv[1:]], len(ranks),
                              [] if cfg.device == "cpu" else [c.device for c in ranks], True, kind="serve")
    state.set(frontend_pid=frontend.pid, engine_socket=esock)
    sup = EngineSupervisor(args, ranks, esock, worker, engine_cli, anchor, state, frontend, control)
    clean = False
    try:
        rc = sup.run()
        clean = sup.stopping is not None
        return rc
    finally:
        sup.shutdown(clean)
        lock.close()


def cli(argv=None) -> int:
    """``python -m gpu_anchor.serve ARGS`` = ``gpu-anchor serve ARGS``."""
    ap = argparse.ArgumentParser(prog="gpu-anchor")
    sub = ap.add_subparsers(dest="cmd", required=True)
    add_parser(sub)
    args = ap.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)
