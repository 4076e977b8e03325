"""Every benchmark scenario in bench/ runs at toy size on CPU: ``python -m bench NAME --tiny``.

Scenarios are discovered with ``bench.__main__.scenarios()``, so a new bench/NAME.py is
covered without editing this file; one that has no ``--tiny`` fails here.  Each run gets
its own socket directory (its daemons never meet a user's) and output directory, and
must write at least one ``*_tiny.json`` result that ``bench.report`` can render.  No
timing is asserted: these runs only prove the scenarios work end to end.
"""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

from bench.__main__ import scenarios

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 240


@pytest.mark.parametrize("name", scenarios())
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
    # the renderer must accept the tiny results (published names are rendered the same way)
    text = report.render_all(str(out), include_tiny=True, img_dir=str(tmp_path / "img"))
    assert "## " in text


def test_report_skips_tiny_results(tmp_path):
    from bench import report
    (tmp_path / "x_tiny.json").write_text(json.dumps({"benchmark": "x", "a": 1.0}))
    img = str(tmp_path / "img")
    assert "## x" not in report.render_all(str(tmp_path), img_dir=img)
    assert "## x" in report.render_all(str(tmp_path), include_tiny=True, img_dir=img)
