"""Torch-free bookkeeping of the serving engine: block manager, scheduler, commit records."""
from __future__ import annotations

import random

import pytest

from gpu_anchor.daemon.journal import Journal
from gpu_anchor.serve import commit as C
from gpu_anchor.serve.block_manager import BlockManager, InconsistentState, OutOfBlocks
from gpu_anchor.serve.scheduler import Scheduler
from gpu_anchor.serve.sequence import OUT_SEGMENT, SamplingParams, Sequence, Status


class LocalJournal:
    """The daemon's own Journal class behind the client's method names (no socket)."""

    def __init__(self):
        self.j = Journal()

    def get(self, key, default=None):
        return self.j.get([key]).get(key, default)

    def get_many(self, keys=None, prefix=None):
        return self.j.get(keys, prefix)

    def commit(self, puts=None, deletes=(), expect_version=None):
        return self.j.commit(puts or {}, deletes, expect_version)


def seq(rid, n, max_tokens=4, arrival=0, **kw):
    return Sequence(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens, **kw), arrival=arrival)


def test_block_manager_defers_reuse_until_commit():
    bm = BlockManager(4, 2)
    a, b = [], []
    bm.grow("a", a, 3)
    assert a == [0, 1] and bm.num_free == 2
    bm.release(a)
    assert bm.num_free == 2          # released blocks still hold committed KV
    with pytest.raises(OutOfBlocks):
        bm.grow("b", b, 6)
    bm.on_commit()
    bm.grow("b", b, 8)
    assert sorted(b) == [0, 1, 2, 3]
    bm.check()


def test_block_manager_adopt_rejects_bad_tables():
    bm = BlockManager(4, 2)
    with pytest.raises(InconsistentState):
        bm.adopt({"a": [0, 1], "b": [1]})
    with pytest.raises(InconsistentState):
        bm.adopt({"a": [7]})
    bm.adopt({"a": [3], "b": [0]})
    assert bm.num_free == 2
    bm.check()


def test_scheduler_chunked_prefill_then_decode():
    bm = BlockManager(64, 4)
    s = Scheduler(bm, max_num_seqs=8, max_batched_tokens=8)
    s.add(seq("a", 10, arrival=0))
    s.add(seq("b", 3, arrival=1))
    w = s.schedule()
    assert [(x.seq.rid, x.start, x.n, x.sample) for x in w] == [("a", 0, 8, False)]
    s.finish_step(w, {})
    w = s.schedule()
    assert [(x.seq.rid, x.start, x.n, x.sample) for x in w] == [("a", 8, 2, True), ("b", 0, 3, True)]
    grown, fin = s.finish_step(w, {"a": 5, "b": 6})
    assert [g.rid for g in grown] == ["a", "b"] and not fin
    w = s.schedule()
    assert [(x.seq.rid, x.start, x.n) for x in w] == [("a", 10, 1), ("b", 3, 1)]


def test_a_recovery_first_step_only_decodes():
    """``decodes_only`` (a recovery's first step, so that it runs as a decode graph): no prefill
    chunk and no admission when a decode is scheduled; without decodes, prefill as usual."""
    bm = BlockManager(32, 4)
    s = Scheduler(bm, max_batched_tokens=64)
    a, b = seq("a", 5, max_tokens=10), seq("b", 6, max_tokens=10, arrival=1)
    s.add(a)
    s.finish_step(s.schedule(), {"a": 7})            # a's prompt, then it decodes
    s.add(b)
    assert [(w.seq.rid, w.n) for w in s.schedule(decodes_only=True)] == [("a", 1)]
    assert b.status is Status.WAITING
    bm.on_commit()
    s2 = Scheduler(BlockManager(32, 4), max_batched_tokens=64)
    s2.add(seq("c", 6))
    assert [(w.seq.rid, w.n) for w in s2.schedule(decodes_only=True)] == [("c", 6)]


def _admissions(s):
    """Run ``s`` to the end (every sampled token 7): the requests each step admitted."""
    admitted = []
    while s.has_work():
        w = s.schedule()
        admitted.append(sorted(x.seq.rid for x in w if x.start == 0))
        assert len(s.running_adapters()) <= s.lora_capacity
        s.finish_step(w, {x.seq.rid: 7 for x in w if x.sample})
        s.blocks.on_commit()
    return [a for a in admitted if a]


