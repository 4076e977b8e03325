"""When the write-set tracker is installed (docs/checkpoint.md, "When tracking is installed").

The dispatch mode is on a thread's stack only while the thread is in a tracker scope and a
listener is attached, so steps between checkpoints pay nothing.  These tests drive that
state machine directly (scopes, listeners from other threads, modes entered inside a
scope, a mode lost off the stack), then the checkpointer's flight through every state:
a write at each state it can happen in (the checkpoint still equals stop-the-world bit
for bit; a negative control shows the same test fails when tracking is never installed),
and a SIGKILL of the worker at each state (recovery from the last complete checkpoint
ends bit-identical to the fault-free run).
"""
from __future__ import annotations

import multiprocessing
import os
import signal
import threading

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack, _pop_mode

import gpu_anchor
from gpu_anchor.checkpoint import snapshot
from gpu_anchor.checkpoint.concurrent import ConcurrentCheckpointer
from gpu_anchor.checkpoint.format import latest_complete, step_dir
from gpu_anchor.checkpoint.writeset import WriteSetTracker
from gpu_anchor.testing.workload import Job

from test_checkpoint_concurrent import assert_same, read_ckpt, reference

FLIGHT = ["armed", "captured", "copying", "copied", "completed", "writing", "committed"]
ON_JOB_THREAD = ["armed", "captured", "copying", "copied", "completed"]  # the writer thread runs the rest


class Log:
    wants_touched = False

    def __init__(self):
        self.ops = []

    def before_op(self, func, written, touched):
        self.ops.append(str(func))

    def after_op(self, func, written):
        pass


