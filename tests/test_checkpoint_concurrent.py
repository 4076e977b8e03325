"""Concurrent checkpoints on a real host daemon: equal, bit for bit, to stop-the-world ones."""
from __future__ import annotations

import base64
import contextlib
import json
import os

import pytest
import torch
from safetensors.torch import load_file

import gpu_anchor
from gpu_anchor.checkpoint.concurrent import ConcurrentCheckpointer
from gpu_anchor.checkpoint.validation import Validator
from gpu_anchor.testing.workload import Job
from gpu_anchor.checkpoint.writeset import WriteSetTracker
from gpu_anchor.journal_keys import STEP_KEY
from gpu_anchor.checkpoint.format import latest_complete, step_dir

STEPS = 8


def read_ckpt(directory, step):
    rdir = os.path.join(step_dir(directory, step), "rank0")
    with open(os.path.join(rdir, "manifest.json")) as f:
        man = json.load(f)
    (entry,) = man["files"]
    journal = {k: base64.b64decode(v) for k, v in entry["journal"].items()}
    return load_file(os.path.join(rdir, entry["file"])), journal


def assert_same(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    assert not bad, f"differ: {bad}"


def reference(ns, steps=STEPS, **kw):
    """Fault-free run; host copies of the state after every step."""
    job = Job(gpu_anchor.connect("cpu", namespace=ns), **kw)
    states = {}
    for s in range(1, steps + 1):
        job.step(s)
        job.commit(s)
        states[s] = job.snapshot()
    return states


def run_with_checkpoint(ns, directory, start_at, policy, throttle_s, validate=False, steps=STEPS, enter=True, **kw):
    client = gpu_anchor.connect("cpu", namespace=ns)
    job = Job(client, **kw)
    tracker = WriteSetTracker()
    val = Validator(tracker).attach() if validate else None
    ckpt = ConcurrentCheckpointer([client], directory, tracker, policy=policy, throttle_s=throttle_s,
                                  validator=val)
    done = []
    with tracker if enter else contextlib.nullcontext():  # else: the checkpointer enters it while in flight
        for s in range(1, steps + 1):
            job.step(s)
            job.commit(s)
            r = ckpt.boundary(s, due=(s == start_at))
            if r is not None:
                done.append(r)
    r = ckpt.finish(steps)
    if r is not None and (not done or done[-1] is not r):
        done.append(r)
    ckpt.close()
    return done, val


def test_cow_checkpoint_equals_stop_the_world(host_daemon, tmp_path):
    ref = reference("ref")
    # the baseline: a stop-the-world checkpoint of step 3 in its own run
    client = gpu_anchor.connect("cpu", namespace="stw")
    job, tracker = Job(client), WriteSetTracker()
    stw = ConcurrentCheckpointer([client], str(tmp_path / "stw"), tracker)
    for s in range(1, 4):
        job.step(s)
        job.commit(s)
    res_stw = stw.stop_the_world(3)
    assert res_stw.policy == "stw" and res_stw.valid

    results, _ = run_with_checkpoint("job", str(tmp_path / "cc"), 3, "cow", throttle_s=0.05)
    (res,) = results
    assert res.policy == "cow" and res.valid and res.step == 3
    # really concurrent: steps ran while it was in flight, and ops copied objects first (soft CoW)
    assert res.cow_foreground
    assert res.seconds > 0 and res.stall_s < res.seconds
    got, journal = read_ckpt(str(tmp_path / "cc"), 3)
    base, base_journal = read_ckpt(str(tmp_path / "stw"), 3)
    assert_same(got, base)
    assert_same(got, ref[3])
    assert journal[STEP_KEY] == base_journal[STEP_KEY] == b"3"
    assert json.loads(journal["gpu_anchor/checkpoint/touch_order"]), "first-touch order recorded for restore"
    assert latest_complete(str(tmp_path / "cc"), 1) == 3


def test_checkpointer_enters_the_tracker_only_while_in_flight(host_daemon, tmp_path):
    ref = reference("ref")
    results, _ = run_with_checkpoint("job", str(tmp_path / "m"), 3, "cow", throttle_s=0.05, enter=False)
    (res,) = results
    assert res.valid and res.cow_foreground, "writes were seen without a user `with tracker:`"
    got, _ = read_ckpt(str(tmp_path / "m"), 3)
    assert_same(got, ref[3])
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    assert not _get_current_dispatch_mode_stack(), "the mode is popped when the flight completes"


def test_recopy_checkpoint_is_the_state_at_its_closing_boundary(host_daemon, tmp_path):
    ref = reference("ref")
    results, _ = run_with_checkpoint("job", str(tmp_path / "rc"), 2, "recopy", throttle_s=0.01)
    (res,) = results
    assert res.policy == "recopy" and res.valid and res.step > 2
    assert res.recopied, "training writes every object each step: the dirty set is not empty"
    assert not res.cow_foreground
    got, journal = read_ckpt(str(tmp_path / "rc"), res.step)
    assert_same(got, ref[res.step])
    assert journal[STEP_KEY] == b"%d" % res.step


def _two_checkpoints(ckpt, step_fn, commit, limit=2000):
    """Run steps; checkpoint at step 2, then again at the first boundary after it completed;
    each completes at the first boundary where its copier is through."""
    s = 0
    while len(ckpt.results) < 2:
        s += 1
        assert s < limit, "checkpoints never completed"
        step_fn(s)
        commit(s)
        due = s == 2 or (len(ckpt.results) == 1 and not ckpt.in_flight)
        ckpt.boundary(s, due=due)
    ckpt.finish()  # the last one's file is written in the background
    return s


def test_auto_policy_follows_the_measured_write_volume(host_daemon, tmp_path):
    """Training writes everything per step → cow; a serving-like job writes a little → recopy."""
    client = gpu_anchor.connect("cpu", namespace="train")
    job, tracker = Job(client), WriteSetTracker()
    ckpt = ConcurrentCheckpointer([client], str(tmp_path / "t"), tracker, throttle_s=0.005)
    with tracker:
        _two_checkpoints(ckpt, job.step, job.commit)
    assert [r.policy for r in ckpt.results] == ["cow", "cow"]
    assert "measured" in ckpt.results[1].reason
    assert "copy order" in ckpt.results[1].reason  # the optimizer's first writes are copied first

    # serving-like: big read-only weights, a small cache row written per step
    sc = gpu_anchor.connect("cpu", namespace="serve")
    w = sc.tensor("weights", (256, 256))
    kv = sc.tensor("kv", (16, 256))
    torch.manual_seed(0)
    w.copy_(torch.randn(256, 256))
    tracker = WriteSetTracker()
    ckpt = ConcurrentCheckpointer([sc], str(tmp_path / "s"), tracker, throttle_s=0.005)
    states = {}

    def serve_step(s):
        x = torch.randn(1, 256, generator=torch.Generator().manual_seed(s))
        kv[s % 16].copy_((x @ w).tanh()[0])

    def commit(s):
        sc.journal.commit({STEP_KEY: b"%d" % s})
        states[s] = {"weights": w.clone(), "kv": kv.clone()}

    with tracker:
        _two_checkpoints(ckpt, serve_step, commit)
    first, second = ckpt.results
    assert first.policy == "cow" and second.policy == "recopy", [r.reason for r in ckpt.results]
    assert second.recopied in (["kv"], []) and second.step >= second.started_at
    for r in ckpt.results:
        got, _ = read_ckpt(str(tmp_path / "s"), r.step)
        assert_same(got, states[r.step])


def test_undeclared_write_invalidates_and_retakes(host_daemon, tmp_path):
    ref = reference("ref", undeclared=True)
    # negative control: without validation the undeclared write slips past soft CoW
    results, _ = run_with_checkpoint("blind", str(tmp_path / "blind"), 3, "cow", throttle_s=0.02,
                                     undeclared=True)
    (res,) = results
    assert res.valid  # it does not know
    got, _ = read_ckpt(str(tmp_path / "blind"), 3)
    differs = [k for k in got if not torch.equal(got[k], ref[3][k])]
    assert differs == ["optim.4.weight.exp_avg_sq"], differs

    results, val = run_with_checkpoint("checked", str(tmp_path / "ok"), 3, "cow", throttle_s=0.02,
                                       validate=True, undeclared=True)
    bad, retaken = results[0], results[-1]
    assert not bad.valid and bad.misses[0]["op"] == "gpu_anchor_test.shrink.default"
    assert "optim.4.weight.exp_avg_sq" in bad.misses[0]["objects"]
    assert not os.path.exists(step_dir(str(tmp_path / "ok"), 3)), "an invalid checkpoint is never written"
    assert retaken.valid and retaken.step > 3
    got, _ = read_ckpt(str(tmp_path / "ok"), retaken.step)
    assert_same(got, ref[retaken.step])
    assert val.misses and val.misses[0]["ops"] == ["gpu_anchor_test.shrink.default"]


def test_cow_copies_each_ops_write_set_as_one_group(host_daemon, tmp_path):
    """Foreground copy-on-write of an op's whole not-yet-copied write set in one grouped copy
    ends bit-identical to a stop-the-world checkpoint of the same step."""
    ref = reference("ref", layers=6)
    client = gpu_anchor.connect("cpu", namespace="stw")
    job = Job(client, layers=6)
    stw = ConcurrentCheckpointer([client], str(tmp_path / "stw"), WriteSetTracker())
    for s in range(1, 4):
        job.step(s)
        job.commit(s)
    stw.stop_the_world(3)

    client = gpu_anchor.connect("cpu", namespace="job")
    job, tracker = Job(client, layers=6), WriteSetTracker()
    ck = ConcurrentCheckpointer([client], str(tmp_path / "cc"), tracker, policy="cow", throttle_s=0.05)
    groups = []
    real = ck._move_many

    def counting(keys, fg):
        groups.append(list(keys))
        real(keys, fg)
    ck._move_many = counting  # the queue takes the bound method at start
    for s in range(1, 4):
        job.step(s)
        job.commit(s)
    ck.start(3)
    for s in range(4, 7):
        job.step(s)
        job.commit(s)
    res = ck.finish()
    ck.close()
    assert res.valid and res.policy == "cow"
    assert max(len(g) for g in groups) > 1, "a foreach op's write set is copied as one group"
    assert sorted(k for g in groups for k in g) == sorted(res.cow_foreground), "each object once"
    got, _ = read_ckpt(str(tmp_path / "cc"), 3)
    base, _ = read_ckpt(str(tmp_path / "stw"), 3)
    assert_same(got, base)
    assert_same(got, ref[3])


@pytest.mark.parametrize("versions", [True, False], ids=["versioned", "daemon-without-versions"])
def test_entry_table_is_reused_and_refreshed_when_objects_change(host_daemon, tmp_path, versions):
    """start() reuses the enumerated objects while the daemon's table is unchanged (no lookup
    bind), and sees an added, a replaced (same name, new shape) and a freed object — with the
    daemon's table version, and by comparing object lists where a daemon has none."""
    client = gpu_anchor.connect("cpu", namespace="job")
    if not versions:
        client.objects_since = lambda version: (None, client.objects())
    job, tracker = Job(client), WriteSetTracker()
    ck = ConcurrentCheckpointer([client], str(tmp_path), tracker, policy="cow", write=False)
    lookups = []
    real_bind = client.bind
    client.bind = lambda specs, policy="match_or_create": (lookups.append(policy), real_bind(specs, policy))[1]

    def checkpoint(step):
        ck.start(step)
        ck.finish()
        return {t["namespace"]: t for t in ck.captured}["job"]["tensors"]

    job.step(1)
    job.commit(1)
    first = checkpoint(1)
    assert lookups == ["lookup"]
    assert_same(first, job.snapshot())
    job.step(2)
    job.commit(2)
    assert_same(checkpoint(2), job.snapshot())
    assert lookups == ["lookup"], "an unchanged object table is not looked up again"

    extra = client.tensor("extra", (5,))
    extra.copy_(torch.arange(5.0))
    old = job.state["optim.0.weight.exp_avg"]
    (re,) = real_bind([("optim.0.weight.exp_avg", (3, 3), torch.float32)], "replace")
    re.tensor.fill_(7.0)
    gone = sorted(job.state)[-1]
    client.free(gone)
    got = checkpoint(3)
    assert lookups[-1] == "lookup" and len(lookups) == 3
    assert torch.equal(got["extra"], torch.arange(5.0)), "an added object is checkpointed"
    assert torch.equal(got["optim.0.weight.exp_avg"], torch.full((3, 3), 7.0)), "the replacement, not the old one"
    assert gone not in got and gone not in tracker.tensors, "a freed object is gone (and unregistered)"
    assert tracker.name_of(re.tensor) == "optim.0.weight.exp_avg" and old.shape != re.tensor.shape
    copier = ck._copier._thread
    assert copier.is_alive(), "one copier thread served every flight"
    ck.close()
    copier.join(5)
    assert not copier.is_alive(), "close() ends the copier thread"


def test_copier_thread_ends_with_an_unclosed_checkpointer(host_daemon, tmp_path):
    import gc
    client = gpu_anchor.connect("cpu", namespace="job")
    job = Job(client)
    ck = ConcurrentCheckpointer([client], str(tmp_path), WriteSetTracker(), policy="cow", write=False)
    job.step(1)
    job.commit(1)
    ck.start(1)
    ck.finish()
    copier = ck._copier._thread
    del ck
    gc.collect()
    copier.join(5)
    assert not copier.is_alive(), "a collected checkpointer leaves no idle copier thread behind"