def test_a_request_whose_adapter_needs_a_slot_held_by_running_ones_lets_others_pass():
    """``lora_capacity`` 1: a request on another adapter than the running ones' waits; younger
    requests on the base model or on the running adapter pass it (as vLLM's scheduler lets them:
    first come, first served made them wait too, and ran mixed adapters one request at a time);
    it is admitted once no running request uses the first adapter.  With two slots both
    adapters run together."""
    def run(capacity):
        s = Scheduler(BlockManager(64, 4), max_batched_tokens=64)
        s.lora_capacity = capacity
        for i, (rid, lora) in enumerate((("a1", "a"), ("b1", "b"), ("n", None), ("a2", "a"), ("b2", "b"))):
            s.add(seq(rid, 3, max_tokens=2, arrival=i, lora=lora))
        return _admissions(s)
    assert run(1) == [["a1", "a2", "n"], ["b1", "b2"]]
    assert run(2) == [["a1", "a2", "b1", "b2", "n"]]


def test_only_the_next_max_num_seqs_arrivals_pass_a_held_request():
    """A steady stream on the running adapter does not hold a request on another one for ever:
    of the requests that arrived after it, only the next ``max_num_seqs`` may pass it; then the
    running adapter drains and it takes the slot (vLLM lets every one pass)."""
    s = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_batched_tokens=64)
    s.lora_capacity = 1
    s.add(seq("a0", 3, max_tokens=6, arrival=0, lora="a"))     # the running adapter's longest
    s.add(seq("b", 3, max_tokens=2, arrival=1, lora="b"))
    for i in range(1, 6):
        s.add(seq(f"a{i}", 3, max_tokens=2, arrival=1 + i, lora="a"))
    # a1 and a2 (arrivals 2 and 3) pass b, each as a seat frees; a3 (4) may not, though a0 still
    # runs on adapter a: b runs before it
    assert _admissions(s) == [["a0", "a1"], ["a2"], ["b"], ["a3", "a4"], ["a5"]]


def test_scheduler_stops_on_eos_and_length():
    bm = BlockManager(16, 4)
    s = Scheduler(bm, eos_token_ids=[99])
    s.add(seq("a", 2, max_tokens=2))
    s.add(seq("b", 2, max_tokens=5, arrival=1))
    w = s.schedule()
    _, fin = s.finish_step(w, {"a": 7, "b": 99})
    assert [(f.rid, f.finish_reason) for f in fin] == [("b", "stop")]
    w = s.schedule()
    _, fin = s.finish_step(w, {"a": 7})
    assert [(f.rid, f.finish_reason) for f in fin] == [("a", "length")]
    assert not s.has_work()


def test_scheduler_preempts_youngest_when_blocks_run_out():
    bm = BlockManager(4, 2)
    s = Scheduler(bm, max_batched_tokens=64)
    s.add(seq("old", 3, max_tokens=8, arrival=0))
    s.add(seq("young", 3, max_tokens=8, arrival=1))
    w = s.schedule()
    s.finish_step(w, {"old": 1, "young": 1})
    bm.on_commit()
    w = s.schedule()          # both need a 3rd block at position 4? no: positions 3 fit in block 2
    s.finish_step(w, {x.seq.rid: 1 for x in w})
    bm.on_commit()
    w = s.schedule()
    assert s.preemptions >= 1 and s.seqs["young"].status is Status.WAITING
    assert w == []                     # the victim's blocks come free at the commit
    s.finish_step(w, {})
    bm.on_commit()
    bm.check()
    w = s.schedule()
    assert [x.seq.rid for x in w] == ["old"] and s.preemptions == 1


