"""The step protocol's bookkeeping, chunk planning and rank agreement, without torch."""
import json
import random
import sys

import pytest

from gpu_anchor.train import chunking, distributed, faults
from gpu_anchor.train.protocol import APPLYING, IDLE, PHASES, StepState, describe, key


def test_normal_path_walks_every_chunk_then_commits_the_step():
    st = StepState(step=7)
    st = st.begin(4)
    seen = []
    while st.in_flight:
        assert st.undo == st.cursor and st.rollback_chunk() == st.cursor
        seen.append(st.cursor)
        st = st.chunk_done(st.cursor)
    assert seen == [0, 1, 2, 3]
    assert (st.step, st.phase, st.undo) == (8, IDLE, -1)
    assert st.rollback_chunk() is None


def test_out_of_order_and_double_begin_are_refused():
    st = StepState(step=0).begin(3)
    with pytest.raises(RuntimeError):
        st.chunk_done(1)
    with pytest.raises(RuntimeError):
        st.begin(3)
    with pytest.raises(ValueError):
        StepState().begin(0)


def test_encode_decode_roundtrip_and_corruption():
    st = StepState(3, APPLYING, 2, 2, 5)
    assert StepState.decode(st.encode()) == st
    assert StepState.decode(None) == StepState()
    bad = json.dumps({"step": 3, "phase": APPLYING, "cursor": 5, "undo": 5, "chunks": 5}).encode()
    with pytest.raises(ValueError):
        StepState.decode(bad)
    with pytest.raises(ValueError):
        StepState.decode(json.dumps({"step": 1, "phase": "weird", "cursor": 0, "undo": -1, "chunks": 1}).encode())


def test_discard_returns_to_the_committed_step():
    st = StepState(4).begin(2).discard()
    assert (st.step, st.phase) == (4, IDLE)


def test_describe_is_the_supervisor_view():
    assert describe({})["completed_steps"] == 0 and describe({})["present"] is False
    idle = {key("train", "state"): StepState(5, IDLE, 0, -1, 3).encode()}
    d = describe(idle)
    assert d["consistent"] and d["completed_steps"] == 5 and d["in_flight_step"] is None
    fl = {key("train", "state"): StepState(5, IDLE, 0, -1, 3).begin(3).chunk_done(0).encode(),
          key("train", "boundary"): b"{}"}
    d = describe(fl)
    assert d["consistent"] and d["completed_steps"] == 6 and d["in_flight_step"] == 5 and d["cursor"] == 1
    del fl[key("train", "boundary")]
    assert describe(fl)["consistent"] is False
    assert describe({key("train", "state"): b"garbage"})["consistent"] is False


def test_status_module_does_not_import_torch():
    import subprocess
    code = "import sys, gpu_anchor.train.status, gpu_anchor.train.protocol; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


@pytest.mark.parametrize("seed", range(20))
def test_plan_covers_every_element_once_within_budget(seed):
    rnd = random.Random(seed)
    numels = [rnd.choice([1, 3, 64, 100, 1000, 5000, 70000]) for _ in range(rnd.randint(1, 12))]
    sizes = [[rnd.choice([2, 4])] * rnd.randint(1, 4) for _ in numels]
    budget = rnd.choice([4096, 20000, 1 << 20])
    plan = chunking.plan(numels, sizes, budget)
    covered = {p: [] for p in range(len(numels))}
    for chunk in plan:
        assert chunk, "no empty chunks"
        assert chunking.chunk_bytes_used(chunk, sizes) <= budget
        for s in chunk:
            covered[s.param].append((s.start, s.stop))
            assert s.start % chunking.GRAIN == 0
        for row in chunking.layout(chunk, sizes):
            assert all(off % chunking.ALIGN == 0 for off in row)
    for p, spans in covered.items():
        pos = 0
        for a, b in spans:       # in order, contiguous, complete
            assert a == pos and b > a
            pos = b
        assert pos == numels[p]
    assert plan == chunking.plan(numels, sizes, budget)   # deterministic


