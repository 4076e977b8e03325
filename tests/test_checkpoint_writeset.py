"""Write-set speculation from aten schemas, validation of it, and the transfer queue (no daemon)."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from gpu_anchor.checkpoint.transfer import Runner, TransferQueue
from gpu_anchor.checkpoint.validation import Validator
from gpu_anchor.testing.workload import undeclared_scale_op
from gpu_anchor.checkpoint.writeset import ObjectMap, Recorder, WriteSetTracker, written_tensors


class Log:
    wants_touched = True

    def __init__(self):
        self.ops = []

    def before_op(self, func, written, touched):
        self.ops.append((str(func), list(written), sorted(touched or [])))

    def after_op(self, func, written):
        pass


def _tracked(**tensors):
    tr = WriteSetTracker()
    tr.register_many(tensors)
    log = Log()
    tr.add_listener(log)
    return tr, log


def test_schema_write_slots():
    a, b = torch.zeros(3), torch.ones(3)
    assert written_tensors(torch.ops.aten.add_.Tensor, (a, b), {})[0] is a
    assert written_tensors(torch.ops.aten.add.Tensor, (a, b), {}) == []
    out = torch.empty(3)
    assert written_tensors(torch.ops.aten.add.out, (a, b), {"out": out})[0] is out
    ws = written_tensors(torch.ops.aten._foreach_add_.List, ([a, b], [b, a]), {})
    assert [id(t) for t in ws] == [id(a), id(b)]


def test_inplace_out_foreach_and_views_map_to_objects():
    w, m, other = torch.zeros(4, 4), torch.zeros(4), torch.zeros(4)
    tr, log = _tracked(w=w, m=m)
    with tr, torch.no_grad():
        w[1].add_(1.0)                              # a write through a view
        torch.add(other, 1.0, out=m)                # out=
        torch._foreach_mul_([w, other], 2.0)        # foreach list, one untracked
        _ = w.sum()                                 # read only
        other.copy_(m)                              # reads m, writes an untracked tensor
    by_op = {}
    for op, wr, touched in log.ops:
        by_op.setdefault(op, []).append((wr, touched))
    assert (["w"], ["w"]) in by_op["aten.add_.Tensor"]
    assert by_op["aten.add.out"] == [(["m"], ["m"])]
    assert by_op["aten._foreach_mul_.Scalar"] == [(["w"], ["w"])]
    assert by_op["aten.sum.default"] == [([], ["w"])]
    assert by_op["aten.copy_.default"] == [([], ["m"])]


def test_object_map_rejects_overlap_and_finds_ranges():
    base = torch.zeros(100)
    om = ObjectMap()
    om.add("a", base[:50])   # the storage is the whole buffer: a second view overlaps
    with pytest.raises(ValueError, match="overlaps"):
        om.add("b", base[50:])
    with pytest.raises(ValueError, match="no storage"):
        om.add("meta", torch.empty(3, device="meta"))
    assert om.find(base[70:]) == "a" and om.find(torch.zeros(3)) is None
    om.remove("a")
    assert om.find(base) is None


def test_undeclared_write_is_invisible_to_speculation_and_caught_by_validation():
    op = undeclared_scale_op()
    w, v = torch.ones(8), torch.ones(8)
    tr, log = _tracked(w=w, v=v)
    val = Validator(tr, group_ops=1).attach()
    seen = []
    val.on_miss.append(lambda f, names: seen.append((str(f), names)))
    with tr, torch.no_grad():
        v.add_(1.0)          # declared: no miss
        op(w, 0.5)           # undeclared write of w
    assert log.ops[1][1] == [], "the schema declares no write, so speculation predicts none"
    assert val.misses == [{"ops": ["gpu_anchor_test.shrink.default"], "objects": ["w"]}]
    assert seen == [("gpu_anchor_test.shrink.default", ["w"])]
    # learnt: the op is now treated as writing all its tensor arguments, and no more misses
    with tr, torch.no_grad():
        op(w, 0.5)
    assert log.ops[-1][1] == ["w"] and len(val.misses) == 1
    assert val.groups_checked == 3


def test_validation_grouped_ops_blames_the_toucher():
    op = undeclared_scale_op()
    w, v = torch.ones(8), torch.ones(8)
    tr, _ = _tracked(w=w, v=v)
    val = Validator(tr, group_ops=4).attach()
    with tr, torch.no_grad():
        v.mul_(2.0)
        op(w, 0.5)
        _ = v + 1
        v.add_(1.0)
    assert val.misses == [{"ops": ["gpu_anchor_test.shrink.default"], "objects": ["w"]}]


def test_recorder_measures_write_volume_and_first_touch():
    a, b, c = torch.zeros(10), torch.zeros(100), torch.zeros(1000)
    tr = WriteSetTracker()
    tr.register_many({"a": a, "b": b, "c": c})
    rec = Recorder(tr)
    tr.add_listener(rec)
    with tr, torch.no_grad():
        _ = c.sum()
        b.add_(1)
        a.copy_(b[:10])
    assert rec.close_group() == {"a", "b"}
    assert rec.bytes_written_last == 440
    assert rec.write_order_last == ["b", "a"]
    assert rec.first_touch == ["c", "b", "a"]


def test_transfer_queue_moves_each_once_foreground_first():
    moved, lock = [], threading.Lock()

    def move(name, fg):
        time.sleep(0.002)
        with lock:
            moved.append((name, fg))

    q = TransferQueue([f"o{i}" for i in range(30)], move, throttle_s=0.002)
    q.prioritize(["o29"])
    q.start()
    q.ensure("o20")
    q.join()
    names = [n for n, _ in moved]
    assert sorted(names) == sorted(f"o{i}" for i in range(30)) and len(names) == 30
    assert q.background[0] == "o29", "prioritized names go first in the background order"
    assert ("o20", True) in moved or "o20" in q.background
    assert set(q.foreground) | set(q.background) == set(names)
    assert q.done()


def test_transfer_queue_ensure_many_claims_a_group_and_waits_for_the_movers_one():
    """An op's write set: the PENDING names are moved by ONE ``move_many`` call on the caller's
    thread; a name the background mover holds is waited for, not moved again."""
    held, release = threading.Event(), threading.Event()
    moved, lock = [], threading.Lock()

    def move(name, fg):
        if not fg and name == "o0":
            held.set()
            release.wait(10)
        with lock:
            moved.append((name, fg))

    def move_many(names, fg):
        with lock:
            moved.append((tuple(names), fg))

    q = TransferQueue([f"o{i}" for i in range(6)], move, move_many=move_many)
    q.start()
    assert held.wait(10)  # the mover holds o0 (MOVING) and nothing else yet
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("claimed", q.ensure_many(["o3", "o0", "o2", "o3"])))
    t.start()
    t.join(0.2)
    assert t.is_alive(), "ensure_many returned while o0, in its write set, was still being moved"
    with lock:
        assert moved == [(("o3", "o2"), True)], "the PENDING ones moved together, once, at once"
    release.set()
    t.join(10)
    assert not t.is_alive() and out["claimed"] == ["o3", "o2"]
    q.join()
    names = [n for entry, _ in moved for n in (entry if isinstance(entry, tuple) else (entry,))]
    assert sorted(names) == sorted(f"o{i}" for i in range(6)), "every object moved exactly once"
    assert q.foreground == ["o3", "o2"] and "o0" in q.background and q.done() and q.left == 0
    assert q.ensure_many(["o1", "nope"]) == [], "DONE and unknown names need nothing"


def test_runner_moves_queue_after_queue_on_one_thread():
    """A checkpointer's flights share one copier thread: starting a queue creates no thread."""
    threads = []

    def move(name, fg):
        threads.append((name, threading.current_thread().name))

    runner = Runner("test-copier")
    runner.ensure_started()
    before = threading.active_count()
    for i in range(3):
        q = TransferQueue([f"q{i}.a", f"q{i}.b"], move)
        q.start(runner)
        assert threading.active_count() == before, "no thread started per queue"
        q.join()
        assert q.done() and q.background == [f"q{i}.a", f"q{i}.b"]
    assert {t for _, t in threads} == {"test-copier"} and len(threads) == 6
    thread = runner._thread
    runner.stop()
    thread.join(5)
    assert not thread.is_alive(), "stop() ends the idle thread"
    q = TransferQueue(["late"], move)
    q.start(runner)  # a later queue gets a new thread
    q.join()
    assert q.done() and threads[-1] == ("late", "test-copier")
    runner.stop()
