"""The recovery benchmarks' standby modes, for every method alike, on the product's standby.

Modes ``standby`` and ``prewarm`` of ``bench recovery_train`` / ``bench recovery_serve``:
before the fault, the driver asks the warm fork server for a standby (``gpu_anchor.runtime.Standby``,
made by ``gpu_anchor.launch.zygote`` exactly as ``gpu-anchor run``'s per-rank pool makes its
own): a process forked from the server that imported torch, transformers and the model code,
made its CUDA context and (``prewarm``) ran the method's pre-warm function — one step of a
1-layer scratch copy of the model (training) or a 1-layer scratch engine (serving) — so that
its kernels and cuBLAS heuristics are loaded; the server reports it ready.  After the SIGKILL
the driver hands it the worker's command line and it runs it: the method restores its own
state (gpu-anchor maps the daemon's objects; a baseline reads its checkpoint or KV mirror,
or reloads its weights).  A standby touches no live state before the fault, so every method
pays its own restore after the hand-over; the standby saves every method the same things
(process start, imports, CUDA context, first-time kernel loading).
"""
from __future__ import annotations

import json

STANDBY_MODES = ("standby", "prewarm")


def start(launcher, device: str, prewarm: str | None, env_extra: dict | None = None,
          timeout: float = 1800) -> tuple[int, dict]:
    """A ready standby from ``launcher``'s fork server: (its id, the server's ``standby_ready``
    report: ``pid`` and ``info`` — CUDA init and pre-warm times).  ``prewarm``: ``module:function``
    it runs first; ``env_extra``: variables that function reads."""
    from bench.baselines.launcher import worker_env
    env = dict(worker_env(), **(env_extra or {}))
    sid = launcher.zygote.standby(device, env, prewarm)
    return sid, launcher.zygote.wait_standby(sid, timeout)


def release(launcher, sid: int, args: list[str], module: str) -> int:
    """After the fault: standby ``sid`` runs ``python -m module args``; returns its pid."""
    from bench.baselines.launcher import ROOT, worker_env
    return launcher.zygote.go(sid, ["-m", module] + list(args), worker_env(), ROOT)


def dismiss(launcher, sid: int) -> None:
    launcher.zygote.dismiss(sid)


def prewarm_env(name: str, spec) -> dict:
    """The environment entry through which a pre-warm function gets the worker's shapes."""
    return {name: json.dumps(spec)}


IMPL = "runtime.Standby from the fork server"   # results record which standby measured them


def describe_modes(result: dict) -> str:
    """The sentence a recovery table uses to explain the standby modes ("" if it has none)."""
    if not any(m in STANDBY_MODES for rows in result["models"].values() for r in rows for m in r["modes"]):
        return ""
    if result.get("standby_impl") == IMPL:
        how = ("as a standby of the warm fork server (`gpu_anchor.runtime.Standby`, the same one `gpu-anchor run` "
               "keeps per rank), made its CUDA context and waited")
    else:  # measured before issue 20, with the benchmark's own standby
        how = ("from the fork server, made its CUDA context and waited for a file (the benchmark's own standby "
               "before issue 20)")
    return (f" standby: the next worker was started before the fault {how}; prewarm: that standby also ran one "
            "step of a 1-layer scratch copy of the model, so the first real step finds its kernels loaded. Every "
            "method gets the same standby, and every method restores its own state only after the fault.")