def test_plan_refuses_a_budget_too_small_for_one_grain():
    with pytest.raises(ValueError):
        chunking.plan([1000], [[4, 4, 4]], 256)


def test_default_budget_is_two_percent_for_both_slots():
    assert chunking.default_chunk_bytes(10 << 30) * 2 <= 0.02 * (10 << 30)
    assert chunking.default_chunk_bytes(1000) == chunking.MIN_CHUNK_BYTES


@pytest.mark.parametrize("states,expect", [
    ([(3, None), (3, None)], ["none", "none"]),
    ([(3, 3), (4, None)], ["finish", "none"]),          # killed after the barrier
    ([(3, 3), (3, 3)], ["finish", "finish"]),
    ([(3, 3), (3, None)], ["discard", "none"]),         # the other rank never finalized
    ([(3, None), (3, 3), (3, 3)], ["none", "discard", "discard"]),
])
def test_rank_agreement(states, expect):
    assert [distributed.decide(states, r) for r in range(len(states))] == expect


@pytest.mark.parametrize("states", [[(3, None), (5, None)], [(4, None), (3, None)], [(3, 2), (3, None)]])
def test_rank_agreement_refuses_impossible_states(states):
    with pytest.raises(distributed.DisagreementError):
        for r in range(len(states)):
            distributed.decide(states, r)


@pytest.mark.parametrize("states,expect", [
    ([(3, None, False), (3, None, False)], ["none", "none"]),
    ([(3, 3, True), (3, 3, False)], ["finish", "finish"]),     # one device passed the barrier: all did backward
    ([(3, 3, False), (4, None, False)], ["finish", "none"]),   # one rank already landed step 3
    ([(3, 3, False), (3, 3, False)], ["discard", "discard"]),  # no device reached the boundary
    ([(3, 3, False), (3, None, False)], ["discard", "none"]),  # one rank never committed the boundary
])
def test_rank_agreement_device_progress(states, expect):
    assert [distributed.decide_device(states, r) for r in range(len(states))] == expect


def test_device_report_counts_a_fully_written_step_as_committed():
    # killed between the device finishing step 2 and the host landing its commit, while the
    # peer already landed it with its boundary of step 3 (seen on two H200s)
    a = distributed.device_report(2, True, 4, chunks=4)
    b = distributed.device_report(3, True, None, chunks=4)
    assert a == (3, None, False) and b == (3, 3, False)
    assert [distributed.decide_device([a, b], r) for r in (0, 1)] == ["none", "discard"]
    # the same with rank 0's device still inside step 2: it finishes 2, rank 1 discards 3
    a = distributed.device_report(2, True, 1, chunks=4)
    assert [distributed.decide_device([a, b], r) for r in (0, 1)] == ["finish", "discard"]
    assert distributed.device_report(3, True, 2, chunks=4) == (3, 3, True)
    assert distributed.device_report(3, False, None, chunks=4) == (3, None, False)


@pytest.mark.parametrize("states", [[(4, None, False), (3, None, False)], [(3, 3, True), (3, None, False)],
                                    [(3, 2, False), (3, 3, False)], [(5, None, False), (3, 3, False)]])
def test_rank_agreement_device_progress_refuses_impossible_states(states):
    with pytest.raises(distributed.DisagreementError):
        for r in range(len(states)):
            distributed.decide_device(states, r)


def test_fault_specs():
    assert faults.parse("mid_chunk@3:1") == ("mid_chunk", 3, 1)
    assert faults.parse("between_steps@4") == ("between_steps", 4, None)
    for bad in ("mid_chunk", "nowhere@3", "mid_chunk@x"):
        with pytest.raises(ValueError):
            faults.parse(bad)
    faults.arm("after_update@2:0")
    try:
        assert faults.armed("after_update", 2, 0) and not faults.armed("after_update", 2, 1)
    finally:
        faults.arm(None)
    assert len(PHASES) == 7


