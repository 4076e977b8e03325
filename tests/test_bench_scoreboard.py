"""The target table at the top of docs/benchmarks.md (``bench/scoreboard.py``): every target
reads from the stored results, the verdicts follow the figures, and a missing or unreadable
result is named."""
import json
import os
import shutil

import pytest

from bench import scoreboard as S
from bench.figures import FigureError


def _result(tmp_path, name, **data):
    (tmp_path / f"{name}.json").write_text(json.dumps({"date": "2026-12-05 10:00:00 UTC",
                                                       "machine": {"gpu": "NVIDIA H200"}, **data}))


def test_every_target_reads_its_figure_from_the_stored_results():
    assert S.check() == []
    table = S.render()
    assert table.count("\n| ") == len(S.TARGETS) + 2          # the header, its rule, one row a target
    for t in S.TARGETS:
        assert f"`{t.source}`" in table


def test_the_verdict_follows_the_median_and_names_a_spread_that_crosses_the_goal(tmp_path):
    t = S.Target("step", "≤ 1 %", "r", "a.median", "a.min", "a.max", "a.n", "<=", 1, " %", 2)
    _result(tmp_path, "r", a={"median": 0.5, "min": 0.2, "max": 0.9, "n": 3})
    row = S.evaluate(t, str(tmp_path))
    assert (row.value, row.low, row.high, row.n, row.verdict) == (0.5, 0.2, 0.9, 3, "met")
    assert row.measured == "2026-12-05, NVIDIA H200"
    _result(tmp_path, "r", a={"median": 0.5, "min": 0.2, "max": 1.4, "n": 3})
    assert S.evaluate(t, str(tmp_path)).verdict == "met at the median, not in every repetition"
    _result(tmp_path, "r", a={"median": 1.2, "min": 0.2, "max": 1.4, "n": 3})
    assert S.evaluate(t, str(tmp_path)).verdict == "**missed**"
    up = S.Target("roofline", "≥ 70 %", "r", "a.median", op=">=", bound=70)
    assert S.evaluate(up, str(tmp_path)).verdict == "**missed**"
    assert S.evaluate(S.Target("ratio", "", "r", "a.median / a.min"), str(tmp_path)).verdict == "reported"


def test_runs_stored_one_file_each_are_pooled_by_median_min_and_max(tmp_path):
    for i, x in enumerate([1.4, 0.9, 1.1]):
        _result(tmp_path, f"run_{i}", pct=x)
    files = [f"run_{i}" for i in range(3)]
    t = S.Target("step", "≤ 1 %", "run_0", S._over("median", files, "pct"), S._over("min", files, "pct"),
                 S._over("max", files, "pct"), 3, "<=", 1, " %", 2)
    row = S.evaluate(t, str(tmp_path))
    assert (row.value, row.low, row.high) == (1.1, 0.9, 1.4)
    assert row.verdict == "**missed**"


def test_a_missing_result_or_a_path_that_does_not_read_is_named(tmp_path, monkeypatch):
    _result(tmp_path, "r", a={"median": 1})
    with pytest.raises(FigureError, match=r"r: .*no 'nope'"):
        S.evaluate(S.Target("x", "", "r", "a.nope"), str(tmp_path))
    monkeypatch.setattr(S, "TARGETS", [S.Target("gone", "", "absent", "a"), S.Target("ok", "", "r", "a.median")])
    problems = S.check(str(tmp_path))
    assert len(problems) == 1 and problems[0].startswith("gone:") and "absent.json" in problems[0]



def test_a_results_directory_without_the_targets_results_renders_no_table(tmp_path):
    assert S.render(str(tmp_path)) == ""                  # a smoke run's directory: no table
    name = S.TARGETS[0].source
    shutil.copy(os.path.join(S.RESULTS, f"{name}.json"), tmp_path)
    table = S.render(str(tmp_path))
    assert table.count("| no result |") == sum(t.source != name for t in S.TARGETS)
