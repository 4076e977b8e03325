"""Prefix caching: blocks shared by digest, never written while shared, and crash-consistent.

The engine's tokens with caching equal transformers' ``generate`` and the engine's without it
(float64, CPU); requests that share a system prompt or an earlier turn compute it once; a
SIGKILL campaign at every phase over requests sharing prefixes ends where the fault-free run
does; the block manager's states stay exact under random schedules with histories taken back.
"""
from __future__ import annotations

import random

import pytest
import torch

from gpu_anchor.serve import prefix_cache
from gpu_anchor.serve.block_manager import BlockManager, InconsistentState
from gpu_anchor.serve.engine import Engine, EngineConfig
from gpu_anchor.serve.scheduler import Scheduler
from gpu_anchor.serve.sequence import SamplingParams, Sequence, Status
from gpu_anchor.testing.tiny import make_tiny_model
from test_serve_engine import Client, _run, kill_waves

SYSTEM = [(7 * i) % 370 + 5 for i in range(37)]       # a "system prompt" of 37 tokens


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("m") / "qwen3"), "qwen3", seed=3)


def _seq(rid, prompt, **kw):
    return Sequence(rid, list(prompt), SamplingParams(max_tokens=4, ignore_eos=True, **kw))


def _prefill(sched, seq):
    """Admit ``seq`` and run its prefill to the first token."""
    sched.add(seq)
    while not seq.output_ids:
        work = sched.schedule()
        sched.finish_step(work, {w.seq.rid: 1 for w in work if w.sample})
        sched.blocks.on_commit()


# ---------------------------------------------------------------- the block manager
def test_a_shared_prefix_is_taken_by_digest_and_kept_while_any_owner_lives():
    bm = BlockManager(16, 4, prefix_caching=True)
    s = Scheduler(bm, max_batched_tokens=64)
    a = _seq("a", SYSTEM[:13] + [1, 2])
    _prefill(s, a)
    assert len(a.digests) >= 3 and bm.lookup(a.digests[:3]) == a.block_table[:3]
    b = _seq("b", SYSTEM[:13] + [9, 9, 9])
    s.add(b)
    s.schedule()
    assert b.block_table[:3] == a.block_table[:3] and b.num_computed == 12 and b.cached_tokens == 12
    shared = a.block_table[:3]
    assert all(bm.refs[x] == 2 for x in shared)
    s.abort("a")
    bm.on_commit()
    assert all(bm.refs[x] == 1 for x in shared)
    s.abort("b")
    bm.on_commit()
    bm.check()
    # free, digests kept: a third request finds them; plain free blocks are handed out first
    c = _seq("c", SYSTEM[:12] + [4])
    s.add(c)
    s.schedule()
    assert c.num_computed == 12 and c.block_table[:3] == shared
    bm.check()


def test_a_prompt_cached_whole_still_computes_its_last_block_and_prompt_logprobs_take_nothing():
    bm = BlockManager(16, 4, prefix_caching=True)
    s = Scheduler(bm, max_batched_tokens=64)
    _prefill(s, _seq("a", SYSTEM[:12]))
    b = _seq("b", SYSTEM[:12])
    s.add(b)
    work = s.schedule()
    assert b.num_computed == 8 and [(w.start, w.n) for w in work if w.seq is b] == [(8, 4)]
    c = _seq("c", SYSTEM[:12], prompt_logprobs=1)
    s.add(c)
    s.schedule()
    assert c.cached_tokens == 0 and not set(c.block_table) & set(b.block_table)


