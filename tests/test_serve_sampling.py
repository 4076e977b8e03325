"""Batched device sampling (CPU here; the same tensor ops run on the GPU).

The properties the engine relies on: a row's token is a function of its own logits, its
parameters and (seed, output index) — never of the batch around it; greedy is argmax with
ties to the lowest index; top-k / top-p keep exactly the tokens a stable descending sort
keeps; the counter RNG is the same number in Python, in tensor ops and (under the Triton
interpreter, when Triton is installed) in the CUDA kernel."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from gpu_anchor.serve import logit_adjust as LA
from gpu_anchor.serve import sampling as S
from gpu_anchor.serve.sequence import SamplingParams
from test_serve_attention import INTERP as INTERP_SETUP

V = 97


def _logits(B, seed=0, V=V):
    return torch.randn(B, V, generator=torch.Generator().manual_seed(seed)) * 3


def _reference(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The kept set and its renormalised distribution, from a stable sort (the definition)."""
    x = row.double() / p.temperature
    probs = torch.softmax(x, -1)
    if p.min_p:                                 # vLLM's min-p first; top-k and top-p see what it leaves
        x = x.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
        probs = torch.softmax(x, -1)
    order = sorted(range(len(x)), key=lambda i: (-x[i].item(), i))
    keep, mass = torch.zeros(len(x), dtype=torch.bool), 0.0
    for r, i in enumerate(order):
        if (p.top_k and r >= p.top_k) or (r > 0 and mass >= p.top_p):
            break
        keep[i] = True
        mass += probs[i].item()
    q = torch.where(keep, probs, torch.zeros_like(probs))
    return q / q.sum()


def test_uniform_is_a_pure_function_of_seed_and_index_in_python_and_tensors():
    seeds = [0, 1, 2 ** 31 - 1, 2 ** 32, 2 ** 62 - 5, -3, 123456789123]
    idx = [0, 1, 2, 7, 1000, 2 ** 31 - 1, 2 ** 32 - 1]
    py = [S.uniform(s, i) for s in seeds for i in idx]
    lo, hi = zip(*[S._split(s) for s in seeds for _ in idx])
    ix = [i for _ in seeds for i in idx]
    t = S.uniforms(torch.tensor(lo), torch.tensor(hi), torch.tensor(ix))
    assert t.tolist() == py
    assert all(0.0 <= u < 1.0 for u in py)
    assert len(set(py)) == len(py)
    assert S.uniform(5, 3) == S.uniform(5, 3) and S.uniform(5, 3) != S.uniform(6, 3)


def test_uniform_is_roughly_uniform_and_uncorrelated():
    n = 20000
    lo = torch.full((n,), 42)
    u = S.uniforms(lo, torch.zeros(n, dtype=torch.long), torch.arange(n))
    counts = torch.histc(u, bins=20, min=0, max=1)
    assert (counts - n / 20).abs().max() < 5 * (n / 20) ** 0.5            # ~5 sigma
    assert abs(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1].item()) < 0.05
    v = S.uniforms(torch.arange(n), torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long))
    assert abs(torch.corrcoef(torch.stack([v[:-1], v[1:]]))[0, 1].item()) < 0.05


def test_greedy_is_argmax_with_ties_to_the_lowest_index():
    x = _logits(4)
    x[1, 10] = x[1, 50] = x[1].max() + 1
    out = S.sample(x, [SamplingParams()] * 4, [0] * 4)
    assert out == x.argmax(-1).tolist() and out[1] == 10


MIXED = [SamplingParams(), SamplingParams(temperature=0.8, seed=1), SamplingParams(temperature=1.3, top_k=5, seed=2),
         SamplingParams(temperature=0.7, top_p=0.6, seed=3), SamplingParams(temperature=1.0, top_k=8, top_p=0.9, seed=4),
         SamplingParams(temperature=0.5, top_k=1, seed=5), SamplingParams(temperature=2.0, top_k=500, seed=6),
         SamplingParams(temperature=1.5, min_p=0.2, seed=7), SamplingParams(temperature=1.2, min_p=0.1, top_p=0.8, seed=8),
         SamplingParams(min_p=0.5)]


