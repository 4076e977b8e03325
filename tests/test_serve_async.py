"""Asynchronous scheduling (``EngineConfig(async_scheduling=True)``, ``serve/async_step.py``) on the CPU.

The same requests through an async and a sync engine give the same tokens — greedy and
seeded sampling, requests stopping on stop tokens and max_tokens mid-batch, new arrivals,
aborts, preemption — while most decode steps run ahead.  The token a sequence gets computed at
the step after its last one is never published, journaled or counted, and every published
token's commit has landed.  Engines SIGKILLed at every transition of an async step (with a
step launched ahead in flight) resume, and every stream equals a fault-free synchronous run.
The GPU twin (CUDA graphs captured, pinned copies, events) is ``test_async_equals_sync_on_cuda``.
"""
from __future__ import annotations

import random

import pytest
import torch

from gpu_anchor.serve import commit as C
from gpu_anchor.serve.engine import Engine, EngineConfig
from gpu_anchor.serve.sequence import SamplingParams
from gpu_anchor.testing.tiny import make_tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("async-models") / "qwen3"), "qwen3", seed=3)


def _engine(model, async_scheduling, **kw):
    base = dict(model=model, dtype="float32", block_size=4, num_blocks=256, max_num_seqs=12, max_batched_tokens=64,
                anchor=False)
    return Engine(EngineConfig(**dict(base, **kw, async_scheduling=async_scheduling)))


def drive(eng, reqs, joins=None, aborts=None, check=None):
    """Step ``eng`` to the end as the frontend would: request ``rid`` of ``reqs`` (rid -> (prompt,
    params)) is added before call ``joins[rid]`` (default 0), aborted before call ``aborts[rid]``.
    Every event must continue its stream at the next index and come before its finish;
    ``check(eng, events)`` runs after each call.  Returns (outputs, finish reasons)."""
    joins, aborts = joins or {}, aborts or {}
    out, fin, calls = {}, {}, 0
    while True:
        for rid, (prompt, sp) in reqs.items():
            if joins.get(rid, 0) == calls:
                out[rid] = []
                assert not eng.add_request(rid, prompt, SamplingParams(**sp.to_dict()))
        for rid, at in aborts.items():
            if at == calls and rid not in fin:
                eng.abort(rid)
                fin[rid] = "abort"
        if not eng.has_work() and calls >= max(joins.values(), default=0):
            break
        events = eng.step()
        calls += 1
        for rid, i, ids, reason in events + (eng.flush() if not eng.has_work() else []):
            assert rid not in fin, f"{rid}: tokens after its finish ({fin.get(rid)})"
            assert i == len(out[rid]), (rid, i, len(out[rid]))
            out[rid] += ids
            if reason:
                fin[rid] = reason
        if check is not None:
            check(eng, events)
    assert set(fin) == set(reqs)
    return out, fin


def _prompts(n, seed):
    rng = random.Random(seed)
    return [[rng.randrange(3, 380) for _ in range(rng.randint(3, 30))] for _ in range(n)]


def _with_stops(model, prompts, params, which, **kw):
    """``params`` where request ``b`` of ``which`` stops on a token that a free run of it first
    produces mid-way: those requests finish on a stop token, mid-batch."""
    free = _engine(model, False, **kw).generate(prompts, [SamplingParams(**dict(p.to_dict(), max_tokens=40,
                                                                          ignore_eos=True)) for p in params])
    out = list(params)
    for b in which:
        k = next(k for k in range(4, 40) if free[b][k] not in free[b][:k])
        out[b] = SamplingParams(**dict(params[b].to_dict(), max_tokens=40, stop_token_ids=(free[b][k],)))
    return out


def _scenario(model, n=10, seed=1, **kw):
    prompts = _prompts(n, seed)
    params = [SamplingParams(max_tokens=6 + 3 * b, ignore_eos=True, temperature=0.0 if b % 3 else 0.8, seed=100 + b)
              for b in range(n)]
    params = _with_stops(model, prompts, params, which=(1, 4, 6), **kw)
    reqs = {f"r{b}": (p, sp) for b, (p, sp) in enumerate(zip(prompts, params))}
    joins = {"r6": 5, "r7": 9, "r8": 14, "r9": 20}           # arrivals while others decode
    return reqs, joins


