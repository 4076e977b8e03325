"""A warm standby worker: forked ahead of need, start-up done, waiting for "go".

    sb = Standby(prepare=lambda: warm_cuda("cuda:0"), run=lambda go: serve(go))
    ...                                  # the active worker dies
    pid = sb.go({"started": time.time()})   # the standby becomes the worker at once
    sb = Standby(...)                    # and a new standby is made (later, off the critical path)

The child runs ``prepare`` right after the fork (create the CUDA context, warm cuBLAS on
scratch tensors — never anchored state, which belongs to the active worker; plus the
user's own pre-warm function, ``run_prewarm``), reports ready, then blocks on a pipe.
``go(msg)`` sends ``msg`` (a JSON object: what is only known at take-over, e.g.
placement, fault plan, start time) and the child calls ``run(msg)``, then exits with 0
(1 if it raised).  If the parent dies, the pipe closes
and the standby exits (and ``PR_SET_PDEATHSIG`` kills it).  The fork must happen in a
process that has started no threads that matter (the zygote's rule).

``wait_exit`` waits for a child's death with a pidfd when the kernel has them, so a
death is seen the moment it is reaped, not at the next poll.
"""
from __future__ import annotations

import importlib
import json
import logging
import os
import select
import signal
import time

log = logging.getLogger("gpu_anchor.launch")


class Standby:
    def __init__(self, prepare, run) -> None:
        go_r, go_w = os.pipe()
        ready_r, ready_w = os.pipe()
        self.forked_at = time.time()
        pid = os.fork()
        if pid == 0:
            os.close(go_w)
            os.close(ready_r)
            _child(prepare, run, go_r, ready_w)
        os.close(go_r)
        os.close(ready_w)
        self.pid, self._go_w, self._ready_r = pid, go_w, ready_r
        self.info: dict | None = None
        self.used = False

    def ready(self, timeout: float = 0.0) -> bool:
        """True once the child finished ``prepare`` (``info`` holds what it reported)."""
        if self.info is None and select.select([self._ready_r], [], [], timeout)[0]:
            data = os.read(self._ready_r, 1 << 16)
            self.info = json.loads(data) if data else {"failed": "the standby died while preparing"}
        return self.info is not None and "failed" not in self.info

    def go(self, msg: dict) -> int:
        """Hand the work over; returns the child's pid (now the active worker)."""
        os.write(self._go_w, json.dumps(msg).encode())
        os.close(self._go_w)
        os.close(self._ready_r)
        self.used = True
        return self.pid

    def close(self) -> None:
        """Dismiss an unused standby (kill and reap it)."""
        if self.used:
            return
        self.used = True
        for fd in (self._go_w, self._ready_r):
            try:
                os.close(fd)
            except OSError:
                pass
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


def _child(prepare, run, go_r: int, ready_w: int) -> None:
    code = 0
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        from .zygote import set_pdeathsig
        set_pdeathsig()
        t0 = time.time()
        info = dict(prepare() or {}, prepare_s=time.time() - t0, pid=os.getpid())
        os.write(ready_w, json.dumps(info).encode())
        os.close(ready_w)
        data = b""
        while True:             # the message arrives whole or not at all (one write, then close)
            chunk = os.read(go_r, 1 << 16)
            if not chunk:
                break
            data += chunk
        if not data:
            os._exit(0)         # dismissed, or the parent is gone
        run(json.loads(data))
    except BaseException:
        log.exception("warm standby failed")
        code = 1
    finally:
        os._exit(code)


def warm_cuda(device: str, dtype=None) -> dict:
    """The part of an engine's start-up that touches no anchored state: CUDA context,
    cuBLAS handle and a matmul kernel in ``dtype`` (on scratch tensors)."""
    import torch
    t0 = time.perf_counter()
    if not device.startswith("cuda"):
        return {"cuda_init_s": 0.0}
    dev = torch.device(device)
    torch.cuda.set_device(dev)
    torch.empty(1, device=dev)
    t1 = time.perf_counter()
    a = torch.randn(256, 256, device=dev, dtype=dtype or torch.bfloat16)
    (a @ a).float().softmax(-1).argmax(-1).cpu()
    torch.cuda.synchronize(dev)
    return {"cuda_init_s": t1 - t0, "kernel_warm_s": time.perf_counter() - t1, "device": device}


PREWARM_ENV = "GPU_ANCHOR_PREWARM"


def check_prewarm_spec(spec: str) -> str:
    """``spec`` if it names a function as ``module:function``, else ValueError saying so."""
    mod, sep, fn = spec.partition(":")
    if not (mod and sep and fn.isidentifier()):
        raise ValueError(f"--prewarm wants MODULE:FUNCTION (e.g. mytrain:prewarm), not {spec!r}")
    return spec


def run_prewarm(spec: str, device: str) -> dict:
    """Call the user's pre-warm function ``module:function`` with the standby's device.

    Contract for that function: it runs in the standby before any failure, while the
    active worker is training, so it must touch scratch tensors only — never connect to
    gpu-anchor or bind anchored state, never write files the job reads.  What it is for:
    one step of a small model with the job's shapes (a 1-layer copy of the model, the
    job's batch and sequence length) loads every kernel and cuBLAS heuristic the first
    real step needs; on the H200 that cut a 1B model's first step after a restart from
    0.62 s to 0.14 s (``bench/first_step.py``).  Free what it allocated
    (``torch.cuda.empty_cache()``) if the GPU is tight: the kernels stay loaded."""
    mod, _, fn = check_prewarm_spec(spec).partition(":")
    t0 = time.perf_counter()
    getattr(importlib.import_module(mod), fn)(device)
    return {"prewarm_s": time.perf_counter() - t0, "prewarm": spec}


def wait_exit(pid: int, timeout: float) -> tuple[int, int] | None:
    """``os.waitpid(pid)`` result if ``pid`` exits within ``timeout`` seconds, else None.
    Sleeps on a pidfd (woken at the exit) where available, else polls every 20 ms."""
    r = os.waitpid(pid, os.WNOHANG)
    if r[0] != 0:
        return r
    if hasattr(os, "pidfd_open"):
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            fd = None
        if fd is not None:
            try:
                select.select([fd], [], [], timeout)
            finally:
                os.close(fd)
            r = os.waitpid(pid, os.WNOHANG)
            return r if r[0] != 0 else None
    time.sleep(min(timeout, 0.02))
    r = os.waitpid(pid, os.WNOHANG)
    return r if r[0] != 0 else None