def test_rows_are_independent_of_the_batch_around_them():
    x = _logits(len(MIXED), seed=1)
    idx = list(range(3, 3 + len(MIXED)))
    together = S.sample(x, MIXED, idx)
    alone = [S.sample(x[b:b + 1], [p], [i])[0] for b, (p, i) in enumerate(zip(MIXED, idx))]
    assert together == alone
    rev = S.sample(x.flip(0), MIXED[::-1], idx[::-1])
    assert rev[::-1] == together
    # a greedy-only batch takes the argmax path; the greedy row's token is the same either way
    assert S.sample(x[:1], MIXED[:1], idx[:1])[0] == together[0] == x[0].argmax().item()


def _adjusted_reference(row: torch.Tensor, p: SamplingParams, prompt: list, out: list, eos: list) -> torch.Tensor:
    """``logit_adjust``'s definition for one row, token by token (vLLM v1's order)."""
    x = row.clone()
    if len(out) < p.min_tokens:
        for t in list(p.stop_token_ids) + ([] if p.ignore_eos else eos):
            x[t] = float("-inf")
    for t, v in p.logit_bias:
        x[t] = x[t] + v
    for t in set(prompt) | set(out):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(out):
        x[t] = x[t] - p.frequency_penalty * out.count(t) - p.presence_penalty
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_logit_adjustments_per_row_and_independent_of_the_batch(dtype):
    """``adjust_logits`` equals the per-token definition on each row that adjusts (and leaves the
    others' logits as they were); a row's result, and so its draw, is the same alone or in a batch."""
    rng = torch.Generator().manual_seed(5)
    eos = [7]
    params = [SamplingParams(), SamplingParams(repetition_penalty=1.4),
              SamplingParams(presence_penalty=0.5, frequency_penalty=-0.3, temperature=0.9, seed=3),
              SamplingParams(repetition_penalty=0.8, presence_penalty=-1.0, frequency_penalty=2.0, top_k=9, seed=4),
              SamplingParams(logit_bias={3: 5.0, 50: -100}, min_tokens=9, stop_token_ids=(11, 12), temperature=0.7,
                             seed=5),
              SamplingParams(min_tokens=2, ignore_eos=True, stop_token_ids=(4,)),
              SamplingParams(min_tokens=3, logit_bias={7: 100}, repetition_penalty=1.1)]
    prompts = [torch.randint(0, V, (n,), generator=rng).tolist() for n in (5, 9, 3, 12, 4, 6, 2)]
    outs = [torch.randint(0, 20, (n,), generator=rng).tolist() for n in (4, 0, 7, 11, 8, 2, 1)]
    x = _logits(len(params), seed=6).to(dtype)
    idx = [len(o) for o in outs]
    y = LA.adjust_logits(x, params, prompts, outs, idx, eos)
    assert y.dtype == torch.promote_types(dtype, torch.float32) and x.dtype == dtype
    assert torch.equal(y[0], x[0].to(y.dtype))
    assert y[4, 11] == y[4, 12] == y[4, 7] == y[6, 7] == float("-inf") and y[5, 4] > float("-inf")   # row 5: 2 made
    for b in range(1, len(params)):
        want = _adjusted_reference(x[b].to(y.dtype), params[b], prompts[b], outs[b], eos)
        assert torch.allclose(y[b], want, rtol=0, atol=1e-12 if y.dtype == torch.float64 else 1e-5), b
        alone = LA.adjust_logits(x[b:b + 1], params[b:b + 1], prompts[b:b + 1], outs[b:b + 1], idx[b:b + 1], eos)
        assert torch.equal(alone[0], y[b])
    assert S.sample(y, params, idx) == [S.sample(y[b:b + 1], [p], [i])[0] for b, (p, i) in enumerate(zip(params, idx))]
    assert LA.adjust_logits(x, [SamplingParams()] * len(params), prompts, outs, idx, eos) is x
    # a step launched ahead: each row's last token still on the device, counted from there
    some = [b for b in range(len(params)) if outs[b]]
    ahead = LA.adjust_logits(x[some], [params[b] for b in some], [prompts[b] for b in some],
                             [outs[b][:-1] for b in some], [idx[b] for b in some], eos,
                             pending=torch.tensor([outs[b][-1] for b in some]))
    assert torch.equal(ahead, y[some])


