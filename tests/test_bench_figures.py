"""README's figures come from bench/results/ (issue 20): every number README.md quotes after a
``<!-- fig ... -->`` marker equals the JSON value it names, rounded as shown, and no figure with a
unit of measure stands without a source.  CPU only, no benchmark run."""
from __future__ import annotations

import json

from bench import figures


def test_readme_figures_match_their_results():
    bounds, problems = figures.check()
    assert not problems, "README.md quotes figures its results do not give (`python -m bench figures`):\n" \
        + "\n".join(problems)
    assert len(bounds) >= 50          # the markers are there, and read


def _check(tmp_path, text: str, results: dict):
    d = tmp_path / "results"
    d.mkdir(exist_ok=True)
    for name, data in results.items():
        (d / f"{name}.json").write_text(json.dumps(data))
    readme = tmp_path / "README.md"
    readme.write_text(text)
    return figures.check(str(readme), str(d))


RESULTS = {"rt": {"models": {"llama3.2-1b": [{"method": "gpu_anchor", "total_s": 0.359},
                                             {"method": "torch_save", "total_s": 1.52}]}},
           "bw": {"mapped": 4247.03, "ratio": 0.99852, "stall_s": 0.0079}}


def test_numbers_are_checked_rounded_as_shown(tmp_path):
    text = ("- Kill → step 0.36 s vs 1.52 s (4.2×; n = 3)<!-- fig rt models[llama3.2-1b]:\n"
            "  [method=gpu_anchor].total_s, [method=torch_save].total_s, [method=torch_save].total_s / [method=gpu_anchor].total_s -->.\n"
            "- 64 streams, 4247 GB/s, 99.9 %, 7.9 ms<!-- fig bw: _, mapped, ratio * 100, stall_s * 1000 -->.\n"
            "- Also 0.359 s<!-- fig @ignored: @rt models[llama3.2-1b][0].total_s -->.\n")
    bounds, problems = _check(tmp_path, text, RESULTS)
    assert problems == [] and [b.shown for b in bounds] == ["0.36", "1.52", "4.2", "4247", "99.9", "7.9", "0.359"]


def test_a_stale_number_is_caught(tmp_path):
    text = "H200: 4285 GB/s copy bandwidth<!-- fig bw: mapped -->.\n"
    _, problems = _check(tmp_path, text, RESULTS)
    assert len(problems) == 1 and "README says 4285, bw.json gives 4247.03" in problems[0]
    _, problems = _check(tmp_path, "7.8 ms<!-- fig bw: stall_s * 1000 -->\n", RESULTS)   # off by one digit
    assert problems and "gives 7.9" in problems[0]


def test_an_unsourced_figure_is_caught_and_none_says_why(tmp_path):
    _, problems = _check(tmp_path, "Recovery takes 0.36 s and 6.8× less.\n", RESULTS)
    assert len(problems) == 2 and all("has no source marker" in p for p in problems)
    _, problems = _check(tmp_path, "Up to 1 GiB<!-- fig none: a design limit -->; rates 5 %/s and 2 × 7 layers.\n"
                         "```\nmake demo   # 0.06 s\n```\nThe `torch==2.13.0 32 s` build.\n", RESULTS)
    assert problems == []      # a none marker, a fault rate, a product sign, code: no figure to source


def test_bad_markers_are_reported(tmp_path):
    _, problems = _check(tmp_path, "0.36 s and 1.52 s<!-- fig rt models[llama3.2-1b]: "
                         "[method=gpu_anchor].total_s -->\n", RESULTS)
    assert "2 number(s)" in problems[0] and "1 expression(s)" in problems[0]
    _, problems = _check(tmp_path, "0.36 s<!-- fig rt: models[llama3.2-1b][method=nope].total_s -->\n", RESULTS)
    assert "no element with method = nope" in problems[0]
    _, problems = _check(tmp_path, "0.36 s<!-- fig missing: x -->\n", RESULTS)
    assert "missing" in problems[0]
    _, problems = _check(tmp_path, "0.36 s<!-- fig rt models -->\n", RESULTS)
    assert "without ':'" in problems[0]


def test_a_key_may_hold_an_operator():
    """``[top-k 50 + top-p 0.95/64]`` is one key: operators split an expression only outside brackets."""
    data = {"ms": {"top-k 50 + top-p 0.95/64": 0.92, "a - b": 2.0}, "x": 1.0}
    assert figures.evaluate(data, "ms[top-k 50 + top-p 0.95/64]") == 0.92
    assert figures.evaluate(data, "ms[top-k 50 + top-p 0.95/64] + ms[a - b] * 2") == (0.92 + 2.0) * 2
    assert figures.evaluate(data, "x - ms[a - b] / x") == -1.0


def test_a_median_of_runs_stored_one_file_each(tmp_path):
    runs = {f"r{i}": {"pct": v} for i, v in enumerate([2.78, 3.28, 2.48, 2.99])}
    text = "Median +2.9 %<!-- fig r0: median(pct; @r1 pct; @r2 pct; @r3 pct) -->.\n"
    bounds, problems = _check(tmp_path, text, runs)
    assert problems == [] and bounds[0].value == 2.885
    _, problems = _check(tmp_path, "Median +3.0 %<!-- fig r0: median(pct; @r1 pct; @r2 pct; @r3 pct) -->.\n", runs)
    assert problems and "README says 3.0" in problems[0]
    _, problems = _check(tmp_path, "Median +2.9 %<!-- fig r0: median(pct; @r9 pct) -->.\n", runs)
    assert problems and "r9" in problems[0]