def test_adapters_and_the_base_model_never_share_blocks():
    bm = BlockManager(32, 4, prefix_caching=True)
    s = Scheduler(bm, max_batched_tokens=64)
    _prefill(s, _seq("base", SYSTEM[:13]))
    x = _seq("x", SYSTEM[:13], lora="sql")
    s.add(x)
    s.schedule()
    assert x.num_computed == 0 and x.cached_tokens == 0
    s.abort("x")
    x = _seq("x", SYSTEM[:13], lora="sql")
    _prefill(s, x)
    y = _seq("y", SYSTEM[:13], lora="sql")
    s.add(y)
    s.schedule()
    assert y.num_computed == 12 and y.block_table[:3] == x.block_table[:3]
    assert prefix_cache.digests(y, 3, 4) != prefix_cache.digests(_seq("z", SYSTEM[:13]), 3, 4)


def test_cached_blocks_are_reused_least_recently_released_first_and_lose_their_digest():
    bm = BlockManager(6, 4, prefix_caching=True)
    s = Scheduler(bm, max_batched_tokens=64)
    a = _seq("a", SYSTEM[:9])
    _prefill(s, a)
    s.abort("a")
    bm.on_commit()
    held = list(bm._cached)
    assert held and bm.num_free == 6
    b = _seq("b", [3] * 21)                   # needs 6 blocks: every cached one is reused
    _prefill(s, b)
    assert not bm._cached and all(x not in bm._digest or x in b.block_table for x in held)
    assert bm.lookup(a.digests) == []
    bm.check()


def test_a_history_taken_back_never_writes_a_shared_block():
    bm = BlockManager(16, 4, prefix_caching=True)
    s = Scheduler(bm, max_batched_tokens=64)
    a, b = _seq("a", SYSTEM[:13]), _seq("b", SYSTEM[:13] + [5])
    _prefill(s, a)
    _prefill(s, b)
    shared = b.block_table[:3]
    assert shared == a.block_table[:3]
    start = prefix_cache.forget_from(bm, b, 6)          # b recomputes from position 6: inside block 1
    assert start == 4 and b.block_table == shared[:1] and b.digests == a.digests[:1]
    assert all(bm.refs[x] == 2 - (i > 0) for i, x in enumerate(shared))
    # alone in a block: it keeps the block and the block loses its digest
    start = prefix_cache.forget_from(bm, a, 9)
    assert start == 9 and a.block_table[2] == shared[2] and bm._digest.get(shared[2]) is None
    bm.check()


def test_adopt_accepts_sharing_only_below_each_tables_computed_blocks():
    bm = BlockManager(8, 4, prefix_caching=True)
    bm.adopt({"a": [0, 1, 2], "b": [0, 1, 3]}, shared_below={"a": 2, "b": 2})
    assert bm.refs == {0: 2, 1: 2, 2: 1, 3: 1} and bm.num_free == 4
    with pytest.raises(InconsistentState, match="owned by both"):
        bm.adopt({"a": [0, 1, 2], "b": [0, 1, 2]}, shared_below={"a": 2, "b": 3})
    with pytest.raises(InconsistentState, match="owned by both"):
        BlockManager(8, 4).adopt({"a": [0], "b": [0]}, shared_below={"a": 1, "b": 1})   # caching off


def test_random_schedules_with_shared_prefixes_keep_the_block_states_exact():
    rng = random.Random(3)
    bm = BlockManager(40, 4, prefix_caching=True)
    s = Scheduler(bm, max_batched_tokens=24, max_num_seqs=6)
    heads = [SYSTEM[:rng.randint(0, 30)] for _ in range(4)]
    n = 0
    for step in range(400):
        if rng.random() < 0.3:
            s.add(_seq(f"r{n}", rng.choice(heads) + [rng.randrange(3, 300) for _ in range(rng.randint(1, 9))],
                       **({"lora": "x"} if rng.random() < 0.2 else {})))
            n += 1
        live = [q for q in s.seqs.values() if q.status is Status.RUNNING and q.output_ids]
        if live and rng.random() < 0.1:                       # a history taken back
            q = rng.choice(live)
            q.num_computed = prefix_cache.forget_from(bm, q, rng.randint(0, q.num_computed))
        work = s.schedule()
        s.finish_step(work, {w.seq.rid: rng.randrange(3, 300) for w in work if w.sample})
        for q in list(s.seqs.values()):
            if rng.random() < 0.02:
                s.abort(q.rid)
        if rng.random() < 0.7:
            bm.on_commit()
        bm.check()
        # what a digest names is what the tokens say: every owned, named block of a live
        # sequence lies below what it computed and carries that sequence's digest
        for q in s.seqs.values():
            for i, x in enumerate(q.block_table):
                if x in bm._digest:
                    assert i < q.num_computed // 4 and bm._digest[x] == prefix_cache.digests(q, i + 1, 4)[i]
    assert s.prefix_hits > 0