def test_a_draw_is_the_inverse_cdf_of_the_kept_distribution_at_the_counter_uniform():
    x = _logits(len(MIXED), seed=2)
    for step in range(5):
        idx = [step * 10 + b for b in range(len(MIXED))]
        out = S.sample(x, MIXED, idx)
        for b, p in enumerate(MIXED):
            if p.greedy:
                continue
            q = _reference(x[b], p)
            cdf = torch.cumsum(q, 0)
            u = S.uniform(p.seed, idx[b])
            expect = int(torch.searchsorted(cdf, torch.tensor([u], dtype=cdf.dtype), right=True).clamp(max=V - 1))
            assert q[out[b]] > 0, (b, p)
            # float32 vs float64 sums may differ only at a boundary: then a neighbour in the kept set
            assert out[b] == expect or abs(cdf[out[b]] - u) < 1e-5 or abs(cdf[expect] - u) < 1e-5


@pytest.mark.parametrize("p", [p for p in MIXED if not p.greedy],
                         ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}")
def test_empirical_distribution_matches_the_reference(p):
    x = _logits(1, seed=3, V=12)
    n = 4000
    out = S.sample(x.expand(n, -1), [p] * n, list(range(n)))
    freq = torch.bincount(torch.tensor(out), minlength=12).double() / n
    ref = _reference(x[0], p)
    assert (freq[ref == 0] == 0).all()
    assert (freq - ref).abs().max() < 0.035


def test_top_k_ties_keep_the_lowest_indices():
    x = torch.zeros(1, 10)
    x[0, [2, 5, 7]] = 1.0                      # three-way tie for the top; k = 2 keeps 2 and 5
    keep = S._top_k_mask(x, torch.tensor([2]), 2)
    assert keep[0].nonzero().flatten().tolist() == [2, 5]
    p = SamplingParams(temperature=1.0, top_k=2, seed=9)
    assert {S.sample(x, [p], [i])[0] for i in range(200)} == {2, 5}
    q = SamplingParams(temperature=1.0, top_k=2, top_p=0.99, seed=9)   # the sorted path agrees
    assert {S.sample(x, [q], [i])[0] for i in range(200)} == {2, 5}


def test_logprobs_still_report_the_raw_distribution():
    x = _logits(3, seed=4)
    chosen = S.sample(x, MIXED[:3], [0, 0, 0])
    lps = S.token_logprobs(x, chosen, [0, 2, 5])
    ref = torch.log_softmax(x, -1)
    for b, (lp, top) in enumerate(lps):
        assert abs(lp - ref[b, chosen[b]].item()) < 1e-5
        assert [i for i, _ in top] == ref[b].topk([0, 2, 5][b]).indices.tolist()


INTERP = '''
import os, torch
os.environ["TRITON_INTERPRET"] = "1"
from gpu_anchor.serve import sampling as S
seeds = [0, 1, 2 ** 31 - 1, 2 ** 32 + 7, 2 ** 62 - 5, 987654321987]
lo, hi = (torch.tensor(v) for v in zip(*[S._split(s) for s in seeds for _ in range(9)]))
ix = torch.tensor([i * 977 for _ in seeds for i in range(9)])
out = torch.empty(len(ix), dtype=torch.float32)
S._uniform_kernel[(1,)](lo, hi, ix, out, len(ix), BLOCK=64)
print(out.tolist() == S.uniforms(lo, hi, ix).tolist())
'''