@pytest.mark.parametrize("mode", ["eager", "graphs", "graphs-deterministic"])
def test_async_equals_sync(model, mode):
    kw = {"cuda_graphs": mode != "eager", "deterministic": mode.endswith("deterministic")}
    reqs, joins = _scenario(model)
    aborts = {"r2": 12}
    res, engines = {}, {}
    for a in (False, True):
        engines[a] = eng = _engine(model, a, **kw)
        res[a] = drive(eng, reqs, joins, aborts)
    (sync_out, sync_fin), (out, fin) = res[False], res[True]
    assert {r: f for r, f in fin.items() if r != "r2"} == {r: f for r, f in sync_fin.items() if r != "r2"}
    assert {f for r, f in fin.items()} >= {"stop", "length", "abort"}
    assert {r: o for r, o in out.items() if r != "r2"} == {r: o for r, o in sync_out.items() if r != "r2"}
    full = _engine(model, False, **kw).generate([reqs["r2"][0]], [reqs["r2"][1]])[0]
    assert out["r2"] == full[:len(out["r2"])]        # aborted: what it got is its stream's start
    e = engines[True]
    assert e.step_counts["async"] > 2 * e.step_counts["sync"], e.step_counts   # mostly ahead
    assert e.step_counts["discarded"] >= 2, e.step_counts   # the stops' extra rows were computed, and dropped
    # counted: the tokens published, and the aborted request's one generated but unpublished at
    # its abort at most — never the dropped rows
    assert 0 <= e.tokens_generated - sum(map(len, out.values())) <= 1
    assert engines[False].step_counts["async"] == 0


def test_penalized_requests_run_ahead_and_equal_sync(model):
    """A penalty's logits depend on the previous step's token, which a step launched ahead has
    only on the device: it is counted from there.  Penalized requests (greedy and sampled) run
    ahead, and their tokens are the synchronous engine's; the penalties change them."""
    reqs, joins = _scenario(model)
    for rid, pen in (("r3", {"frequency_penalty": 0.8, "repetition_penalty": 1.2}), ("r5", {"presence_penalty": 1.5})):
        p, sp = reqs[rid]
        reqs[rid] = (p, SamplingParams(**dict(sp.to_dict(), **pen)))
    res = {a: drive(_engine(model, a), reqs, joins) for a in (False, True)}
    assert res[True] == res[False]
    eng = _engine(model, True)
    alone = {rid: reqs[rid] for rid in ("r3", "r5")}
    out, _ = drive(eng, alone)
    assert eng.step_counts["async"] > 2 * eng.step_counts["sync"], eng.step_counts
    assert out == {rid: res[False][0][rid] for rid in alone}
    plain = drive(_engine(model, True), {rid: (p, SamplingParams(**{k: v for k, v in sp.to_dict().items()
                                                                     if not k.endswith("_penalty")}))
                                         for rid, (p, sp) in alone.items()})[0]
    assert all(plain[rid] != out[rid] for rid in alone)


def test_async_equals_sync_with_preemption(model):
    """A cache too small for every stream: decodes preempt (synchronously); deterministic
    kernels, so a preempted request's recomputed KV equals what its decodes wrote."""
    prompts = _prompts(8, seed=4)
    params = [SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0 if b % 2 else 0.7, seed=b)
              for b in range(8)]
    reqs = {f"p{b}": (p, sp) for b, (p, sp) in enumerate(zip(prompts, params))}
    res = {}
    for a in (False, True):
        eng = _engine(model, a, num_blocks=40, cuda_graphs=True, deterministic=True)
        res[a] = drive(eng, reqs)
        assert eng.scheduler.preemptions > 0
        eng.blocks.on_commit()
        eng.blocks.check()
    assert res[True] == res[False]
    # a preempted request waits for blocks, and while one waits every step is synchronous
    assert eng.step_counts["async"] >= 10, eng.step_counts