# ---------------------------------------------------------------- the engine
def _cfg(model, **kw):
    return EngineConfig(model=model, anchor=False, dtype="float64", block_size=4, num_blocks=120,
                        max_batched_tokens=16, **kw)


def _conversations(n=6, seed=0):
    rng = random.Random(seed)
    return [SYSTEM + [rng.randrange(3, 380) for _ in range(rng.randint(1, 12))] for _ in range(n)]


def test_greedy_tokens_with_prefix_caching_equal_hf_generate_and_compute_the_prefix_once(model):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float64)
    prompts = _conversations()
    ref = [hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                       pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    eng = Engine(_cfg(model, prefix_caching=True))
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    first = eng.generate(prompts[:1], sp)                   # the system prompt computed once
    rest = eng.generate(prompts[1:], sp)
    assert first + rest == ref
    assert eng.scheduler.prefix_hits == 5 * (len(SYSTEM) // 4 * 4)
    # the next turn of a finished conversation finds its whole history, its answer included
    turn2 = prompts[0] + ref[0] + [11, 12, 13]
    hits = eng.scheduler.prefix_hits
    again = eng.generate([turn2], sp)[0]
    # computed: the first prompt and every answer token but the last (sampled, never fed back)
    assert eng.scheduler.prefix_hits - hits == min((len(turn2) - 1) // 4, (len(prompts[0]) + 11) // 4) * 4
    plain = Engine(_cfg(model)).generate([turn2], sp)[0]
    assert again == plain


def test_sigkill_campaign_with_shared_prefixes_matches_fault_free(model, host_daemon):
    sock = host_daemon[0]
    base = _cfg(model, prefix_caching=True, max_num_seqs=8, socket=sock, namespace="pc-campaign",
                cpu_threads=1)
    base = EngineConfig(**dict(base.__dict__, anchor=True, num_blocks=60))
    reqs = {}
    for i, p in enumerate(_conversations(8, seed=4)):
        sp = (SamplingParams(max_tokens=20, ignore_eos=True) if i % 2 else
              SamplingParams(max_tokens=20, temperature=0.8, top_p=0.95, seed=50 + i, ignore_eos=True))
        reqs[f"r{i}"] = (p, sp)
    probe = Engine(EngineConfig(**dict(base.__dict__, anchor=False)))     # the campaign's schedule shares blocks
    probe.generate([p for p, _ in reqs.values()], [sp for _, sp in reqs.values()])
    assert probe.scheduler.prefix_hits >= 4 * 36
    ref = Client(reqs)
    code, _ = _run(EngineConfig(**dict(base.__dict__, namespace="pc-reference")), ref)
    assert code == 0 and len(ref.done) == len(reqs)
    kill_waves(base, reqs, ref, random.Random(7), 20, last_step=4)


@pytest.mark.gpu
def test_on_cuda_shared_prefixes_give_the_tokens_of_an_engine_without_caching(model, cuda_daemon):
    """On CUDA in bf16 with --deterministic's batch-invariant kernels (so a token does not depend
    on the batch or the chunk its KV was computed in), CUDA graphs, asynchronous scheduling,
    anchored: requests sharing a system prompt and a conversation's next turn get exactly the
    tokens of an engine without prefix caching, having computed the shared blocks once."""
    system = [(11 * i) % 370 + 5 for i in range(100)]
    prompts = [system + list(range(30 + i, 36 + 2 * i)) for i in range(6)]
    kw = dict(model=model, device="cuda:0", dtype="bfloat16", deterministic=True, block_size=16,
              num_blocks=256, max_batched_tokens=64)
    on = Engine(EngineConfig(**kw, namespace="pc-gpu", socket=cuda_daemon[0], prefix_caching=True))
    off = Engine(EngineConfig(**kw, anchor=False, prefix_caching=False))
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    got = on.generate(prompts[:1], sp) + on.generate(prompts[1:], sp)
    assert got == off.generate(prompts, sp)
    assert on.scheduler.prefix_hits == 5 * 96
    turn2 = prompts[0] + got[0] + [7, 8, 9]
    assert on.generate([turn2], sp) == off.generate([turn2], sp)
    assert on.scheduler.prefix_hits > 5 * 96


# ---------------------------------------------------------------- through the server
def test_the_server_reports_cached_prompt_tokens_and_a_stream_survives_an_engine_kill(model, tmp_path, host_daemon):
    """``gpu-anchor serve`` (prefix caching on by default, as in vLLM) through the ``openai``
    client: a conversation's second turn finds its first turn computed
    (``usage.prompt_tokens_details.cached_tokens``, ``vllm:prefix_cache_hits``) and answers what
    the engine answers without caching, also when its stream's engine is SIGKILLed mid-way;
    ``--no-enable-prefix-caching`` reports none cached."""
    import openai

    from tests.test_serve_api import start_server
    from tests.test_serve_http import scrape, stop_server, stream_across_engine_kill
    plain = Engine(EngineConfig(model=model, anchor=False, dtype="float64", block_size=4, num_blocks=200))
    sp = SamplingParams(max_tokens=16, ignore_eos=True)
    turn1 = SYSTEM + [201, 202, 203]

    def serve(*extra):
        proc, url, _ = start_server(str(tmp_path), model, "--socket", host_daemon[0], "--served-model-name", "tiny",
                                    *extra)
        return proc, url

    def ask(c, prompt, **kw):
        return c.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0,
                                    extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
                                    logprobs=0, **kw)

    def ids(choices_logprobs_tokens):
        return [int(t.split(":")[1]) for t in choices_logprobs_tokens]

    proc, url = serve("--namespace", "pc-on")       # prefix caching on: the default
    try:
        c = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0)
        first = ask(c, turn1)
        answer = ids(first.choices[0].logprobs.tokens)
        assert answer == plain.generate([turn1], sp)[0]
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        turn2 = turn1 + answer + [211, 212]
        second = ask(c, turn2)
        # every block of turn 1 and its answer that was computed: all but the last answer token
        assert second.usage.prompt_tokens_details.cached_tokens == (len(turn1) + 15) // 4 * 4
        want = plain.generate([turn2], sp)[0]
        assert ids(second.choices[0].logprobs.tokens) == want
        turn3 = turn2 + want + [221]
        items = stream_across_engine_kill(url, lambda: ask(c, turn3, stream=True))
        got = [t for x in items for t in (ids(x.choices[0].logprobs.tokens) if x.choices else [])]
        assert got == plain.generate([turn3], sp)[0]
        m = scrape(url)
        assert m["vllm:prefix_cache_hits_total"] >= second.usage.prompt_tokens_details.cached_tokens
        assert m["vllm:prefix_cache_queries_total"] >= len(turn1) + len(turn2)
    finally:
        stop_server(proc)
    proc, url = serve("--namespace", "pc-off", "--no-enable-prefix-caching")
    try:
        c = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0)
        ask(c, turn1)
        again = ask(c, turn2)
        assert again.usage.prompt_tokens_details.cached_tokens == 0 and ids(again.choices[0].logprobs.tokens) == want
    finally:
        stop_server(proc)