def test_triton_uniform_kernel_equals_the_tensor_ops_interpreted():
    pytest.importorskip("triton", reason="triton is not installed on this CPU machine; the GPU tests run it")
    r = subprocess.run([sys.executable, "-c", INTERP], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, TRITON_INTERPRET="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "True"


# Triton's interpreter with its numpy >= 2 fix (the attention kernel's tests set it up), then this module
INTERP_PATCH = INTERP_SETUP + """
import torch
from gpu_anchor.serve import sampling as S
"""
TOP_P_CASES = '''
def cases(device, n, V_list, B):
    """Rows where the sorted definition is easy to get wrong: ties (rounded logits), flat runs,
    p tiny / near 1 / 1, top-k together with top-p; yields (probs, k, p) on ``device``."""
    g = torch.Generator().manual_seed(0)
    for t in range(n):
        V = V_list[(t // 4) % len(V_list)]        # every size meets every scale below
        x = torch.randn(B, V, generator=g) * [0.01, 1, 3, 8][t % 4]
        if t % 3 == 0:
            x = (x * 4).round() / 4
        if t % 5 == 1:
            x[:, : V // 2] = 0.0
        probs = torch.softmax(x, -1).to(device)
        p = torch.tensor([1e-7, 0.3, 0.9, 0.95, 0.999999, 1.0] * (B // 6 + 1))[torch.randperm(B, generator=g)]
        p = p.to(device)
        k = torch.tensor([V, V, 3, 1, V, min(50, V)] * (B // 6 + 1), device=device)[:B]
        k = torch.where(p < 1.0, k, V)
        yield probs, k, p

def mismatches(device, n, V_list, B, launch, draw):
    """Rows whose top-p mask, or whose draw (with that mask, and with none), differs from the
    tensor ops' (sort, running sum, searchsorted)."""
    bad = 0
    g = torch.Generator().manual_seed(1)
    for probs, k, p in cases(device, n, V_list, B):
        rows = (p < 1.0).nonzero().flatten()
        ref = torch.ones(probs.shape, dtype=torch.bool, device=device)
        ref[rows] = S._top_p_mask(probs[rows], k[rows], p[rows])
        bad += int(not torch.equal(launch(probs, k, p), ref))
        u24 = torch.randint(0, 1 << 24, (B,), generator=g).to(device)
        u24[0], u24[-1] = 0, (1 << 24) - 1
        bad += int(not torch.equal(draw(probs, ref, u24), S._draw(probs, ref, u24)))
        bad += int(not torch.equal(draw(probs, None, u24), S._draw(probs, None, u24)))
    return bad
'''
TOP_P_INTERP = '''
def launch(probs, k, p):     # _top_p_mask_cuda's launch, with blocks small enough for these rows
    B, V = probs.shape
    need = torch.where(p < 1.0, S._fixed(p).clamp(min=1), torch.full_like(S._fixed(p), 1 << 62))
    kneed = torch.where(k < V, k, V + 1).to(torch.int64)
    keep = torch.empty(B, V, dtype=torch.bool)
    cand, cidx = torch.empty(B, 64), torch.empty(B, 64, dtype=torch.int32)
    S._top_p_kernel[(B,)](probs.contiguous(), need, kneed, keep, cand, cidx, V, V, BLOCK=64)
    return keep
def draw(probs, keep, u24):
    B, V = probs.shape
    out = torch.empty(B, dtype=torch.int64)
    S._draw_kernel[(B,)](probs, probs if keep is None else keep, u24, out, V, V, HAS_KEEP=keep is not None, BLOCK=64)
    return out
print(mismatches("cpu", 16, [5, 97, 130, 300], 6, launch, draw))
'''


def test_top_p_and_draw_kernels_equal_the_tensor_ops_interpreted():
    """The CUDA top-p kernel (a bisection over the probabilities' bits, no sort) against the
    sorted definition, mask for mask, and the draw kernel against the running sum and
    searchsorted, id for id, under Triton's interpreter, with blocks of 64 so that both ways
    the kernel ends (a window of few tokens gathered; one value tied more than a block) are
    taken.  Mutating the tie count's rounding, either tie cut, the mass above the window or
    the draw's comparison makes rows differ (checked when it was written)."""
    pytest.importorskip("triton", reason="triton is not installed on this CPU machine; the GPU tests run it")
    r = subprocess.run([sys.executable, "-c", INTERP_PATCH + TOP_P_CASES + TOP_P_INTERP], capture_output=True,
                       text=True, timeout=600, env=dict(os.environ, TRITON_INTERPRET="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "0"


@pytest.mark.gpu
def test_gpu_top_p_and_draw_kernels_equal_the_tensor_ops():
    """The same on the GPU at a real vocabulary (Qwen3's 151 936), 64 rows, and rows of bf16
    logits (many ties), through the launches the engine makes."""
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    ns = {"torch": torch, "S": S}
    exec(TOP_P_CASES, ns)
    assert ns["mismatches"]("cuda", 12, [151936, 1000, 4099], 64, S._top_p_mask_cuda, S._draw_cuda) == 0
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(64, 151936, generator=g) * 3).to(torch.bfloat16).cuda()
    for T in (0.6, 1.0, 1.5):
        probs = torch.softmax(x.float() / T, -1)
        p = torch.linspace(0.05, 0.999, 64, device="cuda")
        k = torch.full((64,), 151936, device="cuda")
        assert torch.equal(S._top_p_mask_cuda(probs, k, p), S._top_p_mask(probs, k, p))


@pytest.mark.gpu
def test_gpu_sampling_equals_cpu():
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    x = _logits(len(MIXED), seed=5)
    idx = list(range(len(MIXED)))
    assert S.sample(x.cuda(), MIXED, idx) == S.sample(x, MIXED, idx)


@pytest.mark.gpu
def test_gpu_sampled_draws_repeat_and_do_not_depend_on_the_batch():
    """At a real vocabulary size on CUDA, the same rows drawn again give the same ids, and a
    row drawn alone gives what it gave in a batch of 64 (the inverse CDF's running sum is
    taken in fixed point: a float scan over one row varies from run to run on CUDA)."""
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    g = torch.Generator().manual_seed(11)
    B, V = 64, 151936
    x = (torch.randn(B, V, generator=g) * 3).to(torch.bfloat16).cuda()
    params = [SamplingParams(temperature=(0.6, 0.8, 1.0, 1.3)[b % 4], top_p=(1.0, 0.95)[b % 2],
                             top_k=(0, 0, 50)[b % 3], seed=b) for b in range(B)]
    for start in range(0, 400, 40):
        idx = list(range(start, start + B))
        ref = S.sample(x, params, idx)
        for _ in range(3):
            assert S.sample(x, params, idx) == ref
        assert [S.sample(x[b:b + 1], [params[b]], [idx[b]])[0] for b in range(0, B, 7)] == ref[::7]


@pytest.mark.parametrize("bad,match", [({"presence_penalty": 2.5}, "presence_penalty must be in"),
                                       ({"min_p": 1.5}, "min_p must be in"),
                                       ({"min_tokens": 20, "max_tokens": 10}, "min_tokens must be in"),
                                       ({"logit_bias": {3: 200}}, "logit_bias: token 3"),
                                       ({"logit_bias": {-1: 2}}, "logit_bias: token -1"),
                                       ({"frequency_penalty": -3}, "frequency_penalty must be in"),
                                       ({"repetition_penalty": 0}, "repetition_penalty must be in"),
                                       ({"top_p": 0}, "top_p must be in"), ({"temperature": -1}, "temperature must")])
def test_sampling_params_refuse_out_of_range_values(bad, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**bad)
    p = SamplingParams(repetition_penalty=1.2)
    assert SamplingParams.from_dict(p.to_dict()) == p and p.penalized
    assert "repetition_penalty" not in SamplingParams().to_dict()     # a journal record without penalties is as before
