"""Smoke run of bench/scope_bind.py at tiny sizes (no timing assertions)."""
from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("transformers")


@pytest.mark.slow   # three scenarios run end to end in `make test` (tests/test_bench_smoke.py says which)
def test_scope_bind_bench_smoke(tmp_path, monkeypatch):
    from bench import scope_bind
    monkeypatch.delenv("GPU_ANCHOR_SOCKET_DIR", raising=False)
    assert scope_bind.main(["--device", "cpu", "--presets", "tiny", "tiny10", "--repeats", "1",
                            "--out", str(tmp_path)]) == 0
    data = json.load(open(os.path.join(tmp_path, "scope_bind_cpu.json")))
    rows = data["rows"]
    assert [r["preset"] for r in rows] == ["tiny", "tiny10"]
    assert rows[1]["params"] > 8 * rows[0]["params"] and rows[1]["tensors"] == rows[0]["tensors"]
    for r in rows:
        assert r["create"]["created"] == r["tensors"]          # every parameter and buffer anchored
        assert r["restart_all_matched"] and r["restart_replayed_ops"] == 0
