"""Shared fixtures: real daemons in a private socket directory per test."""
from __future__ import annotations

import gc
import os
import subprocess
import sys

import pytest

from gpu_anchor.client import control
import launch_reference

reference = launch_reference.reference    # one fault-free reference run per session

try:
    import torch

    # Tests fork workers from this interpreter, which runs many tests' threads (the product
    # forks only through gpu_anchor.runtime, from processes that run none: docs/runtime.md).
    # A child forked after the parent ran parallel CPU ops inherits OpenMP's thread-pool
    # bookkeeping but not its threads: its next parallel op waits forever (GNU OpenMP), so
    # every forked child runs intra-op work on one thread.  Objects a forked child inherits
    # are frozen out of its garbage collector: finalizers of the parent's garbage (event
    # loops, tokenizers, thread pools left by earlier tests) must not run in a child that
    # lacks the parent's threads — seen hanging a forked DDP rank before its first
    # instruction.  (``runtime.fork`` does both itself; this covers multiprocessing's forks.)
    def _after_fork_in_child() -> None:
        gc.freeze()
        torch.set_num_threads(1)

    os.register_at_fork(after_in_child=_after_fork_in_child)
except ImportError:
    pass


def _cuda_ready() -> bool:
    """A CUDA GPU and cuda-bindings.  The GPU is counted in a child process: counting it here
    would initialise CUDA in this one, and the CPU kill tests' workers forked from it after that
    fail at their first CUDA query (torch's optimizers ask whether a graph is being captured)
    with "CUDA error: initialization error" (seen on an H100)."""
    try:
        import torch
        from gpu_anchor.cuda_driver import driver
        driver()
    except Exception:
        return False
    if not torch.backends.cuda.is_built():
        return False
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
                         capture_output=True, text=True, timeout=120)
    return out.stdout.strip() == "True"


# The longest test files on CPU (40 s or more each in a clean clone's `.ci/run`), run first:
# `make test` hands whole files to two workers (pytest-xdist, --dist loadfile) in collection
# order, so a long file taken last would keep one worker busy while the other sits idle.  Only
# the order changes.
LONGEST_FIRST = ["test_train_hf.py", "test_readme.py", "test_launch_supervisor.py", "test_train_accelerate.py",
                 "test_serve_hot_standby.py", "test_scope_matrix.py", "test_serve_tp.py", "test_train_grad_lending.py",
                 "test_train_grads_in_place.py", "test_train_faults.py", "test_serve_daemon_loss.py"]


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    # GPU-marked tests after all the others: once a CUDA backward ran here, autograd's device
    # threads forbid a forked child's backward, which the CPU kill campaigns' workers run.
    items.sort(key=lambda item: ("gpu" in item.keywords, rank.get(item.path.name, len(rank))))   # stable
    if _cuda_ready():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU and cuda-bindings")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def socket_dir(tmp_path, monkeypatch):
    """A private socket directory for this test, exported to child processes too."""
    d = tmp_path / "sock"
    d.mkdir(mode=0o700)
    monkeypatch.setenv("GPU_ANCHOR_SOCKET_DIR", str(d))
    monkeypatch.delenv("GPU_ANCHOR_SOCKET", raising=False)
    return str(d)


def _daemon(device: str, socket_dir: str):
    path = os.path.join(socket_dir, device.replace(":", "") + ".sock")
    proc = control.start(device, path)
    yield path, proc
    if proc.poll() is None:
        control.stop(device, path)
        try:
            proc.wait(timeout=10)
        except Exception:
            proc.kill()


@pytest.fixture
def host_daemon(socket_dir):
    """A real host-memory daemon: yields ``(socket_path, Popen)``; stopped afterwards."""
    yield from _daemon("cpu", socket_dir)


@pytest.fixture
def clean_daemons(socket_dir):
    """This test's socket directory; every daemon found there afterwards (one a supervisor
    started and left running, say) is stopped."""
    yield socket_dir
    for device, path in control.discover(socket_dir).items():
        control.stop(device, path)


@pytest.fixture
def cuda_daemon(socket_dir):
    """A real daemon for cuda:0 (GPU tests only)."""
    yield from _daemon("cuda:0", socket_dir)


class _References:
    """Fault-free reference runs, each computed once per test session in a daemon of their own
    (the tests' daemons are per test; references outlive them)."""

    def __init__(self, directory: str, path: str) -> None:
        self.dir, self.path, self.made = directory, path, {}

    def get(self, key, compute):
        """``compute()`` once per session, run with this daemon as every client's default."""
        if key not in self.made:
            saved = {k: os.environ.get(k) for k in ("GPU_ANCHOR_SOCKET_DIR", "GPU_ANCHOR_SOCKET")}
            os.environ["GPU_ANCHOR_SOCKET_DIR"] = self.dir
            os.environ.pop("GPU_ANCHOR_SOCKET", None)
            try:
                self.made[key] = compute()
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
        return self.made[key]

    def connect(self, namespace: str):
        import gpu_anchor
        return gpu_anchor.connect("cpu", namespace=namespace, socket=self.path)


@pytest.fixture(scope="session")
def references(tmp_path_factory):
    d = tmp_path_factory.mktemp("refs") / "sock"
    d.mkdir(mode=0o700)
    gen = _daemon("cpu", str(d))
    path, _ = next(gen)
    yield _References(str(d), path)
    next(gen, None)
