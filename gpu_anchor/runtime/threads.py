"""Which threads a process runs, and which of them make a fork unsafe (torch-free).

A fork copies one thread.  Every other thread's held locks and half-updated structures are
copied as they are, with nobody left to release or finish them.  Safe to fork past:

- the calling thread;
- OpenBLAS's thread server (numpy's BLAS starts it at import): OpenBLAS registers
  ``pthread_atfork(blas_thread_shutdown_)``, which stops those threads before the fork and
  lets them restart on the next BLAS call (tests/test_runtime.py forks past them and runs a
  BLAS call in the child);
- jemalloc's background threads (``jemalloc_bg_thd``; seen in the H200 image's interpreters,
  from a library linked with jemalloc): jemalloc registers ``pthread_atfork`` handlers that
  take every arena and background-thread lock before the fork and, in the child, mark the
  background threads as not running and re-create them lazily — it is built to be forked
  past them.

Everything else is foreign: other Python threads, an OpenMP team (GNU libgomp keeps its
pool's bookkeeping across fork but not its threads: the child's next parallel region waits
for them forever), gloo's and the TCP store's threads, CUDA's, a tokenizer's pool.
"""
from __future__ import annotations

import ctypes
import os
import threading


def os_threads() -> dict[int, str]:
    """``{tid: name}`` of every thread of this process (from /proc)."""
    out = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return {threading.get_native_id(): threading.current_thread().name}
    for t in tids:
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                out[int(t)] = f.read().strip()
        except OSError:
            pass     # exited meanwhile
    return out


def _openblas_servers() -> int:
    """How many OpenBLAS server threads run (0 if no OpenBLAS is loaded)."""
    libs = set()
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(None, 1)[-1]
                if "openblas" in os.path.basename(path).lower() and ".so" in path:
                    libs.add(path)
    except OSError:
        return 0
    n = 0
    for path in libs:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for sym in ("scipy_openblas_get_num_threads64_", "openblas_get_num_threads64_",
                    "openblas_get_num_threads", "scipy_openblas_get_num_threads"):
            fn = getattr(lib, sym, None)
            if fn is not None:
                fn.restype = ctypes.c_int
                n += max(0, fn() - 1)     # the calling thread is one of them
                break
    return n


FORK_SAFE_NAMES = frozenset({"jemalloc_bg_thd"})     # see the module docstring


def foreign_threads() -> list[str]:
    """Threads other than the caller that a fork would copy into trouble (see the module
    docstring), as ``"tid name"``; empty means a fork here is safe."""
    me = threading.get_native_id()
    python = {t.native_id for t in threading.enumerate()} - {me}
    tasks = os_threads()
    out = [f"{tid} {tasks.get(tid, '?')} (a Python thread)" for tid in sorted(python) if tid in tasks]
    native = sorted(tid for tid in tasks if tid != me and tid not in python)
    blas = _openblas_servers() if native else 0
    # OpenBLAS's servers are unnamed; so is an OpenMP team: only more unnamed threads than
    # OpenBLAS accounts for are foreign, named ones always are
    exe = tasks.get(me, "")
    unnamed = [tid for tid in native if tasks[tid] == exe]
    named = [tid for tid in native if tasks[tid] != exe and tasks[tid] not in FORK_SAFE_NAMES]
    out += [f"{tid} {tasks[tid]}" for tid in named]
    if len(unnamed) > blas:
        out += [f"{tid} {tasks[tid]} (unnamed native: an OpenMP team?)" for tid in unnamed[blas:]]
    return out
