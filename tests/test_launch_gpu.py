"""GPU runs of the supervisor (skipped without CUDA): the demo on one GPU, and a
2-rank NCCL job with ranks killed on two GPUs; both must match a fault-free run."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _demo(tmp_path, nproc):
    out = tmp_path / "demo.json"
    env = {**os.environ, "PYTHONPATH": ROOT, "NCCL_NVLS_ENABLE": "0"}
    p = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "demo.py"), "--device-type", "cuda",
                        "--nproc", str(nproc), "--kills", "2", "--json", str(out)], env=env, capture_output=True,
                       text=True, timeout=540)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout


@pytest.mark.gpu
def test_demo_on_one_gpu(tmp_path):
    assert "demo OK" in _demo(tmp_path, 1)


@pytest.mark.gpu
def test_two_gpus_one_rank_killed(tmp_path):
    import torch
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    assert "demo OK" in _demo(tmp_path, 2)
