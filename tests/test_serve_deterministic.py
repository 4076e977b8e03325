"""``gpu-anchor serve --deterministic``: batch-invariant kernels (``serve/batch_invariant.py``).

CPU:
- the Triton GEMM and RMSNorm kernels under Triton's interpreter (skipped where Triton is not
  installed, as in CI): equal to torch, and a row's result bitwise the same for M = 1, 3, 64,
  200 rows wherever the row sits in the batch;
- the CPU path's ops (row-wise linear, tree-sum RMSNorm, per-token attention): the same property;
- the model: the K/V that decode steps write token by token, in a batch with another sequence,
  equal bit for bit the K/V that one prefill of the same tokens writes next to a different
  sequence, and so do the last logits — what a recovery that recomputes needs;
- the options: ``--deterministic`` refused where it cannot hold (more than 2 tensor-parallel
  ranks, float64 on CUDA).

GPU (marked ``gpu``): the compiled kernels in bf16 and float32 over the shapes of Qwen3-8B, the
model's prefill-vs-decode K/V in bf16 through CUDA graphs, and ``gpu-anchor serve
--deterministic`` in bf16 under the openai client (half greedy, half seeded sampling): the
engine SIGKILLed twice, and separately the daemon SIGKILLed once (the K/V recomputed as a
prefill), every stream token-identical to its fault-free run.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from test_serve_attention import INTERP

KERNELS = textwrap.dedent('''
    import torch
    import torch.nn.functional as F
    from gpu_anchor.serve import batch_invariant as B
    from gpu_anchor.serve.model_runner import _rms

    def kernel_case(device, dtype, K, N, D, ms=(1, 3, 64, 200), seed=0):
        """Max error against torch (float64) of the GEMM and RMSNorm, and whether the rows
        placed at different positions of batches of ``ms`` rows came out bitwise equal."""
        g = torch.Generator().manual_seed(seed)
        w = (torch.randn(N, K, generator=g) / K ** 0.5).to(device, dtype)
        bias = torch.randn(N, generator=g).to(device, dtype)
        nw = (1 + 0.1 * torch.randn(D, generator=g)).to(device, dtype)
        row, nrow = torch.randn(K, generator=g).to(device, dtype), torch.randn(D, generator=g).to(device, dtype)
        lin, norm, err = [], [], 0.0
        for i, m in enumerate(ms):
            x = torch.randn(m, K, generator=g).to(device, dtype)
            xn = torch.randn(m, D, generator=g).to(device, dtype)
            at = (37 * i) % m
            x[at], xn[at] = row, nrow
            y = B._linear_triton(x, w, bias)
            ref = F.linear(x.double(), w.double(), bias.double())
            err = max(err, ((y.double() - ref).abs().max() / ref.abs().max()).item())
            yn = B._rms_triton(xn, nw, 1e-6)
            nref = _rms(xn.double(), nw.double(), 1e-6)
            err = max(err, ((yn.double() - nref).abs().max() / nref.abs().max()).item())
            lin.append(y[at])
            norm.append(yn[at])
        same = all(torch.equal(lin[0], t) for t in lin) and all(torch.equal(norm[0], t) for t in norm)
        return err, same
''')


def test_kernels_batch_invariant_interpreted():
    pytest.importorskip("triton", reason="triton is not installed on this CPU machine; the kernels are "
                                         "tested natively by the gpu-marked tests")
    code = INTERP + KERNELS + textwrap.dedent('''
        for dtype, K, N, D in ((torch.float32, 200, 96, 128), (torch.float16, 130, 70, 96)):
            err, same = kernel_case("cpu", dtype, K, N, D)
            print(dtype, err, same)
    ''')
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, TRITON_INTERPRET="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.split("\n")[-3:-1]
    for line, tol in zip(lines, (1e-5, 2e-3)):   # relative to the largest value
        _, err, same = line.split()
        assert same == "True" and float(err) < tol, r.stdout


def test_cpu_ops_batch_invariant():
    from gpu_anchor.serve import batch_invariant as B
    g = torch.Generator().manual_seed(1)
    w, bias = torch.randn(48, 80, generator=g), torch.randn(48, generator=g)
    nw = torch.rand(80, generator=g) + 0.5
    row = torch.randn(80, generator=g)
    lin, norm = [], []
    for m, at in ((1, 0), (3, 2), (64, 40), (200, 130)):
        x = torch.randn(m, 80, generator=g)
        x[at] = row
        y = B.linear(x, w, bias)
        assert torch.allclose(y, torch.nn.functional.linear(x, w, bias), atol=1e-5)
        lin.append(y[at])
        yn = B.rms_norm(x, nw, 1e-6)
        from gpu_anchor.serve.model_runner import _rms
        assert torch.allclose(yn, _rms(x, nw, 1e-6), atol=1e-5)
        norm.append(yn[at])
    assert all(torch.equal(lin[0], t) for t in lin) and all(torch.equal(norm[0], t) for t in norm)


def test_rowwise_sampling_draws_what_sampling_draws():
    """``batch_invariant.sample`` is ``sampling.sample`` with each sampled row drawn alone: the
    same tokens for the same (seed, index), greedy rows and sampled rows mixed."""
    from gpu_anchor.serve import batch_invariant as B
    from gpu_anchor.serve.sampling import sample
    from gpu_anchor.serve.sequence import SamplingParams
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(12, 300, generator=g) * 3
    params = [SamplingParams(temperature=0.0) if b % 3 == 0 else
              SamplingParams(temperature=0.7 + 0.1 * b, top_p=0.9, top_k=50 if b % 2 else 0, seed=b) for b in range(12)]
    idx = list(range(5, 17))
    assert B.sample(logits, params, idx) == sample(logits, params, idx)
    assert B.sample(logits[4:5], params[4:5], idx[4:5]) == sample(logits, params, idx)[4:5]


# ------------------------------------------------------------------ the model: prefill K/V == decode K/V
def _tiny_model(device, dtype, deterministic, num_blocks=64, bs=16):
    from transformers import AutoConfig

    from gpu_anchor.serve.model_runner import Model, head_dim, init_random, param_specs
    from gpu_anchor.testing.tiny import tiny_config
    cfg = AutoConfig.for_model(**tiny_config("qwen3", vocab_size=384, hidden=128, layers=3, heads=4, kv_heads=2,
                                             intermediate=256, head_dim=32))
    weights = {n: torch.empty(s, dtype=dt, device=device) for n, s, dt in param_specs(cfg, dtype)}
    init_random(weights, cfg, seed=5)
    kv = [torch.zeros(2, num_blocks, bs, cfg.num_key_value_heads, head_dim(cfg), dtype=dtype, device=device)
          for _ in range(cfg.num_hidden_layers)]
    return Model(cfg, weights, kv, device, max_positions=512, deterministic=deterministic), kv


def _step(model, seqs, bs, graphs=None):
    """One forward over ``seqs`` = [(token ids, first position, block table)]; the logits of
    each sequence's last token."""
    from gpu_anchor.serve.attention import step_inputs
    plan = {k: [] for k in ("ids", "pos", "slots", "tseq", "q_starts", "q_lens", "ctx", "tables", "rows")}
    for b, (ids, start, table) in enumerate(seqs):
        plan["q_starts"].append(len(plan["ids"]))
        plan["q_lens"].append(len(ids))
        plan["ctx"].append(start + len(ids))
        plan["tables"].append(table)
        for j, t in enumerate(ids):
            p = start + j
            plan["ids"].append(t)
            plan["pos"].append(p)
            plan["slots"].append(table[p // bs] * bs + p % bs)
            plan["tseq"].append(b)
        plan["rows"].append(len(plan["ids"]) - 1)
    if graphs is not None and all(len(s[0]) == 1 for s in seqs):
        return model.head(graphs.run(plan["ids"], plan["pos"], plan["slots"], plan["tables"]))
    ids, meta, rows = step_inputs(plan, model.device)
    return model.forward(ids, meta, rows)


def prefill_vs_decode(device, dtype, deterministic, graphs=False, bs=16, new=40):
    """Decode ``new`` tokens of a sequence (greedy) next to another sequence, then recompute its
    K/V with one prefill next to a third one, in a fresh cache and other blocks.  Returns
    (K/V bitwise equal, last logits bitwise equal, max |ΔK/V|)."""
    from gpu_anchor.serve.cuda_graphs import DecodeGraphs
    model, kv = _tiny_model(device, dtype, deterministic, bs=bs)
    dg = DecodeGraphs(model, 8, 10, device, capture=device != "cpu") if graphs else None
    prompt, other = [(11 * i + 3) % 380 + 3 for i in range(13)], [(7 * i + 5) % 380 + 3 for i in range(29)]
    ta, tb = [0, 1, 2, 3, 4], [10, 11, 12, 13, 14]
    logits = _step(model, [(prompt, 0, ta), (other, 0, tb)], bs)
    toks, o_toks = list(prompt), list(other)
    for _ in range(new):
        toks.append(int(logits[0].argmax()))
        o_toks.append(int(logits[1].argmax()))
        logits = _step(model, [(toks[-1:], len(toks) - 1, ta), (o_toks[-1:], len(o_toks) - 1, tb)], bs, dg)
    decoded = logits[0].clone()
    n = len(toks)
    slots_a = [ta[p // bs] * bs + p % bs for p in range(n)]
    kv_a = [c.reshape(2, -1, *c.shape[3:])[:, slots_a].clone() for c in kv]
    for c in kv:
        c.zero_()
    tc, third = [20, 21, 22, 23, 24], [(5 * i + 9) % 380 + 3 for i in range(7)]
    td = [40, 30, 31, 45, 50]
    logits = _step(model, [(third, 0, tc), (toks, 0, td)], bs)
    slots_d = [td[p // bs] * bs + p % bs for p in range(n)]
    kv_d = [c.reshape(2, -1, *c.shape[3:])[:, slots_d] for c in kv]
    same_kv = all(torch.equal(a, d) for a, d in zip(kv_a, kv_d))
    diff = max((a.double() - d.double()).abs().max().item() for a, d in zip(kv_a, kv_d))
    return same_kv, torch.equal(logits[1], decoded), diff


def test_model_prefill_kv_equals_decode_kv_on_cpu():
    """float32 on the CPU: without --deterministic the two K/V differ in the last bits (the
    default mode's docs say so); with it they are equal, and so are the logits."""
    same_kv, same_logits, diff = prefill_vs_decode("cpu", torch.float32, deterministic=True, bs=16)
    assert same_kv and same_logits, diff


def test_model_prefill_kv_equals_decode_kv_on_cpu_graph_path():
    """The padded static-buffer decode path (CUDA graphs, run uncaptured on the CPU)."""
    same_kv, same_logits, diff = prefill_vs_decode("cpu", torch.float32, deterministic=True, graphs=True)
    assert same_kv and same_logits, diff


# ------------------------------------------------------------------ options
def _args(**kw):
    from gpu_anchor.serve.cli import add_arguments
    p = argparse.ArgumentParser()
    add_arguments(p)
    a = p.parse_args(["model"] + [x for k, v in kw.items() for x in (f"--{k.replace('_', '-')}", str(v))
                                  if v is not True] + [f"--{k.replace('_', '-')}" for k, v in kw.items() if v is True])
    return a


def test_options_refuse_what_cannot_hold():
    from gpu_anchor.serve import options
    with pytest.raises(options.OptionError, match="tensor-parallel-size 4.*-tp 1 or 2"):
        options.check_deterministic(_args(deterministic=True, tensor_parallel_size=4), "cpu", "float32")
    with pytest.raises(options.OptionError, match="float32, bfloat16 and float16"):
        options.check_deterministic(_args(deterministic=True), "cuda:0", "float64")
    options.check_deterministic(_args(deterministic=True, tensor_parallel_size=2), "cpu", "float64")   # accepted
    assert _args().deterministic is False and _args(deterministic=True).deterministic is True


# ------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernels_batch_invariant_on_gpu(dtype):
    """Qwen3-8B's shapes: q/o (4096 x 4096), k/v (1024 x 4096), down (4096 x 12288), q_norm
    (D = 128), the hidden norm (D = 4096); M from a decode step of 1 to a 2048-token prefill."""
    ns: dict = {}
    exec(KERNELS, ns)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    for K, N, D in ((4096, 4096, 4096), (4096, 1024, 128), (12288, 4096, 4096)):
        err, same = ns["kernel_case"]("cuda", dtype, K, N, D, ms=(1, 3, 32, 64, 200, 2048))
        assert same and err < tol, (K, N, D, err)


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True])
def test_model_prefill_kv_equals_decode_kv_on_gpu(graphs):
    same_kv, same_logits, diff = prefill_vs_decode("cuda", torch.bfloat16, deterministic=True, graphs=graphs)
    assert same_kv and same_logits, diff


@pytest.fixture
def det_gpu_server(tmp_path, socket_dir):
    from test_serve_daemon_loss import _serving
    gen = _serving(tmp_path, socket_dir, "cuda:0")
    srv = next(gen)
    yield srv
    next(gen, None)


def _det_jobs(n=8, tokens=160):
    """Half greedy, half seeded sampling; chat and completions; a quarter with log-probabilities."""
    from test_serve_daemon_loss import _jobs
    jobs = _jobs(n, tokens)
    for i, j in enumerate(jobs):        # _jobs samples i % 4 >= 2; make it every other request
        if i % 2:
            j.update(temperature=0.8, top_p=0.9, seed=90 + i)
        else:
            j.update(temperature=0)
            j.pop("top_p", None)
            j.pop("seed", None)
    return jobs


@pytest.mark.gpu
@pytest.mark.parametrize("fault", ["engine_kills", "daemon_kill"])
def test_deterministic_serve_token_identical_after_kills_on_gpu(det_gpu_server, fault):
    """bf16 with CUDA graphs, --deterministic: a fault-free run, a fault-free repeat, and a run
    with the engine SIGKILLed twice (restart in place) or the daemon SIGKILLed once (the state
    lost: every open request's K/V recomputed by a prefill) — every stream equal."""
    from test_serve_daemon_loss import _client, _progress, _wait
    from test_serve_http import _Stream, scrape
    srv = det_gpu_server
    base = srv.start("--dtype", "bfloat16", "--block-size", "16", "--deterministic", "--max-num-batched-tokens", "64")
    c = _client(base)
    jobs = _det_jobs()
    ref = [s.result() for s in [_Stream(c, j) for j in jobs]]
    again = [s.result() for s in [_Stream(c, j) for j in jobs]]
    assert again == ref
    streams = [_Stream(c, j) for j in jobs]
    if fault == "engine_kills":
        pid = None
        for _ in range(2):
            _progress(streams)
            _wait(lambda: srv.health().get("engine_pid") not in (None, pid), "a new engine")
            pid = srv.health()["engine_pid"]
            os.kill(pid, signal.SIGKILL)
    else:
        _progress(streams)
        dead = srv.daemon_pid()
        os.kill(dead, signal.SIGKILL)
        _wait(lambda: srv.daemon_pid() not in (None, dead), "a fresh daemon")
    got = [s.result() for s in streams]
    for j, r, g in zip(jobs, ref, got):
        assert g == r, (j, g, r)
    m = scrape(base)
    assert m["gpu_anchor_serve_token_mismatch_total"] == 0
    key = "gpu_anchor_serve_engine_restarts_total" if fault == "engine_kills" else \
        "gpu_anchor_serve_state_recoveries_total"
    assert m[key] >= (2 if fault == "engine_kills" else 1), json.dumps(m)[:2000]
