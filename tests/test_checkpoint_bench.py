"""Smoke run of bench/checkpoint_stall.py at tiny size on CPU (shape of the result, not timings)."""
from __future__ import annotations

import json


def test_checkpoint_stall_bench_runs_tiny(tmp_path, monkeypatch):
    monkeypatch.setenv("GPU_ANCHOR_SOCKET_DIR", str(tmp_path / "unused"))  # restored after the bench changes it
    monkeypatch.setenv("GPU_ANCHOR_CHECKPOINT_KEEP", "2")
    from bench import checkpoint_stall
    assert checkpoint_stall.main(["--out", str(tmp_path), "--inflight-steps", "20", "--throttle", "0.002"]) == 0
    r = json.loads((tmp_path / "checkpoint_stall.json").read_text())
    rows = r["checkpoint"]
    assert rows["stw"]["policy"] == "stw" and rows["stw"]["bytes"] == r["anchored_bytes"]
    assert rows["cow"]["policy"] == "cow" and rows["cow"]["valid"]
    assert rows["recopy"]["policy"] == "recopy" and rows["recopy"]["recopied"] > 0
    assert "stall_s" in rows["dcp_async_save"] or "error" in rows["dcp_async_save"]
    assert set(r["restore"]) == {"full", "on_demand"}
    assert r["restore"]["on_demand"]["on_demand"] + r["restore"]["on_demand"]["background"] == rows["cow"]["objects"]
