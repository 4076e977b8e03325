"""Fault-free reference results shared by the supervisor and torchrun tests (one run per session)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "examples", "demo_train.py")
STEPS = int(os.environ.get("GPU_ANCHOR_TEST_STEPS", "120"))


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """Final parameters of fault-free runs of examples/demo_train.py under `gpu-anchor run`, 1 and 2 ranks."""
    d = tmp_path_factory.mktemp("ref")
    env = {**os.environ, "PYTHONPATH": ROOT, "GPU_ANCHOR_SOCKET_DIR": str(d / "sock")}
    out = {}
    for n in (1, 2):
        rc, err = _run_job([sys.executable, "-m", "gpu_anchor.launch.cli", "run", "--device-type", "cpu",
                            "--nproc-per-node", str(n), "--", sys.executable, DEMO, "--steps", str(STEPS),
                            "--out", f"ref{n}.pt"], d, env, timeout=300)
        assert rc == 0, err[-3000:]
        out[n] = torch.load(d / f"ref{n}.pt")
    assert not torch.equal(out[1], out[2])  # the ranks' data differ: a real 2-rank job
    return out


def _run_job(cmd: list[str], cwd, env: dict, timeout: float) -> tuple[int, str]:
    """Run a supervised job in its own session; (exit code, stderr).  If it runs over, every
    process of the job gets SIGABRT first, so that faulthandler prints where each one is stuck
    (a 2-rank run hung once in CI after its last step, and a plain timeout said nothing more)."""
    p = subprocess.Popen(cmd, cwd=cwd, env={**env, "PYTHONFAULTHANDLER": "1"}, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, err = p.communicate(timeout=timeout)
        return p.returncode, err
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGABRT)
        try:
            _, err = p.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            _, err = p.communicate()
        from gpu_anchor.daemon import control   # the job's daemons live in their own session
        for dev, path in control.discover(env["GPU_ANCHOR_SOCKET_DIR"]).items():
            control.stop(dev, path)
        pytest.fail(f"{' '.join(cmd[-8:])} ran over {timeout} s; the job's stacks (faulthandler):\n{err[-8000:]}")