class Other(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _stack():
    return _get_current_dispatch_mode_stack()


def _tracked():
    tr, x, log = WriteSetTracker(), torch.zeros(4), Log()
    tr.register("x", x)
    return tr, x, log


# ---------------------------------------------------------------- the tracker's own state machine
def test_scope_installs_the_mode_only_while_someone_listens():
    tr, x, log = _tracked()
    with tr:
        x.add_(1)
        assert _stack() == [] and tr.in_scope, "a scope without listeners installs nothing"
        tr.add_listener(log)
        assert _stack() == [tr], "installed before add_listener returns"
        x.add_(1)
        with tr:  # nested: still one installation, each op heard once
            x.add_(1)
        assert _stack() == [tr]
        tr.remove_listener(log)
        assert _stack() == []
        x.add_(1)
        tr.add_listener(log)
    assert _stack() == [] and not tr.in_scope
    x.add_(1)  # outside every scope: not heard, though a listener is attached
    assert log.ops == ["aten.add_.Tensor"] * 2
    with tr:  # entering with a listener attached installs at once
        assert _stack() == [tr]
    assert _stack() == []


def test_mode_goes_in_at_the_scopes_place_below_modes_entered_inside_it():
    tr, x, log = _tracked()
    other = Other()
    with tr:
        with other:
            tr.add_listener(log)
            assert _stack() == [tr, other], "where `with tracker:` would have put it"
            x.add_(1)
        assert _stack() == [tr], "the inner mode popped itself, not the tracker"
        x.add_(1)
        with other:
            tr.remove_listener(log)
            assert _stack() == [other], "taken out from under a mode entered later"
    assert _stack() == []
    assert log.ops == ["aten.add_.Tensor"] * 2


def test_attach_from_another_thread_while_a_scope_is_dormant_is_refused():
    tr, x, log = _tracked()
    errors = []

    def attach():
        try:
            tr.add_listener(log)
        except RuntimeError as e:
            errors.append(str(e))

    with tr:
        t = threading.Thread(target=attach, name="other")
        t.start()
        t.join()
        assert errors and "MainThread" in errors[0] and tr.listeners == [], "refused, and nothing attached"
        tr.add_listener(log)  # on the scope's own thread: installed at once
        assert _stack() == [tr]
        t = threading.Thread(target=tr.add_listener, args=(Log(),))
        t.start()
        t.join()
        assert len(tr.listeners) == 2, "another thread may attach while this one is installed"
    # attached before any scope: fine from any thread, the scope installs on entry
    tr2, _, log2 = _tracked()
    t = threading.Thread(target=tr2.add_listener, args=(log2,))
    t.start()
    t.join()
    with tr2:
        assert _stack() == [tr2]


def test_detach_from_another_thread_leaves_the_mode_until_the_owner_syncs():
    tr, x, log = _tracked()
    tr.add_listener(log)
    with tr:
        t = threading.Thread(target=tr.remove_listener, args=(log,))
        t.start()
        t.join()
        assert _stack() == [tr], "another thread cannot take it off this one's stack"
        x.add_(1)
        assert log.ops == [], "installed but idle: nobody is called"
        assert tr.sync() is False and _stack() == [], "the owner's next sync takes it off"


def test_a_scope_closed_from_another_thread_comes_off_at_the_owners_next_sync():
    """A flight finished elsewhere (e.g. at interpreter exit on the main thread) closes its scope by token."""
    tr, x, log = _tracked()
    tr.add_listener(log)
    token = tr.enter_scope()
    assert _stack() == [tr]
    t = threading.Thread(target=tr.exit_scope, args=(token,))
    t.start()
    t.join()
    assert _stack() == [tr] and not tr.in_scope, "only the owner can change its stack"
    x.add_(1)  # still heard: taking it off early could only lose ops, keeping it only costs time
    assert tr.sync() is False and _stack() == [] and tr._scopes == {}
    with pytest.raises(RuntimeError, match="never entered"):
        tr.exit_scope(token)
    assert log.ops == ["aten.add_.Tensor"]


def test_a_mode_taken_off_the_stack_behind_its_back_is_counted_lost():
    tr, x, log = _tracked()
    tr.add_listener(log)
    with tr:
        assert _pop_mode() is tr  # e.g. a mode entered inside the scope that exited out of order
        assert tr.lost == 0
        x.add_(1)  # not seen
        assert tr.sync() and tr.lost == 1 and _stack() == [tr], "detected at the next sync, and reinstalled"
        x.add_(1)
    assert log.ops == ["aten.add_.Tensor"]


# ---------------------------------------------------------------- the checkpointer's flight
class NeverInstalls(WriteSetTracker):
    """The negative control: claims to be installed, never is."""
    active = property(lambda self: True)

    def _sync(self, sc):
        pass


def _run(ns, directory, policy, due, steps=8, scope=True, at=None, never_install=False, stw_dir=None):
    """Train ``steps``, checkpoint at ``due``; ``at(state, job, ck)`` runs at each flight state."""
    client = gpu_anchor.connect("cpu", namespace=ns)
    job, tracker = Job(client), (NeverInstalls() if never_install else WriteSetTracker())
    ck = ConcurrentCheckpointer([client], directory, tracker, policy=policy, throttle_s=0.02)
    stw = ConcurrentCheckpointer([client], stw_dir, WriteSetTracker()) if stw_dir else None
    seen, idle = [], []
    ck.transition_hook = lambda state: (seen.append(state), at and at(state, job, ck))
    try:
        if scope:
            tracker.__enter__()
        for s in range(1, steps + 1):
            before = tracker.ops_seen
            job.step(s)
            job.commit(s)
            if not ck.in_flight:
                idle.append((tracker.active, tracker.ops_seen - before))
            if s == due and stw is not None and policy != "recopy":
                stw.stop_the_world(s)  # what the concurrent one must equal: this step, copied stopped
            ck.boundary(s, due=s == due)
        ck.finish(steps)
    finally:
        if scope:
            tracker.__exit__()
    ck.close()
    return ck.results, seen, idle, tracker


def _write(job):
    """A write, through aten on the job's thread, to the first and the last object the copier takes."""
    with torch.no_grad():
        job.params["0.bias"].mul_(1.5)
        job.state["optim.4.weight.exp_avg_sq"].add_(0.25)


@pytest.mark.parametrize("scope", [True, False], ids=["with-tracker", "managed"])
@pytest.mark.parametrize("policy", ["cow", "recopy", "device"])  # device: on host objects, copy-on-write
def test_a_write_at_each_flight_state_keeps_the_checkpoint_exact(host_daemon, tmp_path, policy, scope):
    probes = {}

    def at(state, job, ck):
        fl = ck._flight
        probes[state] = {"active": ck.tracker.active, "copier": None if fl is None else len(fl.queue.background)}
        if state in ON_JOB_THREAD:
            _write(job)
        if state == "copied" and policy == "recopy":  # the closing boundary, after this state's write
            stw = ConcurrentCheckpointer([job.client], str(tmp_path / "stw"), WriteSetTracker())
            stw.stop_the_world(job.committed_step())

    (res,), seen, idle, tracker = _run("job", str(tmp_path / "cc"), policy, due=3, scope=scope, at=at,
                                       stw_dir=str(tmp_path / "stw"))
    assert seen == FLIGHT, seen
    assert res.valid and res.policy == policy
    for state in ("armed", "captured"):
        assert probes[state] == {"active": True, "copier": 0}, (state, probes[state])
    assert probes["copying"]["active"] and probes["copied"]["active"]
    assert not probes["completed"]["active"], "off the stack as soon as the flight completed"
    got, _ = read_ckpt(str(tmp_path / "cc"), res.step)
    want, _ = read_ckpt(str(tmp_path / "stw"), res.step)
    assert_same(got, want)
    if policy != "recopy":
        assert res.step == 3 and res.cow_foreground, "writes in flight were copied first"
    else:
        assert res.step > 3 and "optim.4.weight.exp_avg_sq" in res.recopied
    # between checkpoints nothing is installed and no op reaches the tracker
    assert idle and all(active is False and heard == 0 for active, heard in idle), idle
    assert not tracker.active and tracker.listeners == []


def test_negative_control_a_tracker_that_never_installs_loses_the_writes(host_daemon, tmp_path):
    def at(state, job, ck):
        if state in ("armed", "captured"):
            _write(job)

    (res,), _, _, _ = _run("blind", str(tmp_path / "cc"), "cow", due=3, at=at, never_install=True,
                           stw_dir=str(tmp_path / "stw"))
    got, _ = read_ckpt(str(tmp_path / "cc"), 3)
    want, _ = read_ckpt(str(tmp_path / "stw"), 3)
    differ = sorted(k for k in got if not torch.equal(got[k], want[k]))
    assert "optim.4.weight.exp_avg_sq" in differ and not res.cow_foreground, differ


# ---------------------------------------------------------------- SIGKILL at each state
STEPS, FIRST, SECOND = 8, 2, 5
_fork = multiprocessing.get_context("fork")


class KillOnWrite:
    wants_touched = False

    def before_op(self, func, written, touched):
        if written:
            os.kill(os.getpid(), signal.SIGKILL)

    def after_op(self, func, written):
        pass


def _worker(ns, directory, kill_at):
    torch.set_num_threads(1)  # the parent's thread pool does not survive fork
    client = gpu_anchor.connect("cpu", namespace=ns)
    job, tracker = Job(client), WriteSetTracker()
    ck = ConcurrentCheckpointer([client], directory, tracker, policy="cow", throttle_s=0.01)
    flights = [0]

    def kill(state):
        flights[0] += state == "armed"
        if flights[0] < 2:
            return  # the first checkpoint completes; the second one is killed
        if state == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if kill_at == "torn" and state == "armed":
            os.environ["GPU_ANCHOR_SNAPSHOT_THROTTLE_S"] = "0.05"  # a file write long enough to tear
        if kill_at == "torn" and state == "writing":  # during the file writes, before COMMITTED
            threading.Timer(0.15, os.kill, (os.getpid(), signal.SIGKILL)).start()
        if kill_at == "mid-flight" and state == "copying":  # inside the first op that writes, after its copies
            tracker.add_listener(KillOnWrite())
    ck.transition_hook = kill
    for s in range(1, STEPS + 1):
        job.step(s)
        job.commit(s)
        ck.boundary(s, due=s in (FIRST, SECOND))
        if s == SECOND - 1:
            ck.finish()  # the first one is on disk before the second starts
    ck.finish(STEPS)
    os._exit(0)


@pytest.mark.parametrize("kill_at", ["armed", "captured", "copying", "mid-flight", "copied", "completed",
                                     "writing", "torn", "committed"])
def test_sigkill_at_each_flight_state_then_restore_matches_fault_free(host_daemon, tmp_path, kill_at):
    ref = reference("ref", steps=STEPS)
    directory = str(tmp_path / "ck")
    p = _fork.Process(target=_worker, args=("job", directory, kill_at))
    p.start()
    p.join(120)
    assert p.exitcode == -signal.SIGKILL, f"the worker was not killed at {kill_at}: exit {p.exitcode}"
    last = latest_complete(directory, 1)
    assert last == (SECOND if kill_at == "committed" else FIRST), (kill_at, last)
    if kill_at == "torn":
        assert os.path.isdir(step_dir(directory, SECOND)), "the kill landed during the write"
    got, _ = read_ckpt(directory, last)
    assert_same(got, ref[last])
    # destructive failure: the daemon's copy is gone; restore the last complete checkpoint and go on
    gpu_anchor.connect("cpu", namespace="job").drop_namespace()
    snapshot.restore(directory, last, 0)
    job = Job(gpu_anchor.connect("cpu", namespace="job"))
    assert job.committed_step() == last
    for s in range(last + 1, STEPS + 1):
        job.step(s)
        job.commit(s)
    assert_same(job.snapshot(), ref[STEPS])
