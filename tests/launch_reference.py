"""Fault-free reference results shared by the supervisor and torchrun tests (one run per session)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import warnings

import pytest
import torch

from bench.hang_check import descendants

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
        cmd = [sys.executable, "-m", "gpu_anchor.launch.cli", "run", "--device-type", "cpu", "--nproc-per-node",
               str(n), "--", sys.executable, DEMO, "--steps", str(STEPS), "--out", f"ref{n}.pt"]
        rc, log = _run_job(cmd, d, env, timeout=150)
        if rc is None:
            # A fault-free 2-rank run has hung in CI (2 of ~20 runs of this fixture; never in 40+ local
            # runs).  Keep everything it showed, loudly, and run it once more: the tests that use this
            # reference test other things.  A second hang fails.
            (d / f"hang-{n}.log").write_text(log)
            warnings.warn(f"fault-free reference job ({n} rank(s)) ran over and was aborted; retrying once. "
                          f"Its output, process table and stacks:\n{log[-12000:]}")
            rc, log = _run_job(cmd, d, env, timeout=150)
            if rc is None:
                pytest.fail(f"{' '.join(cmd[-8:])} ran over twice; the second time:\n{log[-12000:]}")
        assert rc == 0, log[-3000:]
        out[n] = torch.load(d / f"ref{n}.pt")
    assert not torch.equal(out[1], out[2])  # the ranks' data differ: a real 2-rank job
    return out


def _run_job(cmd: list[str], cwd, env: dict, timeout: float) -> tuple[int | None, str]:
    """Run a supervised job in its own session; (exit code, stdout + stderr).  If it runs over, the
    exit code is None and the output ends with the host's process table and every job process's
    stack: each gets SIGABRT, so that faulthandler prints where it is stuck, and the job's daemons
    are stopped."""
    p = subprocess.Popen(cmd, cwd=cwd, env={**env, "PYTHONFAULTHANDLER": "1"}, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
        return p.returncode, out
    except subprocess.TimeoutExpired:
        # workers forked by the fork server have process groups of their own: abort them by pid,
        # deepest first, so that each prints its stack before its parent notices
        for pid in reversed(descendants(p.pid)):
            try:
                os.kill(pid, signal.SIGABRT)
            except ProcessLookupError:
                pass
        table = subprocess.run(["ps", "-eo", "pid,ppid,pgid,stat,etime,pcpu,args"], capture_output=True,
                               text=True).stdout
        os.killpg(p.pid, signal.SIGABRT)
        try:
            out, _ = p.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, _ = p.communicate()
        from gpu_anchor.client import control   # the job's daemons live in their own session
        for dev, path in control.discover(env["GPU_ANCHOR_SOCKET_DIR"]).items():
            control.stop(dev, path)
        return None, f"{' '.join(cmd[-8:])} ran over {timeout} s.\n--- process table\n{table}\n" \
                     f"--- output and stacks (faulthandler)\n{out}"