def test_extra_token_never_journaled_and_tokens_published_after_their_commit(model, host_daemon):
    """Anchored async engine: after every step, each committed request's outputs are a prefix of
    its final stream (the token computed after a stop never reaches the journal) and every token
    published has its commit landed (its request committed with it, or deleted as finished)."""
    reqs, joins = _scenario(model, seed=2)
    final = drive(_engine(model, False), reqs, joins)[0]
    seen: dict[str, int] = {}

    def check(eng, events):
        committed = {s.rid: s.output_ids for s in C.read_sequences(eng.committer.journal)[0]}
        for rid, o in committed.items():
            assert o == final[rid][:len(o)], rid
        ended = {rid for rid, _, _, reason in events if reason}
        for rid, i, ids, reason in events:
            seen[rid] = i + len(ids)
            if rid in ended:          # its last commit deleted its records
                assert rid not in committed, rid
            else:
                assert len(committed.get(rid, ())) >= seen[rid], (rid, seen[rid], committed.get(rid))

    threads = torch.get_num_threads()
    try:       # one thread: the daemon (the journal's other end) runs on the other core
        eng = _engine(model, True, anchor=True, socket=host_daemon[0], namespace="async-journal", cuda_graphs=True,
                      cpu_threads=1)
        out, _ = drive(eng, reqs, joins, check=check)
    finally:
        torch.set_num_threads(threads)
    assert out == final
    assert eng.step_counts["discarded"] >= 2 and eng.step_counts["async"] > eng.step_counts["sync"]
    assert not C.read_sequences(eng.committer.journal)[0]     # every finished request's records are gone


def test_sigkill_at_async_transitions_matches_sync_fault_free(model, host_daemon):
    """Kill engines at each transition of an async step, with a step launched ahead in flight:
    before it (between_steps), while launching it (mid_decode), once launched with the previous
    step's tokens unread (after_launch), after the read (before_commit), after the previous
    commit landed (after_commit).  Every stream must equal a fault-free synchronous run."""
    from test_serve_engine import Client, _run
    prompts = _prompts(6, seed=7)
    params = [SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.0 if b % 2 else 0.8, seed=50 + b)
              for b in range(6)]
    params = _with_stops(model, prompts, params, which=(0, 3))
    reqs = {f"k{b}": (p, sp) for b, (p, sp) in enumerate(zip(prompts, params))}
    base = EngineConfig(model=model, dtype="float32", block_size=4, num_blocks=200, max_batched_tokens=256,
                        max_num_seqs=8, socket=host_daemon[0], namespace="async-kills", cpu_threads=1,
                        cuda_graphs=True, graph_after_steps=0, deterministic=True)
    ref = Client(reqs)
    assert _run(EngineConfig(**dict(base.__dict__, namespace="async-kills-ref")), ref)[0] == 0
    client = Client(reqs)
    cfg = EngineConfig(**dict(base.__dict__, async_scheduling=True))
    faults = [(3, "after_launch"), (2, "mid_decode"), (4, "before_commit"), (2, "after_launch"),
              (3, "after_commit"), (2, "between_steps"), (5, "after_launch")]
    for fault in faults:
        assert _run(cfg, client, fault)[0] == -9, fault
    while len(client.done) < len(reqs):
        assert _run(cfg, client)[0] == 0
    assert client.mismatch == 0 and client.out == ref.out
    assert {ref.done[r] for r in reqs} == {"stop", "length"}


