"""The decode benchmarks' kernel options: ``decode_gemm --triton-splitk`` / ``--cublaslt-algos``
and ``decode_attention --sweep``.

On this CPU machine the options refuse with an error that says why (they time Triton kernels or
cuBLASLt on CUDA; the cuBLASLt sweep's stored result renders in tests/test_bench_smoke.py).
Where Triton is installed, the split-K GEMM and the sweep also run under Triton's
interpreter (in a subprocess, as ``tests/test_serve_attention.py`` does): the GEMM equals
``x @ w.T`` for every split count and leaves its counters at zero, and the sweep puts the
attention module's constants back."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from bench import decode_attention, decode_gemm
from tests.test_serve_attention import INTERP


@pytest.mark.parametrize("argv, says", [
    (["--sweep", "256x32p1024w4s2", "--tiny"], "needs a CUDA device"),
    (["--sweep", "4x32w4s2"], "variants such as 256x32p1024w4s2"),
    (["--sweep", ""], "variants such as 256x32p1024w4s2"),
    (["--sweep", "256x24p1024w4s2"], "powers of two"),
    (["--sweep", "256x8p1024w4s2"], "the chunk at least 16"),
    (["--sweep", "48x32p1024w4s2"], "a multiple of the chunk"),
    (["--sweep", "256x32p0w4s2"], "programs, stages and the split cap at least 1"),
    (["--sweep", "256x32p1024w4s2c0"], "the split cap at least 1"),
    (["--table-keys", "100", "--shapes", "2x300"], "at least the longest context"),
])
def test_attention_sweep_refuses_bad_input_and_the_cpu(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        decode_attention.main(argv)
    assert e.value.code == 2
    assert says in capsys.readouterr().err


def test_splitk_gemm_refuses_the_cpu(capsys):
    with pytest.raises(SystemExit) as e:
        decode_gemm.main(["--triton-splitk", "--tiny"])
    assert e.value.code == 2
    assert "needs a CUDA device" in capsys.readouterr().err


@pytest.mark.parametrize("argv, says", [
    (["--cublaslt-algos", "--tiny"], "needs a CUDA device"),
    (["--cublaslt-algos", "--rows", "32,x"], "--rows takes integers"),
])
def test_cublaslt_algos_refuse_the_cpu_and_bad_rows(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        decode_gemm.main(argv + (["--device", "cpu"] if "--tiny" not in argv else []))
    assert e.value.code == 2
    assert says in capsys.readouterr().err


def _interpreted(code: str) -> str:
    r = subprocess.run([sys.executable, "-c", INTERP + code], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, TRITON_INTERPRET="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.strip().splitlines()[-1]


def test_splitk_gemm_equals_the_matmul_interpreted():
    pytest.importorskip("triton", reason="triton is not installed on this CPU machine (CPU torch does not ship it); the GPU machine's torch does, and runs this interpreted")
    out = _interpreted('''
import torch
from bench import decode_gemm as G
kernel = G._splitk_kernel()
counters = torch.zeros(64, dtype=torch.int32)
g = torch.Generator().manual_seed(0)
worst = 0.0
for m, k, n, cfg in ((5, 256, 128, (32, 64, 1)), (5, 256, 128, (32, 64, 4)), (16, 512, 64, (64, 128, 2)),
                     (3, 256, 64, (32, 32, 8))):
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    y = G.splitk_linear(kernel, x, w, cfg, counters)
    assert torch.equal(G.splitk_linear(kernel, x, w, cfg, counters), y)
    worst = max(worst, (y - x @ w.T).abs().max().item())
assert int(counters.abs().sum()) == 0
print(worst)
''')
    assert float(out) < 1e-3


def test_attention_sweep_puts_the_constants_back_interpreted():
    pytest.importorskip("triton", reason="triton is not installed on this CPU machine (CPU torch does not ship it); the GPU machine's torch does, and runs this interpreted")
    out = _interpreted('''
import torch
from bench import decode_attention as DA
from gpu_anchor.serve import attention as A
kept = [getattr(A, c) for c in DA.CONSTANTS]
r = DA.sweep("cpu", [(2, 70)], 1, ["32x32p1024w4s2", "32x32p1024w4s2c2", "32x32p1w4s2", "64x16p8w4s2"], 1, 4, 2,
             32, torch.float32)
row = r["2x70"]
assert [getattr(A, c) for c in DA.CONSTANTS] == kept
assert row["32x32p1024w4s2"]["over_first"] == 1.0 and row["32x32p1024w4s2"]["max_abs_difference"] == 0.0
# 70 keys in splits of 32: 3 splits, capped to 2 (longer splits): another order, close; the next
# variant, with no cap given, has the module's cap again (the same bits as the first)
assert 0.0 < row["32x32p1024w4s2c2"]["max_abs_difference"] < 1e-4
assert row["32x32p1w4s2"]["max_abs_difference"] == 0.0       # another program count: the same bits
# a block table as wide as a long max_model_len: more splits' room and programs, the same bits
narrow, wide = (DA._case("cpu", 3, 200, 1, 4, 2, 32, torch.float32, k) for k in (None, 1024))
assert wide[1].block_tables.shape[1] == 1024 // DA.BLOCK
A.SPLIT_KEYS = 32
assert torch.equal(A.attend_triton(narrow[2], narrow[0][0], narrow[1], 0.2),
                   A.attend_triton(wide[2], wide[0][0], wide[1], 0.2))
A.SPLIT_KEYS = kept[0]
print(row["64x16p8w4s2"]["max_abs_difference"])
''')
    assert float(out) < 1e-4
