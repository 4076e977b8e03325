"""``gpu-anchor torchrun``: this node's daemons + torch's own elastic launcher.

    gpu-anchor torchrun [--namespace NS] [--keep-daemons] [--checkpoint-dir D --checkpoint-every N]
                        [--device-type auto|cuda|cpu]  <torchrun options>  train.py ARGS

Torch elastic does the rendezvous (c10d, etcd, ...) and the restarts
(``--max-restarts``); gpu-anchor adds what torchrun lacks: the daemons (started
or reused here, one per local GPU plus the host daemon, kept up across elastic
restarts, re-started by a watcher if one dies) and the worker bootstrap
(``python -m gpu_anchor.launch.worker train.py ...``) so a restarted worker
reattaches — and, if its namespaces hold no committed step while a complete
checkpoint exists, restores that checkpoint first (``GPU_ANCHOR_RESTORE=auto:DIR``).
Run one per node, as with torchrun.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time

from gpu_anchor.paths import socket_dir

from . import daemons as daemons_mod, jobstate
from gpu_anchor.checkpoint.settings import CheckpointSettings


def _split(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="gpu-anchor torchrun", add_help=False)
    p.add_argument("--namespace")
    p.add_argument("--keep-daemons", action="store_true")
    p.add_argument("--checkpoint-dir")
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--checkpoint-keep", type=int, default=2)
    p.add_argument("--device-type", default="auto", choices=["auto", "cuda", "cpu"])
    return p.parse_known_args(argv)


def main(argv: list[str]) -> int:
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    ours, rest = _split(argv)
    from torch.distributed import run as trun
    args = trun.get_args_parser().parse_args(rest)
    if args.no_python:
        raise SystemExit("gpu-anchor torchrun: --no-python is not supported (the worker bootstrap is Python)")
    target = (["-m", args.training_script] if args.module else [args.training_script]) + list(args.training_script_args)
    stem = os.path.splitext(os.path.basename(args.training_script))[0]
    namespace = ours.namespace or os.environ.get("GPU_ANCHOR_NAMESPACE") or f"job-{stem}"
    nproc = trun.determine_local_world_size(args.nproc_per_node)
    devices = daemons_mod.local_devices(ours.device_type, nproc)

    env = {"GPU_ANCHOR_NAMESPACE": namespace, "GPU_ANCHOR_SOCKET_DIR": socket_dir()}
    if ours.checkpoint_dir:
        d = os.path.abspath(ours.checkpoint_dir)
        env.update(CheckpointSettings(d if ours.checkpoint_every else None, ours.checkpoint_every,
                                      ours.checkpoint_keep, restore=f"auto:{d}").to_env())
    # With the rendezvous TCP store shared with the workers (torch's default), a restarted
    # group finds the previous round's process-group keys in that same store and hangs or
    # fails in init_process_group (seen with gloo on torch 2.13): give each round its own.
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1"))
    os.environ.update(env)  # torch elastic passes its environment on to the workers

    log = lambda m: print(f"[gpu-anchor] {m}", file=sys.stderr, flush=True)  # noqa: E731
    dm = daemons_mod.JobDaemons(devices, namespace, ours.keep_daemons, log)
    dm.ensure()
    # the job record `gpu-anchor status` shows (torch elastic restarts the workers itself: what
    # this process decides, and records, is the daemons' replacement)
    state = jobstate.JobState(namespace, ["gpu-anchor", "torchrun", *argv], nproc, devices, False, kind="torchrun")
    state.set(state="running")
    stop = threading.Event()

    def watch():  # a dead daemon is replaced so that elastic's next restart can restore into it
        while not stop.wait(1.0):
            alive, _, problems = dm.check()
            if not alive:
                reason = (f"daemon problem ({'; '.join(problems)}): a fresh daemon; workers restore from the "
                          "checkpoint on their next start")
                log(reason)
                dm.replace_dead()
                state.add_restart({"action": "restore", "kind": "destructive", "reason": reason, "step": None,
                                   "t_detect": time.time(), "recovery_s": None})
    threading.Thread(target=watch, name="gpu-anchor-daemon-watch", daemon=True).start()

    args.module = True
    args.training_script = "gpu_anchor.launch.worker"
    args.training_script_args = target
    ok = False
    try:
        trun.run(args)
        ok = True
        state.set(state="done", result="success")
        return 0
    except Exception as e:  # ChildFailedError: torch elastic already printed the details
        log(f"torchrun failed: {type(e).__name__}; anchored state kept in namespace {namespace!r}")
        state.set(state="stopped", result=f"torchrun failed: {type(e).__name__}")
        dm.keep = True
        return 1
    finally:
        stop.set()
        if ok and not ours.keep_daemons:
            dm.drop_namespace()
        for said in dm.stop():
            log(said)
