"""The serving benchmark's tiny configuration runs end to end on the CPU (no timing asserts)."""
from __future__ import annotations

import json

import pytest


def test_serve_throughput_tiny_throughput_only(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend("bench")
    from serve_throughput import main
    assert main(["--tiny", "--requests", "4", "--prompt-len", "8", "--max-tokens", "8", "--rounds", "1",
                 "--skip-hf", "--skip-recovery", "--skip-startup", "--profile", "--async-scheduling", "both",
                 "--out", str(tmp_path / "r.json")]) == 0
    res = json.loads((tmp_path / "r.json").read_text())
    t = res["throughput"]
    assert t["anchored_and_plain_outputs_equal"]
    assert t["runs"]["anchored"][0]["tokens"] == 32 and t["runs"]["anchored"][0]["commits"] > 0
    assert t["runs"]["plain"][0]["commits"] == 0
    # the padded static-buffer decode path ran (emulated on the CPU), and the eager runs too
    assert t["runs"]["anchored"][0]["graph_steps"] > 0 and t["eager"]["runs"]["plain"][0]["graph_steps"] == 0
    assert t["eager"]["graph_tokens_equal_to_eager"] == 1.0
    assert set(t["summary"]["anchored"]["step_ms"]) >= {"schedule", "forward", "sample", "commit_wait"}
    assert res["commit_microbench"]["snapshot_us_per_step"] > 0
    # the roofline sweep: decode-only steps found, their bytes from the engine's tensors
    cell = t["sweep"]["4"]["plain"]
    assert cell["decode_bytes_per_step"]["median"] > 0 and cell["decode_step_ms"]["n"] == 1
    assert 0 < cell["roofline_fraction"]["nominal_cpu_20GB/s"]["median"] < 1
    assert set(t["sampled"]) == {"temperature 0.8", "temperature 0.8, top-p 0.95", "temperature 0.7, top-k 20, top-p 0.8"}
    assert all(p["steps"] > 0 and p["by_category_ms"] for p in t["profile"].values())
    # --async-scheduling both: each engine also ran with decode steps launched ahead, same tokens
    a = t["runs"]["anchored, async"][0]
    assert a["tokens"] == 32 and a["async_steps"] > a["sync_steps"] and t["runs"]["anchored"][0]["async_steps"] == 0
    assert set(t["async_over_sync"]) == {"anchored", "plain"} and t["sweep"]["4"]["plain, async"]["steps"]["async"] > 0
    from serve_throughput import render
    text = render(res)
    assert "alternating runs" in text and "roofline" in text and "Profile, plain, greedy, graphs" in text
    assert "Asynchronous scheduling" in text and "steps sync / async" in text


def test_serve_throughput_takes_a_deployments_max_model_len(tmp_path, monkeypatch, capsys):
    """``--max-model-len`` widens the engines' block tables as a deployment's setting does (the
    attention grid is sized by it); a value too small for the requests is refused."""
    monkeypatch.syspath_prepend("bench")
    from serve_throughput import main
    with pytest.raises(SystemExit):
        main(["--prompt-len", "256", "--max-tokens", "128", "--max-model-len", "300"])
    assert "needs at least 385" in capsys.readouterr().err
    assert main(["--tiny", "--requests", "4", "--prompt-len", "8", "--max-tokens", "8", "--rounds", "1",
                 "--eager-rounds", "0", "--streams-list", "4", "--max-model-len", "512", "--skip-hf",
                 "--skip-recovery", "--skip-startup", "--out", str(tmp_path / "r.json")]) == 0
    res = json.loads((tmp_path / "r.json").read_text())
    assert res["max_model_len"] == 512 and res["throughput"]["anchored_and_plain_outputs_equal"]


@pytest.mark.slow
def test_serve_throughput_tiny_full(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend("bench")
    from serve_throughput import main
    assert main(["--tiny", "--requests", "4", "--streams", "4", "--prompt-len", "8", "--max-tokens", "40",
                 "--rounds", "1", "--out", str(tmp_path / "r.json")]) == 0
    res = json.loads((tmp_path / "r.json").read_text())
    assert "tokens_per_s" in res["hf_generate_batch"], res["hf_generate_batch"]
    for k in ("recovery_anchored", "recovery_no_anchor"):
        assert res[k]["streams_resumed"] == 4 and res[k]["token_mismatches"] == 0
    assert res["recovery_anchored"]["engine_breakdown_s"]["weights_s"] < 1.0
    st = res["startup"]["warm"]            # fresh-process start-ups, both engines alike
    assert len(st["runs"]["anchored"]) == len(st["runs"]["plain"]) == 1 and st["anchored_over_plain_ready"] > 0
