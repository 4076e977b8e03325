"""bench/protocol.py: statistics per cell, the strongest baseline per mode, ratios against it,
the refusal of headlines below n = 3, one measured interval per table (CPU, no benchmark run)."""
from __future__ import annotations

import pytest

from bench.protocol import (MIN_N, Cell, Comparison, Interval, TooFewSamples, from_rows, samples, throughput_section,
                            throughput_table)

KILL = Interval("SIGKILL", "next step done")


def _table(better="lower"):
    c = Comparison(KILL, better=better, ours=lambda m: m.startswith("gpu_anchor"),
                   labels={"torch_save": "torch.save", "inmemory": "in-memory"})
    c.add("gpu_anchor", "warm", [1.02, 0.99, 1.00])
    c.add("torch_save", "warm", [1.86, 1.81, 1.84])
    c.add("inmemory", "warm", [2.89, 3.10, 3.00])
    c.add("gpu_anchor", "prewarm", [0.35, 0.37, 0.36])
    c.add("torch_save", "prewarm", [1.42, 1.31])          # n = 2: shown, not a headline
    c.add("inmemory", "prewarm", [1.92, 2.07, 2.0])
    return c


def test_cell_statistics_and_text():
    c = Cell([3.0, 1.0, 2.0, 10.0])
    assert (c.n, c.min, c.median, c.max) == (4, 1.0, 2.5, 10.0)
    assert c.text() == "2.5 [1–10]"
    assert c.text(lambda v: f"{v:.1f} s", bold=True) == "**2.5 s** [1.0 s–10.0 s]"
    assert Cell([0.5]).text() == "0.5 (n = 1)" and Cell([0.5]).text(show_n=False) == "0.5"
    assert Cell([1.0, None, 2.0]).n == 2                  # a missing sample is not a zero
    with pytest.raises(ValueError):
        Cell([])


def test_strongest_baseline_is_the_best_median_among_baselines_only():
    c = _table()
    assert c.strongest("warm")[0] == "torch_save"        # not in-memory, and never gpu-anchor itself
    assert c.strongest("prewarm")[0] == "torch_save"
    hi = Comparison(Interval("start", "end"), better="higher")
    hi.add("gpu_anchor", "x", [9, 9, 9])
    hi.add("a", "x", [5, 6, 7])
    hi.add("b", "x", [4, 8, 8])                          # a better median wins, not a better max
    assert hi.strongest("x")[0] == "b"
    assert Comparison(KILL).strongest("warm") is None


def test_ratio_is_against_the_strongest_with_its_range():
    c = _table()
    r = c.ratio("gpu_anchor", "warm")
    assert r.against == "torch_save" and r.n == 3
    assert r.value == pytest.approx(1.84 / 1.00)
    assert (r.lo, r.hi) == (pytest.approx(1.81 / 1.02), pytest.approx(1.86 / 0.99))
    assert r.text("torch.save") == "1.84× [1.77–1.88] vs torch.save"
    # against a named method (e.g. an issue's target baseline), on request only
    assert c.ratio("gpu_anchor", "warm", against="inmemory").value == pytest.approx(3.0)
    assert c.ratio_text("torch_save", "warm") == "strongest"
    assert c.ratio_text("inmemory", "warm").startswith("0.613×")     # a baseline slower than the strongest
    hi = Comparison(Interval("start", "end"), better="higher")
    hi.add("gpu_anchor", "x", [90, 100, 110])
    hi.add("b", "x", [40, 50, 60])
    r = hi.ratio("gpu_anchor", "x")
    assert (r.value, r.lo, r.hi) == (2.0, 1.5, pytest.approx(110 / 40))


def test_headline_refuses_fewer_than_three_samples():
    c = _table()
    assert c.headline("gpu_anchor", "warm").value == pytest.approx(1.84)
    with pytest.raises(TooFewSamples, match="n = 2 < 3"):
        c.headline("gpu_anchor", "prewarm")
    assert c.ratio_text("gpu_anchor", "prewarm").endswith("(n = 2)")       # in a table: its n
    assert c.ratio("gpu_anchor", "prewarm").text().endswith("(n = 2: not a headline)")
    one = Comparison(KILL)
    one.add("gpu_anchor", "warm", [1.0])
    one.add("torch_save", "warm", [2.0])
    assert one.ratio_text("gpu_anchor", "warm") == "2× (n = 1)"
    assert one.ratio("gpu_anchor", "warm").text("torch.save") == "2× vs torch.save (n = 1: not a headline)"
    with pytest.raises(TooFewSamples):
        one.headline("gpu_anchor", "warm")
    with pytest.raises(ValueError, match="no baseline"):
        Comparison(KILL).headline("gpu_anchor", "warm")
    assert MIN_N == 3


def test_one_interval_per_table():
    c = _table()
    c.add("checkfreq", "warm", [2.0, 2.1, 2.2], interval=KILL)
    with pytest.raises(ValueError, match="same interval"):
        c.add("hf", "warm", [1.0, 1.0, 1.0], interval=Interval("first call", "last token"))
    with pytest.raises(ValueError):
        Comparison(KILL, better="faster")


def test_notes_name_the_strongest_and_the_low_n_cells():
    c = _table()
    line = c.strongest_line(lambda v: f"{v:.2f} s")
    assert line.startswith("Strongest baseline per mode") and "warm: torch.save (1.84 s [1.81 s–1.86 s])" in line
    note = c.n_note()
    assert "SIGKILL → next step done" in note and "n = 2–3" in note and "torch.save/prewarm" in note


def test_samples_from_stored_results_and_the_throughput_table():
    assert samples({"total_s": 1.0, "trials": [{"total_s": 1.0}, {"total_s": 2.0}, {"x": 1}]}, "total_s") == [1.0, 2.0]
    assert samples({"total_s": 1.5}, "total_s") == [1.5]           # a result stored without its trials
    assert samples({}, "total_s") == []
    t = throughput_table([("gpu-anchor", Cell([10.0, 11.0, 12.0])), ("torch.save", None)], "steps/s")
    assert "| gpu-anchor | 11 [10–12] | 3 |" in t and "| torch.save | not measured | 0 |" in t


def test_a_stored_recovery_table_becomes_cells_and_a_missing_throughput_row_is_said():
    rows = [{"method": "gpu_anchor", "modes": {"warm": {"total_s": 1.0, "trials": [{"total_s": 1.0}] * 3}}},
            {"method": "torch_save", "modes": {"warm": {"total_s": 2.0}}}]          # stored without trials
    c = from_rows(rows, KILL, ours="gpu_anchor")
    assert c.cell("gpu_anchor", "warm").n == 3 and c.cell("torch_save", "warm").n == 1
    assert c.ratio_text("gpu_anchor", "warm") == "2× (n = 1)"       # the smaller n decides
    assert throughput_section([("a", None)], "intro", "step time (ms)")[-1].startswith(
        "Fault-free step time: not recorded")
    assert throughput_section([("a", Cell([1, 2, 3]))], "intro", "step time (ms)")[1] == "intro"


def test_a_target_against_a_named_baseline_is_a_verdict_not_a_headline():
    c = _table()
    assert c.against_strongest("gpu_anchor", "warm") == "1.84× [1.77–1.88] vs torch.save"
    assert c.target_verdict("gpu_anchor", "inmemory", "warm", 5.0) == \
        "warm: gpu_anchor 1 vs in-memory 3 = 3.00× — **MISSED**"
    assert c.target_verdict("gpu_anchor", "inmemory", "prewarm", 5.0).endswith("5.56× — met")
    assert c.target_verdict("gpu_anchor", "checkfreq", "warm", 5.0) is None