def test_device_progress_word():
    from gpu_anchor.train.protocol import decode_progress, device_resume_point, encode_progress
    assert decode_progress(encode_progress(12345, 17)) == (12345, 17)
    assert decode_progress(-1) == (-1, 0)
    st = StepState(9).begin(4, device_progress=True)
    assert st.undo == -1 and st.rollback_chunk() is None
    assert device_resume_point(st, -1) is None                              # never began: discard
    assert device_resume_point(st, encode_progress(8, 4)) is None           # last step's word
    assert device_resume_point(st, encode_progress(9, 2)) == 2              # chunk 2 maybe half written
    assert device_resume_point(st, encode_progress(9, 4)) == 4              # written; commit missing
    with pytest.raises(ValueError):
        device_resume_point(st, encode_progress(9, 7))
    with pytest.raises(RuntimeError):
        device_resume_point(StepState(9), 0)
    assert st.finish() == StepState(10, IDLE, 0, -1, 4)


def test_a_fused_step_takes_its_cursor_from_the_tags():
    """A fused step's word stays at (s, 0) until (s, N): the last tagged chunk is the cursor."""
    from gpu_anchor.train.protocol import device_resume_point, encode_progress
    st = StepState(9).begin(4, device_progress=True)
    assert device_resume_point(st, encode_progress(9, 0), None) == 0        # no block tagged yet
    assert device_resume_point(st, encode_progress(9, 0), 2) == 2           # chunk 2 began: 0, 1 written
    assert device_resume_point(st, encode_progress(9, 4), 3) == 4           # written; commit missing
    assert device_resume_point(st, encode_progress(9, 3), 1) == 3           # a copy finish moved the word on
    with pytest.raises(ValueError, match="never showed the step"):
        device_resume_point(st, encode_progress(8, 4), 1)                   # tags without the word: corrupt
    with pytest.raises(ValueError, match="4 chunks"):
        device_resume_point(st, encode_progress(9, 0), 4)


def test_last_started_reads_the_highest_chunk_tagged_for_the_step():
    """``FusedAdam.last_started``: tags of chunk i in slot i % 2 (written, started or finished),
    stale tags of chunk i - 2 and of the last step beside them, a chunk with no blocks, chunks of
    different sizes."""
    import torch
    from gpu_anchor.train.fused_adam import BLOCK, FINISHED, RING_MIN_BYTES, STARTED, FusedAdam, tag_code
    from gpu_anchor.train.protocol import encode_progress
    sizes = [3 * BLOCK, BLOCK + 5, 2 * BLOCK, 10, 4 * BLOCK]          # one slice a chunk, 5 chunks

    def chunk(n):
        return [[torch.zeros(n) for _ in range(4)]]
    tags = torch.full((2, 4), -1, dtype=torch.int64)
    fused = FusedAdam([chunk(n) for n in sizes], tags, [torch.zeros(RING_MIN_BYTES, dtype=torch.uint8)] * 2)
    assert fused.last_started(7) is None
    tags[0, :3] = encode_progress(6, 4)                                # the last step's, all stale
    tags[1, :2] = encode_progress(6, 3)
    assert fused.last_started(7) is None
    tags[0, :3] = encode_progress(7, 0)                                # chunk 0 written
    assert fused.last_started(7) == 0
    tags[1, :2] = encode_progress(7, 1)                                # chunk 1 written
    tags[0, 1] = tag_code(encode_progress(7, 2), 5, STARTED)           # one block of chunk 2 began
    assert fused.last_started(7) == 2
    tags[0, :2] = encode_progress(7, 2)
    tags[1, :1] = tag_code(encode_progress(7, 3), 0, FINISHED)
    assert fused.last_started(7) == 3
    tags[0, 2] = encode_progress(7, 4)                                 # chunk 4's third block first
    assert fused.last_started(7) == 4
    assert fused.last_started(8) is None
