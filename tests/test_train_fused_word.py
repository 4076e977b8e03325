"""The fused Adam kernel moves the progress word itself (docs/training.md, "fused undo").

Contract (``fused_adam.launch`` with ``word``): the last of a launch's ``nblocks`` programs
to finish stores the value and resets the counter; a launch cut short (a kill inside the
kernel leaves some programs unrun) leaves the word where it was; the maths is the same bit
for bit with and without the word.  Natively on the GPU; on the CPU under Triton's
interpreter (when Triton is installed).
"""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

CASE = textwrap.dedent('''
    import torch
    from gpu_anchor.train import fused_adam as fa
    HP = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, amsgrad=False, maximize=False,
              foreach=None, fused=None, capturable=False, differentiable=False, decoupled_weight_decay=True)

    def word_case(dev, dtype, sizes=(3 * fa.BLOCK + 40, 1000)):
        key = fa.structure(HP, dtype)
        gen = torch.Generator().manual_seed(3)

        def r(n, pos=False):
            x = torch.randn(n, generator=gen)
            return (x.abs() if pos else x).to(dtype).to(dev)

        def chunk(seed_tensors=None):
            sl = []
            for k, n in enumerate(sizes):
                t = [x.clone() for x in seed_tensors[k][0]] if seed_tensors else [r(n), r(n), r(n), r(n, True)]
                sl.append((t, [torch.empty(n, dtype=dtype, device=dev) for _ in range(3)]))
            return sl

        mine = chunk()
        plain = chunk(mine)
        nb = sum(fa.blocks(n) for n in sizes)
        tags = [torch.full((2, nb), -1, dtype=torch.int64, device=dev) for _ in range(2)]
        tables = [fa.FusedAdam([sl], t)._table(0, tuple(range(len(sizes)))) for sl, t in zip((mine, plain), tags)]
        word = torch.full((1,), 5, dtype=torch.int64, device=dev)
        counter = torch.zeros(1, dtype=torch.int32, device=dev)
        out = {}
        rows, blks, n = tables[0]
        # a kill inside the kernel: programs left unrun, so the count never reaches nblocks
        fa.launch(rows, blks, n, tags[0][0], 11, key, True, fa.scalars(HP, 0), word=(counter, word, 12),
                  programs=n - 1)
        out["cut_short"] = (int(word.item()), int(counter.item()), n)
        for (tm, _), (tp, _) in zip(mine, plain):  # back to the pre-step values (the restore's job)
            for x, y in zip(tm, tp):
                x.copy_(y)
        counter.zero_()                           # a new worker's counter starts at zero
        for step in range(2):
            fa.launch(rows, blks, n, tags[0][step % 2], 11 + step, key, True, fa.scalars(HP, step),
                      word=(counter, word, 20 + step))
            out[f"step{step}"] = (int(word.item()), int(counter.item()))
            prow, pblks, pn = tables[1]
            fa.launch(prow, pblks, pn, tags[1][step % 2], 11 + step, key, True, fa.scalars(HP, step))
        out["same_bits"] = all(fa._same_bits(a, b) for (ta, _), (tb, _) in zip(mine, plain) for a, b in zip(ta, tb))
        out["same_undo"] = all(fa._same_bits(a, b) for (_, ua), (_, ub) in zip(mine, plain) for a, b in zip(ua, ub))
        return out
''')


def _check(out):
    word, counter, n = out["cut_short"]
    assert word == 5 and counter == n - 1, out          # not moved; the count stopped short
    assert out["step0"] == (20, 0) and out["step1"] == (21, 0), out
    assert out["same_bits"] and out["same_undo"], out


def test_word_moves_only_after_every_block_interpreted():
    pytest.importorskip("triton", reason="triton is not installed on this CPU machine; the kernel is "
                                         "tested natively by the gpu-marked test")
    code = CASE + "print(repr(word_case('cpu', torch.float32)))"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, TRITON_INTERPRET="1",
                                PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", "")))
    assert r.returncode == 0, r.stderr[-3000:]
    _check(eval(r.stdout.strip().splitlines()[-1]))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_word_moves_only_after_every_block_on_gpu(dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("triton")
    ns = {}
    exec(CASE, ns)
    _check(ns["word_case"]("cuda", dtype))
