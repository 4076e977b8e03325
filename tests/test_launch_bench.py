"""Smoke run of bench/restart_latency.py at its tiny size on CPU (no timing asserted)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_restart_latency_bench_tiny(tmp_path):
    out = tmp_path / "r.json"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "restart_latency.py"), "--size", "tiny",
                        "--device", "cpu", "--kills", "1", "--kill-every", "0.3", "--modes", "warm",
                        "--out", str(out)], env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(out.read_text())["modes"]["warm"]
    assert len(r["restarts"]) == 1
    row = r["restarts"][0]
    for phase in ("detection", "spawn", "imports", "cuda_init", "bind", "recovery", "first_step", "total"):
        assert row[phase] >= 0, phase
    assert abs(sum(row[k] for k in ("detection", "spawn", "imports", "cuda_init", "bind", "recovery",
                                    "first_step")) - row["total"]) < 0.01
    assert "restart in place" in r["decisions"][0]
