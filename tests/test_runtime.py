"""The process runtime (``gpu_anchor.runtime``, docs/runtime.md): its fork rules and what a
forked child gets.  Each case runs in a fresh interpreter, so no thread of this test process
(pytest runs many) is in the picture."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _py(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("PYTHONFAULTHANDLER", None)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_fork_refuses_while_a_python_thread_runs():
    r = _py("""
        import threading, time
        from gpu_anchor import runtime
        threading.Thread(target=time.sleep, args=(30,), daemon=True, name="busy").start()
        try:
            runtime.fork(lambda: None)
        except runtime.ForkUnsafe as e:
            print("refused:", e)
    """)
    assert r.returncode == 0 and "refused:" in r.stdout and "Python thread" in r.stdout, r.stdout + r.stderr


def test_fork_refuses_after_an_openmp_team_started():
    """The CI hang's ingredient: a process that ran a parallel CPU op holds a GNU OpenMP team;
    a child forked from it would wait for that team forever at its first parallel op."""
    r = _py("""
        import torch
        from gpu_anchor import runtime
        assert runtime.foreign_threads() == [], runtime.foreign_threads()
        torch.set_num_threads(2)
        torch.ones(1 << 22).add_(1)           # a parallel region: libgomp starts its team
        try:
            runtime.fork(lambda: None)
            print("forked")
        except runtime.ForkUnsafe as e:
            print("refused:", e)
    """)
    assert r.returncode == 0 and "refused:" in r.stdout and "OpenMP" in r.stdout, r.stdout + r.stderr


_FORK_AFTER_CUDA = """
    from gpu_anchor import runtime
    for reason in (None, "a test driver's children touch no thread of this process"):
        try:
            runtime.fork(lambda: None, unsafe_ok=reason)
            print("forked")
        except runtime.ForkUnsafe as e:
            print("refused:", e)
"""


def test_fork_refuses_once_cuda_was_initialised():
    """A child forked after CUDA was initialised fails at its first CUDA call, which torch's
    optimizers make even for CPU tensors ("CUDA error: initialization error", seen on an H100):
    the fork is refused, naming CUDA, even with a reason to fork past foreign threads.  Without
    a GPU here torch's answer is put in place (the GPU test below runs the real one)."""
    r = _py(textwrap.dedent("""
        import torch
        torch.cuda.is_initialized = lambda: True
    """) + textwrap.dedent(_FORK_AFTER_CUDA))
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and len(lines) == 2, r.stdout + r.stderr
    assert all(line.startswith("refused:") and "initialised CUDA" in line for line in lines), r.stdout


@pytest.mark.gpu
def test_fork_refuses_once_cuda_was_initialised_on_a_gpu():
    r = _py(textwrap.dedent("""
        import torch
        torch.zeros(1, device="cuda")
    """) + textwrap.dedent(_FORK_AFTER_CUDA))
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and len(lines) == 2, r.stdout + r.stderr
    assert all(line.startswith("refused:") and "initialised CUDA" in line for line in lines), r.stdout


def test_fork_past_openblas_threads_and_blas_works_in_the_child():
    r = _py("""
        import os, numpy as np
        from gpu_anchor import runtime
        a = np.random.rand(300, 300)
        a @ a                                  # OpenBLAS's server threads run
        assert len(runtime.os_threads()) > 1 and runtime.foreign_threads() == [], runtime.foreign_threads()
        def child():
            b = np.random.rand(400, 400)
            assert np.allclose(b @ np.eye(400), b)
        pid = runtime.fork(child)
        print("status", os.waitpid(pid, 0)[1])
    """)
    assert r.returncode == 0 and "status 0" in r.stdout, r.stdout + r.stderr


def test_child_setup_and_exit_path():
    r = _py("""
        import ctypes, faulthandler, gc, os, signal, sys
        from gpu_anchor import runtime
        junk = [object() for _ in range(1000)]
        parent = os.getpid()
        def child():
            libc = ctypes.CDLL(None)
            sig = ctypes.c_int()
            libc.prctl(2, ctypes.byref(sig))          # PR_GET_PDEATHSIG
            assert sig.value == signal.SIGKILL, sig.value
            assert os.getpgid(0) == os.getpid()       # its own process group
            assert gc.get_freeze_count() > 1000       # the parent's objects are frozen out of its GC
            assert faulthandler.is_enabled()
            assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
            raise SystemExit(3)
        pid = runtime.fork(child, new_process_group=True)
        assert gc.get_freeze_count() == 0             # the parent's collector is as it was
        print("exit", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
        pid = runtime.fork(lambda: 1 / 0)
        print("exit", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
    """)
    assert r.returncode == 0 and r.stdout.split() == ["exit", "3", "exit", "1"], r.stdout + r.stderr
    assert "ZeroDivisionError" in r.stderr


def test_sigabrt_prints_the_childs_stack():
    r = _py("""
        import os, signal, sys, time
        from gpu_anchor import runtime
        def stuck_somewhere_recognisable():
            time.sleep(60)
        pid = runtime.fork(stuck_somewhere_recognisable)
        time.sleep(1.0)
        os.kill(pid, signal.SIGABRT)
        print("exit", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
    """)
    assert "exit -6" in r.stdout, r.stdout + r.stderr
    assert "Fatal Python error: Aborted" in r.stderr and "stuck_somewhere_recognisable" in r.stderr


def test_a_child_dies_with_its_parent():
    r = _py("""
        import time
        from gpu_anchor import runtime
        print(runtime.fork(lambda: time.sleep(60)), flush=True)
    """)
    pid = int(r.stdout.split()[0])
    deadline = time.time() + 10
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    raise AssertionError("the child outlived its parent")


def test_jemalloc_background_threads_are_not_foreign_but_others_are(monkeypatch):
    """jemalloc is built to be forked past its background threads (its atfork handlers); a
    CUDA driver thread (what NVML left in serve's supervisor on an H200) is not."""
    import threading

    from gpu_anchor.runtime import threads
    me = threading.get_native_id()
    exe = threads.os_threads()[me]
    monkeypatch.setattr(threads, "os_threads", lambda: {me: exe, me + 1: "jemalloc_bg_thd"})
    assert threads.foreign_threads() == []
    monkeypatch.setattr(threads, "os_threads", lambda: {me: exe, me + 1: "jemalloc_bg_thd", me + 2: "cuda00002400000a"})
    assert threads.foreign_threads() == [f"{me + 2} cuda00002400000a"]


def test_serve_supervisor_keeps_nvml_in_a_child():
    """serve's supervisor forks engines itself: its device-health probe must leave no thread here."""
    from gpu_anchor.launch import health
    from gpu_anchor.runtime.threads import foreign_threads
    before = foreign_threads()
    h = health.ProbedDeviceHealth([0])
    try:
        healthy, problem = h.check()
        assert healthy in (True, False, None) and isinstance(problem, str)
        assert foreign_threads() == before
    finally:
        h.close()
