"""Live migration to another daemon: pre-copy while running, short cut-over, on-demand at the destination."""
from __future__ import annotations

import os

import pytest
import torch

import gpu_anchor
from gpu_anchor.checkpoint.migrate import Migration
from gpu_anchor.checkpoint.restore import incomplete
from gpu_anchor.testing.workload import Job
from gpu_anchor.checkpoint.writeset import WriteSetTracker
from gpu_anchor.client import control

@pytest.fixture
def second_daemon(host_daemon, tmp_path):
    path = os.path.join(os.environ["GPU_ANCHOR_SOCKET_DIR"], "other.sock")
    proc = control.start("cpu", path)
    yield path
    control.stop("cpu", path)
    proc.wait(timeout=10)


def test_live_migration_continues_bit_exact_on_the_destination(second_daemon):
    src = gpu_anchor.connect("cpu", namespace="job")
    job, tracker = Job(src), WriteSetTracker()
    with pytest.raises(ValueError, match="same daemon"):
        Migration([src], tracker, {"cpu": "cpu"})
    m = Migration([src], tracker, {"cpu": "cpu"}, socket_paths={"cpu": second_daemon}, throttle_s=0.005)
    s = 0
    with tracker:
        while s < 3 or not m.ready():  # the job keeps training until the pre-copy is through
            s += 1
            job.step(s)
            job.commit(s)
            if s == 3:
                m.start(s)
            assert s < 10000
    cut, final = s, s + 3
    assert cut > 3, "the job ran on during the pre-copy"
    restore = m.cutover(cut, background=False)  # loads only on demand (and at wait): deterministic to check
    assert m.result.policy == "recopy" and m.result.step == cut and m.downtime_s is not None
    dst = gpu_anchor.connect("cpu", namespace="job", socket=second_daemon)
    assert incomplete(dst) == cut
    moved = Job(dst)
    assert moved.committed_step() == cut
    assert not restore.queue.foreground, "the destination job is built with nothing loaded yet"
    with tracker:
        for s in range(cut + 1, final + 1):
            moved.step(s)
            moved.commit(s)
    assert len(restore.queue.foreground) == m.result.objects, "every object was loaded by the op that needed it"
    restore.wait()
    assert incomplete(dst) is None
    assert int(src.journal.get("gpu_anchor/step")) == cut, "the source is left intact until dropped"

    ref = Job(gpu_anchor.connect("cpu", namespace="ref"))
    for s in range(1, final + 1):
        ref.step(s)
        ref.commit(s)
    want, got = ref.snapshot(), moved.snapshot()
    assert not [k for k in want if not torch.equal(want[k], got[k])]
