"""Smoke runs of bench/checkpoint_stall.py at tiny size on CPU (shape of the result, not timings)."""
from __future__ import annotations

import json

from bench import checkpoint_stall


def _checks(r: dict, policies, reps: int) -> dict:
    rows = r["checkpoint"]
    assert sorted(rows) == sorted(policies)
    for p, row in rows.items():
        assert row["stall_s"]["n"] == row["extra_s"]["n"] == reps, p
        assert row["extra_s"]["min"] <= row["extra_s"]["median"] <= row["extra_s"]["max"]
        for rep in row["reps"]:
            steps = 2 + r["trail"] if p == "none" else 1 + rep["inflight_steps"] + r["trail"]
            assert len(rep["window_s"]) == steps, (p, rep)
    assert rows["stw"]["bytes"] == r["anchored_bytes"] and rows["stw"]["inflight_steps"]["max"] == 0
    assert rows["cow"]["policy"] == "cow" and rows["cow"]["valid"] and "extra_vs_stw" in rows["cow"]
    if "none" in rows:   # the A/A control: no checkpoint, nothing blocked
        assert rows["none"]["stall_s"]["max"] == 0 and rows["none"]["inflight_steps"]["max"] == 0
    for k in ("plain_step_s", "idle_step_s", "inflight_tracking_step_s", "idle_vs_plain", "inflight_tracking_vs_plain"):
        assert r["overhead"][k]["n"] == 3, k
    text = checkpoint_stall.render(r)
    assert "job-level extra" in text and "tracker idle" in text
    return rows


def test_checkpoint_stall_bench_runs_tiny(tmp_path, monkeypatch):
    monkeypatch.setenv("GPU_ANCHOR_SOCKET_DIR", str(tmp_path / "unused"))  # restored after the bench changes it
    monkeypatch.setenv("GPU_ANCHOR_CHECKPOINT_KEEP", "2")
    assert checkpoint_stall.main(["--out", str(tmp_path), "--inflight-steps", "20", "--throttle", "0.002",
                                  "--window", "3", "--gap", "2"]) == 0
    r = json.loads((tmp_path / "checkpoint_stall.json").read_text())
    rows = _checks(r, checkpoint_stall.POLICIES, 3)
    assert rows["recopy"]["policy"] == "recopy" and rows["recopy"]["recopied"] > 0
    assert rows["device"]["policy"] == "device" and rows["device"]["gpu_buffered"] == 0, "host objects: copy-on-write"
    assert set(r["restore"]) == {"full", "on_demand"}
    assert r["restore"]["on_demand"]["on_demand"] + r["restore"]["on_demand"]["background"] == rows["cow"]["objects"]


def test_checkpoint_stall_bench_runs_the_llama_workload_tiny(tmp_path, monkeypatch):
    """The Llama + AnchoredOptimizer workload: the boundary is the optimizer's step-committed event."""
    monkeypatch.setenv("GPU_ANCHOR_SOCKET_DIR", str(tmp_path / "unused"))
    monkeypatch.delenv("GPU_ANCHOR_CHECKPOINT_KEEP", raising=False)
    assert checkpoint_stall.main(["--tiny", "--workload", "llama3.2-1b", "--out", str(tmp_path),
                                  "--policies", "stw,cow,none", "--profile"]) == 0
    import os
    assert "GPU_ANCHOR_CHECKPOINT_KEEP" not in os.environ, "the bench gives the environment back"
    r = json.loads((tmp_path / "checkpoint_stall_llama3.2-1b_tiny.json").read_text())
    rows = _checks(r, ["stw", "cow", "none"], 3)
    assert r["workload"] == "llama3.2-1b" and r["restore"] == {}
    assert any(rep["inflight_steps"] for rep in rows["cow"]["reps"]), "the copy ran while the job stepped"
    # --profile: one more repetition per row, not counted, every step marked; each repetition
    # also keeps its steps' host enqueue times
    for p in ("stw", "cow"):
        rep, prof = rows[p]["reps"][0], r["profiled"][p]
        assert [len(rep["enqueue_s"][k]) for k in ("before", "window", "after")] == \
            [len(rep["before_s"]), len(rep["window_s"]), len(rep["after_s"])]
        labels = [s["label"] for s in prof["steps"]]
        nb = len(rep["before_s"])
        assert labels[:nb] == ["plain"] * nb and labels[nb] == "window" and labels[-1] == "plain", labels
        assert all(s["wall_ms"] > 0 and s["kernel_busy_ms"] == 0 for s in prof["steps"])   # no device here


def test_step_profile_counts_overlapping_kernels_once():
    from bench.step_profile import _union
    assert _union([]) == 0
    assert _union([(0, 10), (5, 15), (20, 25), (21, 22)]) == 20
