"""The "what works" matrix of managed_scope on CPU, with a host daemon (docs/scope.md).

Every way a real program builds or loads a model (``tests/scope_matrix.py``): the first
run inside the scope is bit-identical to the run without gpu-anchor (state, forward, RNG
after the block); the restart after a SIGKILL matches every object, replays nothing,
keeps the trained bytes and computes with them; ``from_pretrained`` restarts open no
weight file.  Then the random-kill campaigns of ``tests/scope_campaign.py``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("accelerate")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import scope_matrix  # noqa: E402

CPU_CASES = [c for c in scope_matrix.CASES if c not in scope_matrix.GPU_ONLY]


def _driver(script, *args, timeout=900):
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("GPU_ANCHOR_SOCKET_DIR", None)           # the driver makes its own private directory
    out = subprocess.run([sys.executable, os.path.join(HERE, script), *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    path = tmp_path_factory.mktemp("matrix") / "cpu.json"
    _driver("scope_matrix.py", "--device", "cpu", "--out", str(path))
    return {r["case"]: r for r in json.loads(path.read_text())}


@pytest.mark.parametrize("case", CPU_CASES)
def test_matrix_case_on_cpu(matrix, case):
    r = matrix[case]
    assert not r["problems"], "\n".join(r["problems"])


@pytest.fixture(scope="module")
def campaigns(tmp_path_factory):
    """Both campaigns in one driver run (its imports of transformers and peft paid once)."""
    path = tmp_path_factory.mktemp("campaigns") / "campaigns.json"
    _driver("scope_campaign.py", "--case", "gru", "--case", "peft", "--kills", "20", "--out", str(path))
    return {r["case"]: r for r in json.loads(path.read_text())}


@pytest.mark.parametrize("case", ["gru", "peft"])
def test_random_kill_campaign(campaigns, case):
    r = campaigns[case]
    assert not r["problems"], "\n".join(r["problems"])
    assert r["kills"] >= 20