def test_a_sequence_scheduled_in_this_step_is_never_preempted_by_it():
    """The youngest sequence needs a block and none is free, while the older one (already
    scheduled in this step) fits: the youngest gives way itself.  Preempting the scheduled one
    left its work with an empty block table (an IndexError that killed every engine on that
    state)."""
    bm = BlockManager(2, 4)
    s = Scheduler(bm, max_batched_tokens=64)
    s.add(seq("old", 2, max_tokens=8, arrival=0))
    s.add(seq("young", 3, max_tokens=8, arrival=1))
    for _ in range(2):                 # prefill, then one decode: each holds one full-ish block
        w = s.schedule()
        s.finish_step(w, {x.seq.rid: 1 for x in w if x.sample})
        bm.on_commit()
    w = s.schedule()                   # old: position 3 fits its block; young: position 4 needs one
    assert [x.seq.rid for x in w] == ["old"] and s.seqs["young"].status is Status.WAITING
    assert all(x.seq.status is Status.RUNNING and len(x.seq.block_table) * 4 >= x.start + x.n for x in w)
    steps = 0
    while s.has_work():
        s.finish_step(w, {x.seq.rid: 1 for x in w if x.sample})
        bm.on_commit()
        bm.check()
        w = s.schedule()
        steps += 1
        assert steps < 100
    assert s.preemptions >= 1


def test_random_schedules_keep_block_accounting():
    rng = random.Random(3)
    bm = BlockManager(24, 4)
    s = Scheduler(bm, max_num_seqs=5, max_batched_tokens=16, eos_token_ids=[0])
    for i in range(30):
        s.add(seq(f"r{i}", rng.randint(1, 20), max_tokens=rng.randint(1, 12), arrival=i))
    steps = 0
    while s.has_work():
        w = s.schedule()
        assert w, "scheduler stalled"
        assert sum(x.n for x in w) <= 16
        s.finish_step(w, {x.seq.rid: rng.randint(0, 50) for x in w if x.sample})
        bm.on_commit()
        bm.check()
        owned = [b for q in s.seqs.values() for b in q.block_table]
        assert len(owned) == len(set(owned))
        steps += 1
    assert steps < 1000


def test_commit_roundtrip_and_incremental_puts():
    j = LocalJournal()
    com = C.Committer(j)
    a = seq("a", 5, max_tokens=500, temperature=0.7, seed=11)
    a.block_table, a.num_computed, a.status = [3, 4], 6, Status.RUNNING
    a.output_ids = list(range(100, 100 + OUT_SEGMENT + 5))
    com.commit([a])
    b0 = com.bytes
    a.output_ids.append(7)
    a.num_computed += 1
    com.commit([a])
    assert com.bytes - b0 < 200          # only the state and the last segment were rewritten
    seqs, problems = C.read_sequences(j)
    assert not problems
    (r,) = seqs
    assert (r.prompt_ids, r.output_ids, r.block_table, r.num_computed, r.status) == \
        (a.prompt_ids, a.output_ids, a.block_table, a.num_computed, a.status)
    assert r.params == a.params
    com.commit([], gone=["a"])
    assert C.read_sequences(j) == ([], [])
    assert not j.get_many(prefix=C.P + "out/")


def test_restore_falls_back_on_inconsistent_tables():
    j = LocalJournal()
    a, b = seq("a", 5, arrival=0), seq("b", 5, arrival=1)
    for s_, t in ((a, [1, 2]), (b, [2])):
        s_.block_table, s_.num_computed, s_.status = t, 4, Status.RUNNING
    C.Committer(j).commit([a, b])
    seqs, _ = C.read_sequences(j)
    bm = BlockManager(8, 4)
    notes = C.restore_kv(seqs, bm, kv_valid=True)
    assert notes and "recomputing the prefill of 2" in notes[0]
    assert all(s_.num_computed == 0 and not s_.block_table and s_.status is Status.WAITING for s_ in seqs)
    assert bm.num_free == 8


def test_damaged_record_is_dropped_not_guessed():
    j = LocalJournal()
    a = seq("a", 3)
    C.Committer(j).commit([a])
    j.commit({}, [C.P + "st/a"])
    damaged = []
    seqs, problems = C.read_sequences(j, damaged)
    assert seqs == [] and "request a" in problems[0] and damaged == [C.P + "req/a"]   # the engine deletes it


def test_sampling_params_validation():
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError):
        Sequence("x", [], SamplingParams())
