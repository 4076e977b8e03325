"""The generic guard (group copy-on-write) with an optimizer fused into backward.

Workers are forked from this interpreter and SIGKILLed: at a fixed point inside a
step's per-parameter updates (deterministic, with and without the guard), and at
random instants (a campaign).  Every run ends compared, bit for bit, with a
fault-free run.  ``GPU_ANCHOR_GUARD_KILLS`` sizes the campaign.
"""
from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time

import pytest
import torch
import torch._dynamo  # noqa: F401  -- imported lazily under a dispatch mode (3 s): do it once, before forking

import gpu_anchor
from gpu_anchor.checkpoint.guard import GroupGuard
from gpu_anchor.testing.workload import Job
from gpu_anchor.checkpoint.writeset import WriteSetTracker
from gpu_anchor.journal_keys import STEP_KEY

STEPS = 12
KILLS = int(os.environ.get("GPU_ANCHOR_GUARD_KILLS", "10"))
_fork = multiprocessing.get_context("fork")


def _worker(ns, guard_on, kill_at, sleep_s, log, steps=STEPS):
    """One worker life: recover, then run steps until STEPS; SIGKILL itself at ``kill_at``=(step, param)."""
    torch.set_num_threads(1)  # the parent's thread pool does not survive fork
    client = gpu_anchor.connect("cpu", namespace=ns)
    box = {}

    def hook(name):
        if kill_at is not None and (box["job"]._step_no, name) == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if sleep_s:
            time.sleep(sleep_s)

    job = box["job"] = Job(client, in_backward=True, hook=hook)
    tracker = WriteSetTracker()
    guard = GroupGuard(client, tracker, job.tensors()) if guard_on else None
    rolled = guard.recover() if guard else []
    start = job.committed_step()
    with open(log, "a") as f:
        f.write(f"{start} {len(rolled)}\n")
    with tracker:
        for s in range(start + 1, steps + 1):
            if guard:
                guard.begin(s)
            job.step(s)
            if guard:
                guard.commit({STEP_KEY: b"%d" % s})
            else:
                job.commit(s)
    os._exit(0)


def _life(ns, guard_on, log, kill_at=None, sleep_s=0.0, kill_after=None, steps=STEPS):
    p = _fork.Process(target=_worker, args=(ns, guard_on, kill_at, sleep_s, log, steps))
    p.start()
    if kill_after is not None:
        lives = len(_lives(log)) if os.path.exists(log) else 0
        deadline = time.monotonic() + 60
        while p.is_alive() and len(_lives(log) if os.path.exists(log) else ()) == lives:
            assert time.monotonic() < deadline, "worker never started"
            time.sleep(0.002)
        time.sleep(kill_after)  # a random instant after recovery, while it trains
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
    p.join(120)
    assert p.exitcode is not None, "worker hung"
    return p.exitcode


def _state(ns):
    job = Job(gpu_anchor.connect("cpu", namespace=ns), in_backward=True)
    return job.committed_step(), job.snapshot()


def _lives(log):
    with open(log) as f:
        return [tuple(map(int, line.split())) for line in f]


@pytest.fixture
def reference(host_daemon, tmp_path):
    assert _life("ref", True, str(tmp_path / "ref.log")) == 0
    step, state = _state("ref")
    assert step == STEPS
    return state


def _assert_same(a, b):
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    assert not bad, bad


def test_kill_inside_a_fused_step_without_guard_corrupts_state(reference, tmp_path):
    log = str(tmp_path / "noguard.log")
    assert _life("bare", False, log, kill_at=(5, "2.weight")) == -signal.SIGKILL
    assert _life("bare", False, log) == 0
    step, state = _state("bare")
    assert step == STEPS
    assert any(not torch.equal(state[k], reference[k]) for k in state), \
        "step 5 ran twice on half its parameters: the run must differ (the hazard the guard removes)"


def test_kill_inside_a_fused_step_with_guard_rolls_back(reference, tmp_path):
    log = str(tmp_path / "guard.log")
    assert _life("g", True, log, kill_at=(5, "2.weight")) == -signal.SIGKILL
    assert _life("g", True, log) == 0
    (first, _), (restart, rolled) = _lives(log)
    assert restart == 4 and rolled > 0
    step, state = _state("g")
    assert step == STEPS
    _assert_same(state, reference)


def test_random_kill_campaign_with_guard_matches_fault_free(host_daemon, tmp_path):
    """KILLS workers SIGKILLed at random instants; enough steps that every kill lands in training."""
    steps = max(STEPS, 3 * KILLS)
    assert _life("ref-c", True, str(tmp_path / "ref.log"), steps=steps) == 0
    want_step, want = _state("ref-c")
    assert want_step == steps
    rng = random.Random(int(os.environ.get("GPU_ANCHOR_GUARD_SEED", "8")))
    log = str(tmp_path / "campaign.log")
    killed = 0
    for _ in range(KILLS):
        code = _life("c", True, log, sleep_s=0.002, kill_after=rng.uniform(0.0, 0.1), steps=steps)
        if code == 0:
            break
        assert code == -signal.SIGKILL
        killed += 1
    assert _life("c", True, log, sleep_s=0.002, steps=steps) == 0
    lives = _lives(log)
    print(f"campaign: {killed} kills, restarts at steps {[s for s, _ in lives]}, "
          f"rolled back {sum(r for _, r in lives)} objects")
    assert killed >= min(KILLS, 3), "the campaign must actually kill workers"
    assert sum(r for _, r in lives) > 0, f"no kill landed inside a step: {lives}"
    step, state = _state("c")
    assert step == steps
    _assert_same(state, want)


def test_guard_protocol_in_process(host_daemon):
    """Bookkeeping: backups once per object per group, atomic commit, idempotent recovery, clear errors."""
    client = gpu_anchor.connect("cpu", namespace="p")
    a, b = client.tensor("a", (4,)), client.tensor("b", (4,))
    a.fill_(1.0)
    b.fill_(2.0)
    tracker = WriteSetTracker()
    guard = GroupGuard(client, tracker, {"a": a, "b": b})
    with pytest.raises(RuntimeError, match="no group is open"):
        guard.commit()
    with tracker:
        guard.begin(1)
        with pytest.raises(RuntimeError, match="still open"):
            guard.begin(2)
        a.add_(1.0)
        a.mul_(3.0)          # second write: no second backup
        guard.commit({STEP_KEY: b"1"})
        assert guard.stats["backups"] == 1
        guard.begin(2)
        b.copy_(a)
        a.zero_()
    assert client.journal.get(STEP_KEY) == b"1"
    assert sorted(client.journal.get_many(prefix="gpu_anchor/guard/")) == ["gpu_anchor/guard/b/a", "gpu_anchor/guard/b/b"]
    guard.close()
    fresh = GroupGuard(client, WriteSetTracker(), {"a": a, "b": b})
    assert sorted(fresh.recover()) == ["a", "b"]
    assert fresh.recover() == []
    assert a.tolist() == [6.0] * 4 and b.tolist() == [2.0] * 4
    # a journal entry for an object this worker does not protect is refused, not ignored
    client.journal.commit({"gpu_anchor/guard/b/c": b"3 device"})
    with pytest.raises(RuntimeError, match="does not protect"):
        GroupGuard(client, WriteSetTracker(), {"a": a}).recover()
    assert b"does not protect" in client.journal.get("gpu_anchor/inconsistent"), "the supervisor is told to restore"