def test_readd_rewinds_a_request_with_a_step_launched_ahead(model):
    """``readd`` (a replayed token without its log-probabilities) rewinds a running request in
    place while its next step is on the device: that row continues the old history and is
    dropped; the request decodes again from what the client has, the journal follows, and the
    stream ends as a fault-free one (deterministic kernels: the token decoded again runs in
    another batch than it first did, which in plain float32 may round a near-tie the other way)."""
    from test_serve_bookkeeping import LocalJournal
    prompts = _prompts(2, seed=9)
    sp = SamplingParams(max_tokens=40, ignore_eos=True)
    ref = _engine(model, False, deterministic=True).generate(prompts, sp)
    eng = _engine(model, True, cuda_graphs=True, deterministic=True)
    eng.committer.journal = journal = LocalJournal()
    got = {"r0": [], "r1": []}

    def publish(events):
        for rid, i, ids, _ in events:
            got[rid][i:] = ids
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(**sp.to_dict()))
    while len(got["r0"]) < 20:
        publish(eng.step())
    seq = eng.scheduler.seqs["r0"]
    assert any(w.seq is seq for w in eng.run_ahead.pending.work)     # r0's next token is on the device
    dropped = eng.step_counts["discarded"]
    assert eng.readd("r0", prompts[0], SamplingParams(**sp.to_dict()), got["r0"]) == []
    assert seq.output_ids == got["r0"] and seq.num_computed == len(prompts[0]) + len(got["r0"]) - 1
    publish(eng.step())
    assert eng.step_counts["discarded"] == dropped + 1
    publish(eng.flush())
    held = {s.rid: s.output_ids for s in C.read_sequences(journal)[0]}
    assert held == {rid: got[rid] for rid in held} and set(held) == {"r0", "r1"}
    while eng.has_work():
        publish(eng.step())
    publish(eng.flush())
    assert got == {"r0": ref[0], "r1": ref[1]}
    assert eng.step_counts["async"] > eng.step_counts["sync"]


def test_async_scheduling_option(model):
    """``--async-scheduling`` / ``--no-async-scheduling`` reach the engine's configuration; without
    either, ``EngineConfig``'s default holds (one line to flip)."""
    import argparse

    from gpu_anchor.serve.cli import add_arguments, engine_config
    from gpu_anchor.serve.model_runner import load_config
    p = argparse.ArgumentParser()
    add_arguments(p)
    got = {tuple(flag): engine_config(p.parse_args([model, "--device", "cpu", "--num-blocks", "64"] + flag), load_config(model))
           .async_scheduling for flag in ([], ["--async-scheduling"], ["--no-async-scheduling"])}
    assert list(got.values()) == [EngineConfig.async_scheduling, True, False]


@pytest.mark.gpu
def test_async_equals_sync_on_cuda(tmp_path):
    """On the GPU with CUDA graphs captured: the next step's ids copied on the device, the
    sampled ids read through pinned memory and an event; float32, greedy and seeded."""
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    m = make_tiny_model(str(tmp_path / "qwen3"), "qwen3", seed=3, hidden=128, heads=4, kv_heads=2, head_dim=32)
    kw = dict(device="cuda:0", block_size=16, num_blocks=128, max_num_seqs=16)
    reqs, joins = _scenario(m, **kw)
    res, engines = {}, {}
    for a in (False, True):
        engines[a] = eng = _engine(m, a, **kw)
        eng.capture_graphs()
        res[a] = drive(eng, reqs, joins, {"r2": 12})
    assert {r: o for r, o in res[True][0].items() if r != "r2"} == \
        {r: o for r, o in res[False][0].items() if r != "r2"}
    e = engines[True]
    assert e.step_counts["graph"] > 20 and e.step_counts["async"] > 2 * e.step_counts["sync"], e.step_counts
    assert e.step_counts["discarded"] >= 1
    default = _engine(m, None, **kw)            # not given: on for CUDA (off on the CPU)
    assert default.run_ahead is not None


def test_async_is_off_by_default_on_the_cpu(model):
    assert _engine(model, None).run_ahead is None and _engine(model, True).run_ahead is not None


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_dropped_engine_is_freed_at_once(model, async_scheduling):
    """The last reference to an engine dropped frees it (and so its device memory) at once, not
    when Python's cycle collector next runs: the run-ahead state refers back to its engine by a
    weak proxy.  Before, a pre-warm's scratch engine left 1.70 GB allocated on the H200."""
    import gc
    import weakref
    eng = _engine(model, async_scheduling)
    eng.generate(_prompts(4, 3), [SamplingParams(max_tokens=6, ignore_eos=True) for _ in range(4)])
    assert eng.step_counts["async"] > 0 if async_scheduling else eng.run_ahead is None
    ref = weakref.ref(eng)
    gc.disable()
    try:
        del eng
        assert ref() is None
    finally:
        gc.enable()
