"""Fault-free reference results shared by the supervisor and torchrun tests (one run per session)."""
from __future__ import annotations

import os
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
        p = subprocess.run([sys.executable, "-m", "gpu_anchor.launch.cli", "run", "--device-type", "cpu",
                            "--nproc-per-node", str(n), "--", sys.executable, DEMO, "--steps", str(STEPS),
                            "--out", f"ref{n}.pt"], cwd=d, env=env, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        out[n] = torch.load(d / f"ref{n}.pt")
    assert not torch.equal(out[1], out[2])  # the ranks' data differ: a real 2-rank job
    return out
