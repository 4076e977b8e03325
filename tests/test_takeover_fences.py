"""The two fences a hot takeover passes before it reads the dead engine's state.

- the daemon's ``await_gone``: a successor's journal read cannot miss a commit the dead
  process sent whole, and a torn last frame is never applied;
- the step fence (``serve/step_fence.py``): its words, and ``quiesce`` falling back to the
  process's exit when the last step's marker never comes;
- the writers' robust mutexes (``runtime/liveness.py``), which say a killed process's writer
  threads are gone well before its descriptors close, and the daemon's ``drain`` that then
  handles what it sent.  Its device marker (a stream memory
  operation) is tested on the GPU (``test_gpu_step_fence_marker_follows_the_step``).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading

import pytest

import gpu_anchor
from gpu_anchor import errors, protocol
from gpu_anchor.client import control
from gpu_anchor.client.channel import Channel
from gpu_anchor.runtime.liveness import Liveness
from gpu_anchor.serve.step_fence import DEVICE, StepFence

FORK = mp.get_context("fork")


def _sender(path: str, conn) -> None:
    """Two connections; on one, a whole journal commit and half of the next, sent without
    waiting for a reply; then blocks until killed."""
    c = gpu_anchor.connect("cpu", namespace="fence", socket=path)
    c.journal.put("k", b"1")
    ch = Channel("cpu", path)
    whole = protocol.encode({"op": "journal_commit", "namespace": "fence", "puts": protocol.pack_blobs({"k": b"2"})[0], "deletes": []},
                            protocol.pack_blobs({"k": b"2"})[1])
    torn = protocol.encode({"op": "journal_commit", "namespace": "fence", "puts": protocol.pack_blobs({"k": b"3"})[0], "deletes": []},
                           protocol.pack_blobs({"k": b"3"})[1])
    ch._sock.sendall(whole + torn[: len(torn) // 2])
    conn.send("sent")
    conn.recv()          # killed here
    del c


def test_await_gone_returns_after_the_dead_process_last_whole_commit(host_daemon):
    path = host_daemon[0]
    parent, child = FORK.Pipe()
    p = FORK.Process(target=_sender, args=(path, child), daemon=True)
    p.start()
    assert parent.poll(60) and parent.recv() == "sent"
    done = threading.Event()
    failure = []

    def wait():
        try:
            control.await_gone("cpu", path, p.pid, timeout=60)
        except Exception as e:       # reported below
            failure.append(e)
        done.set()

    t = threading.Thread(target=wait)
    t.start()
    # while the process lives (and holds its connections) there is no answer
    assert not done.wait(0.3)
    os.kill(p.pid, signal.SIGKILL)
    assert done.wait(60), "await_gone did not return after the process died"
    t.join()
    p.join()
    assert not failure, failure
    c = gpu_anchor.connect("cpu", namespace="fence", socket=path)
    assert c.journal.get("k") == b"2"      # the whole frame landed, the torn one did not


def _marked_sender(path: str, page, slot: int, conn, lifeline: int) -> None:
    """``_sender`` whose two threads hold their writers' mutexes, with 256 MiB of its own to
    unmap at its exit (so its descriptors, the lifeline among them, close late)."""
    lv = Liveness(page)
    lv.hold(slot, 0)
    threading.Thread(target=lambda: (lv.hold(slot, 1), threading.Event().wait()), daemon=True).start()
    big = bytearray(256 << 20)
    for i in range(0, len(big), 4096):
        big[i] = 1
    while not lv.held(slot):
        threading.Event().wait(0.001)
    _sender(path, conn)


def test_writers_gone_then_drain_sees_the_dead_process_last_whole_commit(host_daemon):
    """The successor's faster path: the robust mutexes say every writer thread is dead (at the
    start of the kernel's exit, before the process's memory is unmapped and its descriptors
    closed), then ``drain`` handles what it sent: the whole frame lands, the torn one never."""
    import time
    path = host_daemon[0]
    lv = Liveness()
    slot = lv.arm()
    life_r, life_w = os.pipe()
    parent, child = FORK.Pipe()
    p = FORK.Process(target=_marked_sender, args=(path, lv.page, slot, child, life_w), daemon=True)
    p.start()
    os.close(life_w)
    assert parent.poll(60) and parent.recv() == "sent"
    gone, seen = threading.Event(), {}

    def watch():
        seen["result"] = lv.writers_gone(slot)
        seen["writers"] = time.perf_counter()
        gone.set()
    t = threading.Thread(target=watch)
    t.start()
    assert not gone.wait(0.3)                  # its writers live: no answer
    t0 = time.perf_counter()
    os.kill(p.pid, signal.SIGKILL)
    assert gone.wait(60) and seen["result"] is True
    torn = control.drain("cpu", path, p.pid)
    os.read(life_r, 1)                         # its descriptors closed (end of file)
    eof = time.perf_counter()
    p.join()
    c = gpu_anchor.connect("cpu", namespace="fence", socket=path)
    assert c.journal.get("k") == b"2"          # the whole frame landed, the torn one did not
    assert torn >= 0
    print(f"writers gone {1e3 * (seen['writers'] - t0):.2f} ms, descriptors closed {1e3 * (eof - t0):.2f} ms "
          f"after the kill; {torn} torn bytes drained")


def _half_marked(page, slot: int, conn) -> None:
    Liveness(page).hold(slot, 0)               # its second writer never takes its mutex
    conn.send("held")
    conn.recv()


def test_writers_gone_knows_nothing_of_a_process_that_did_not_mark_every_writer():
    lv = Liveness()
    slot = lv.arm()
    parent, child = FORK.Pipe()
    p = FORK.Process(target=_half_marked, args=(lv.page, slot, child), daemon=True)
    p.start()
    assert parent.poll(30) and parent.recv() == "held"
    assert lv.writers_gone(slot) is False      # at once: wait for the lifeline instead
    p.kill()
    p.join()
    assert lv.arm() != slot and not lv.held(slot)


def test_await_gone_of_a_process_without_connections_returns_at_once(host_daemon):
    path = host_daemon[0]
    p = FORK.Process(target=os._exit, args=(0,))
    p.start()
    p.join()
    control.await_gone("cpu", path, p.pid, timeout=10)


@pytest.mark.parametrize("pid, why", [(0, "positive integer"), ("12", "positive integer"), (True, "positive integer"),
                                      (None, "positive integer"), ("self", "its own departure")])
@pytest.mark.parametrize("op", ["await_gone", "drain"])
def test_await_gone_and_drain_refuse_bad_pids(host_daemon, pid, why, op):
    ch = Channel("cpu", host_daemon[0])
    try:
        with pytest.raises(errors.BadRequest, match=why):
            ch.request({"op": op, "pid": os.getpid() if pid == "self" else pid})
        assert ch.request({"op": "ping"})[0]["ok"]      # the connection still serves
    finally:
        ch.close()


def _fence_child(page, mode: str, conn) -> None:
    f = StepFence(page)
    if mode == "device":           # as a CUDA engine: the marker comes from a stream, later
        f._words[2] = DEVICE
    elif mode == "cpu":
        f.host_only()
    f.launching()
    if mode == "cpu":
        f.launched_all(None)       # a CPU step's writes are done when it returns
        f.launching()              # killed in the middle of the next one
    conn.send("in step")
    conn.recv()


@pytest.mark.parametrize("mode, expect", [("cpu", "fence"), ("device", "exit"), ("unmarked", "exit")])
def test_quiesce_waits_for_the_marker_or_the_exit(mode, expect):
    fence = StepFence()
    parent, child = FORK.Pipe()
    p = FORK.Process(target=_fence_child, args=(fence.page, mode, child), daemon=True)
    p.start()
    assert parent.poll(30) and parent.recv() == "in step"
    launched, done = fence.state()
    assert launched == done + 1
    # a CPU engine queues no device work: its death is enough; a device engine whose marker
    # never came, or an engine that does not mark, is waited for until its process exits
    assert fence.quiet() is (mode == "cpu")
    os.kill(p.pid, signal.SIGKILL)
    assert fence.quiesce(p.pid, timeout=60) == expect
    p.join()
    assert fence.quiesce(p.pid, timeout=1) in ("fence", "exit")     # reaped: at once


def test_quiesce_returns_at_the_marker_of_the_last_launched_step():
    fence = StepFence()
    fence._words[2] = DEVICE
    fence.launching()
    fence.launching()
    fence._words[1] = fence.state()[0] - 1       # the marker of the step before the last
    assert not fence.quiet()
    fence._words[1] = fence.state()[0]           # the last step's marker arrived
    assert fence.quiet()
    assert fence.quiesce(os.getpid(), timeout=1) == "fence"


@pytest.mark.gpu
def test_gpu_step_fence_marker_follows_the_step():
    """On a GPU the marker is written by the stream after the step's kernels, not by the host."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    torch.empty(1, device="cuda")
    fence = StepFence()
    fence.register_device()
    stream = torch.cuda.current_stream().cuda_stream
    for _ in range(3):
        fence.launching()
        torch.cuda._sleep(1 << 30)          # a kernel that runs for a long while (~0.5 s on an H200)
        fence.launched_all(stream)
        assert not fence.quiet(), "the marker arrived before the step's kernel finished"
        torch.cuda.synchronize()
        assert fence.quiet()
        launched, done = fence.state()
        assert launched == done
