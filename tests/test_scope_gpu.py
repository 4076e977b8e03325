"""managed_scope on a CUDA device (H200): recipes and CUDA RNG bit-identical, a Hugging Face
Llama killed and restarted, the program-change table, and the bind-time benchmark at 1B.

The pytest process has initialised the CUDA driver (conftest), so kill/restart campaigns
run as fresh subprocesses that fork their own workers before touching CUDA.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from gpu_anchor.scope.interception import ScopeMode
from gpu_anchor.scope.placeholders import Placeholder, real_view

pytestmark = pytest.mark.gpu
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _script(*args, timeout=900):
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop("GPU_ANCHOR_SOCKET_DIR", None)
    try:
        out = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=timeout)
    except subprocess.TimeoutExpired as e:  # say how far it got
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        pytest.fail(f"{args} ran over {timeout} s; its stderr so far:\n{err[-4000:]}")
    sys.stdout.write(out.stdout[-6000:])
    return out


def test_cuda_recipes_and_generator_bit_identical():
    dev = "cuda:0"

    def build():
        with torch.device(dev):
            lin, emb = nn.Linear(64, 96), nn.Embedding(1000, 64)
            w = torch.empty(128, 64)
            nn.init.trunc_normal_(w, std=0.02)
            o = torch.empty(32, 48)
            nn.init.orthogonal_(o)
            return [lin.weight, lin.bias, emb.weight, w, o, torch.randn(4097), torch.rand(33, 7),
                    torch.randint(0, 50, (999,)), torch.zeros(5).to(torch.bfloat16) + 1,
                    torch.tensor([1.0, 2.0], device=dev), torch.arange(0, 64, 2, device=dev).float() / 64]
    torch.manual_seed(7)
    ref = build()
    ref_after = (torch.rand(16, device=dev), torch.rand(4))
    torch.manual_seed(7)
    mode = ScopeMode(lambda d: d.startswith("cuda"))
    with mode:
        got = build()
    assert all(isinstance(g, Placeholder) for g in got)
    stores = {id(g._ga_store): g._ga_store for g in got}
    out = mode.recorder.evaluate({s: None for s in stores.values()}, advance_pending=True)
    after = (torch.rand(16, device=dev), torch.rand(4))
    for r, g in zip(ref, got):
        assert torch.equal(r, real_view(out[g._ga_store], g._ga_meta))
    assert torch.equal(after[0], ref_after[0]) and torch.equal(after[1], ref_after[1])


def test_hf_llama_on_cuda_kill_and_restart():
    out = _script("examples/scope_llama_restart.py", "--device", "cuda:0", "--layers", "4", "--hidden", "256")
    assert out.returncode == 0, out.stderr[-4000:]
    res = json.loads(out.stdout[out.stdout.index("{"):])
    assert all(res["checks"].values()), res["checks"]


def test_program_change_table_on_cuda():
    out = _script("examples/scope_program_changes.py", "--device", "cuda:0", "--json")
    assert out.returncode == 0, out.stderr[-4000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    got = {(r["case"], r["naming"]): r["outcome"] for r in results}
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from test_scope_restart import EXPECTED
    for naming, cases in EXPECTED.items():
        for case, outcome in cases.items():
            assert got[(case, naming)] == outcome, (case, naming, results)


def test_bind_time_benchmark_1b(tmp_path):
    out_dir = os.environ.get("GPU_ANCHOR_BENCH_OUT") or str(tmp_path)
    out = _script("-m", "bench", "scope_bind", "--device", "cuda:0", "--presets", "llama-1b", "llama-1b-x10",
                  "--repeats", "3", "--out", out_dir, timeout=1800)
    assert out.returncode == 0, out.stderr[-4000:]
    data = json.load(open(os.path.join(out_dir, "scope_bind_cuda0.json")))
    for r in data["rows"]:
        assert r["restart_all_matched"] and r["restart_replayed_ops"] == 0
        print(f"{r['preset']}: {r['params'] / 1e9:.2f} B params, restart bind {r['restart_bind_ms_median']:.1f} ms, "
              f"block {r['restart_block_ms_median']:.1f} ms, memory overhead {r['memory_overhead_pct']:.3f} %")


def test_what_works_matrix_on_cuda(tmp_path):
    """Every case of tests/scope_matrix.py on cuda:0 (no host daemon: host-built weights stay
    native until moved to the GPU), first run / SIGKILL / restart, as on CPU."""
    out = tmp_path / "matrix_cuda.json"
    res = _script("tests/scope_matrix.py", "--device", "cuda:0", "--out", str(out), timeout=1200)
    assert res.returncode == 0, res.stderr[-4000:]
    results = json.loads(out.read_text())
    bad = {r["case"]: r["problems"] for r in results if r["problems"]}
    assert not bad, json.dumps(bad, indent=1)[-6000:]
