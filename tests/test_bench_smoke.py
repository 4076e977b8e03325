"""The benchmark harness without running the benchmarks: every scenario in bench/ parses its
command line (``--tiny`` included), and the report renders every stored result.

Scenarios are discovered with ``bench.__main__.scenarios()``, so a new bench/NAME.py is
covered without editing this file.  Three scenarios also run end to end at toy size, each in
its own test: ``restart_latency`` (tests/test_launch_bench.py: the supervisor's recovery),
``checkpoint_stall`` (tests/test_checkpoint_bench.py: the concurrent checkpoint) and
``serve_throughput`` (tests/test_serve_bench.py: the serving engine).  ``make test-all`` runs
every scenario end to end (``test_scenario_runs_tiny``, marked slow).  No timing is asserted.
"""
from __future__ import annotations

import glob
import importlib
import json
import os
import subprocess
import sys

import pytest

from bench.__main__ import scenarios
from bench.common import RESULTS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 240
HELPERS = {"baselines", "models"}      # shared code with a command line of its own, no results


@pytest.mark.parametrize("name", scenarios())
def test_scenario_parses_its_arguments(name, capsys):
    mod = importlib.import_module(f"bench.{name}")
    with pytest.raises(SystemExit) as e:
        mod.main(["--tiny", "--help"])
    assert e.value.code == 0
    assert "--tiny" in capsys.readouterr().out, f"{name} has no --tiny (the smoke size every scenario offers)"


def test_every_stored_result_renders(tmp_path):
    """Each scenario has a published result in bench/results/, and each renders into the report
    (the markdown docs/benchmarks.md is made of)."""
    from bench import report
    stored = [p for p in glob.glob(os.path.join(RESULTS, "*.json")) if not p.endswith("_tiny.json")]
    owners = set()
    for path in stored:
        with open(path) as f:
            result = json.load(f)
        assert result.get("machine") and result.get("command"), path
        if not result.get("test"):
            owners.add(report._module(result.get("benchmark", os.path.basename(path)[:-5])).__name__)
    missing = {n for n in scenarios() if n not in HELPERS} - {m.rsplit(".", 1)[-1] for m in owners}
    assert not missing, f"scenarios without a stored result in bench/results: {sorted(missing)}"
    text = report.render_all(RESULTS, img_dir=str(tmp_path / "img"))
    assert text.count("\n## ") == len(stored) + 1          # and the target table before them
    assert text.index("\n## Where each target stands") < text.index("\n## ", text.index("\n## ") + 1)


def test_report_skips_tiny_results(tmp_path):
    from bench import report
    (tmp_path / "x_tiny.json").write_text(json.dumps({"benchmark": "x", "a": 1.0}))
    img = str(tmp_path / "img")
    assert "## x" not in report.render_all(str(tmp_path), img_dir=img)
    assert "## x" in report.render_all(str(tmp_path), include_tiny=True, img_dir=img)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in scenarios() if n not in HELPERS])
def test_scenario_runs_tiny(name, tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, GPU_ANCHOR_SOCKET_DIR=str(tmp_path / "sock"), CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("GPU_ANCHOR_BENCH_OUT", None)
    try:
        proc = subprocess.run([sys.executable, "-m", "bench", name, "--tiny", "--out", str(out)], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"`python -m bench {name} --tiny` ran over {TIMEOUT_S} s\n{e.stdout}\n{e.stderr}")
    assert proc.returncode == 0, (f"`python -m bench {name} --tiny` failed (rc {proc.returncode}); a scenario "
                                  f"without --tiny fails here too\n--- stdout\n{proc.stdout[-4000:]}\n"
                                  f"--- stderr\n{proc.stderr[-4000:]}")
    written = glob.glob(str(out / "*.json"))
    assert written, f"{name} --tiny wrote no result into --out"
    from bench import report
    for path in written:
        with open(path) as f:
            result = json.load(f)
        assert result.get("machine") and result.get("command"), path
        assert path.endswith("_tiny.json"), f"{path}: smoke-size results must be named *_tiny.json"
        runs = result.get("runs", {}) if result.get("benchmark", "").startswith("e2e_") else {}
        for rate, rows in runs.items():  # end-to-end runs: the fault path must be exercised
            assert rows and all(r["faults"] >= 1 for r in rows), f"{path}: a run at rate {rate} met no fault"
        assert not result.get("failed"), f"{path}: {result['failed']}"
    text = report.render_all(str(out), include_tiny=True, img_dir=str(tmp_path / "img"))
    assert "## " in text
