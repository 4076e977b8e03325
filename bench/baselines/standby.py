"""A standby worker for the recovery benchmarks, for every method alike.

Modes ``standby`` and ``prewarm`` of ``bench recovery_train`` / ``bench recovery_serve``:
before the fault, the driver starts the next worker from the warm fork server with
``--standby GO_FILE``.  That worker imports what it needs, makes its CUDA context and (with
``--prewarm``) runs a scratch step of a 1-layer copy of the model, so that its kernels and
cuBLAS heuristics are loaded; then it reports ``standby`` and waits.  After the SIGKILL the
driver writes ``GO_FILE``; the worker reports ``go`` and only then restores its method's
state (gpu-anchor maps the daemon's objects; a baseline reads its checkpoint or KV mirror,
or reloads its weights).  What a standby may not do before the fault is touch the live
state, so every method pays its own restore after ``go``; the standby saves each method the
same things (process start, imports, CUDA context, first-time kernel loading).

``gpu-anchor run --warm-pool/--prewarm`` and ``gpu-anchor serve --warm-pool --prewarm`` are
the product's own standbys; this module is the benchmark's equivalent that a baseline can
use too, so that the comparison stays like with like.
"""
from __future__ import annotations

import json
import os
import time

POLL_S = 0.0005


def release(go_file: str, **payload) -> None:
    """Driver side: let the standby waiting on ``go_file`` take over (atomic: write, rename)."""
    tmp = go_file + ".tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f)
    os.rename(tmp, go_file)


def wait(go_file: str, events, **ready) -> dict:
    """Worker side: report ``standby`` (with ``ready``'s fields), wait for ``release``, report
    ``go``; returns the driver's payload.  Exits the process if the driver goes away first."""
    events("standby", **ready)
    parent = os.getppid()
    while not os.path.exists(go_file):
        if os.getppid() != parent:  # the fork server (or the driver) is gone: nobody will release us
            raise SystemExit("standby: the process that started this standby exited")
        time.sleep(POLL_S)
    with open(go_file) as f:
        payload = json.load(f)
    events("go")
    return payload


def start(launcher, log, worker_args: list[str], directory: str, prewarm: bool, *module,
          timeout: float = 1800) -> tuple[str, int]:
    """Driver side: start a standby with ``launcher`` and wait until it reports ``standby`` in
    ``log``; returns (go file, pid).  ``module``: the worker module, if not the launcher's default."""
    go = os.path.join(directory, f"go-{time.time_ns()}")
    pid = launcher.spawn(worker_args + ["--standby", go] + (["--prewarm"] if prewarm else []), *module)
    log.wait(lambda e: e["ev"] == "standby" and e["pid"] == pid, lambda: launcher.alive(pid), timeout=timeout)
    return go, pid


def add_arguments(p) -> None:
    """The worker's ``--standby`` / ``--prewarm`` options."""
    p.add_argument("--standby", default=None, metavar="GO_FILE",
                   help="start as a standby: prepare, report 'standby', wait for GO_FILE (bench/baselines/standby.py)")
    p.add_argument("--prewarm", action="store_true", help="as a standby, run a 1-layer scratch step first")


STANDBY_MODES = ("standby", "prewarm")


def describe_modes(result: dict) -> str:
    """The sentence a recovery table uses to explain the standby modes ("" if it has none)."""
    if not any(m in STANDBY_MODES for rows in result["models"].values() for r in rows for m in r["modes"]):
        return ""
    return (" standby: the next worker was started from the fork server before the fault, made its CUDA context "
            "and waited (bench/baselines/standby.py); prewarm: that standby also ran one step of a 1-layer "
            "scratch copy of the model, so the first real step finds its kernels loaded. Every method gets the "
            "same standby, and every method restores its own state only after the fault.")
