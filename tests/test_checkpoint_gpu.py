"""Concurrent checkpoint, on-demand restore and the guard on a CUDA daemon (H200).

Same claims as the CPU tests, on device memory: the concurrent checkpoint (with
GPU-side copy-on-write buffers and the low-priority side stream) equals a
stop-the-world one bit for bit; on-demand restore continues like full restore;
the guard rolls back an abandoned group.  Run: ``pytest -m gpu tests/test_checkpoint_gpu.py``.
"""
from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

import gpu_anchor
from gpu_anchor.checkpoint import restore as od
from gpu_anchor.checkpoint.concurrent import ConcurrentCheckpointer
from gpu_anchor.checkpoint.guard import GroupGuard
from gpu_anchor.testing.workload import Job
from gpu_anchor.checkpoint.writeset import WriteSetTracker
from gpu_anchor.checkpoint import snapshot
from gpu_anchor.journal_keys import STEP_KEY
from gpu_anchor.checkpoint.format import step_dir

pytestmark = pytest.mark.gpu
STEPS, AT, H = 7, 3, 512


def _file(directory, step):
    rdir = os.path.join(step_dir(directory, step), "rank0")
    return load_file(os.path.join(rdir, "cuda0.safetensors"))


def _same(a, b):
    assert sorted(a) == sorted(b)
    bad = [k for k in a if not torch.equal(a[k].cpu(), b[k].cpu())]
    assert not bad, bad


def _run(ns, directory, policy, throttle_s=0.01, steps=STEPS):
    client = gpu_anchor.connect("cuda:0", namespace=ns)
    job, tracker = Job(client, hidden=H, layers=4, batch=64), WriteSetTracker()
    ckpt = ConcurrentCheckpointer([client], directory, tracker, policy=policy, throttle_s=throttle_s)
    states = {}
    with tracker:
        for s in range(1, steps + 1):
            job.step(s)
            job.commit(s)
            torch.cuda.synchronize()
            states[s] = job.snapshot()
            if policy == "stw" and s == AT:
                ckpt.stop_the_world(s)
            elif policy != "stw":
                ckpt.boundary(s, due=s == AT)
    ckpt.finish(steps)
    return ckpt.results, states


def test_gpu_concurrent_cow_and_recopy_equal_stop_the_world(cuda_daemon, tmp_path):
    (stw,), ref = _run("stw", str(tmp_path / "stw"), "stw")
    (cow,), _ = _run("cow", str(tmp_path / "cow"), "cow")
    assert cow.valid and cow.policy == "cow" and cow.step == AT
    assert cow.gpu_buffered > 0, "soft CoW copied into GPU-side buffers"
    _same(_file(str(tmp_path / "cow"), AT), _file(str(tmp_path / "stw"), AT))
    _same(_file(str(tmp_path / "cow"), AT), ref[AT])
    (rc,), _ = _run("rc", str(tmp_path / "rc"), "recopy")
    assert rc.valid and rc.step > AT and rc.recopied
    _same(_file(str(tmp_path / "rc"), rc.step), ref[rc.step])


def test_gpu_device_snapshot_equals_stop_the_world_without_tracking(cuda_daemon, tmp_path):
    """``device``: every object cloned on the GPU at start (it fits), so no op is tracked, and the
    checkpoint still equals stop-the-world bit for bit."""
    (stw,), ref = _run("stw", str(tmp_path / "stw"), "stw")
    client = gpu_anchor.connect("cuda:0", namespace="dev")
    job, tracker = Job(client, hidden=H, layers=4, batch=64), WriteSetTracker()
    ckpt = ConcurrentCheckpointer([client], str(tmp_path / "dev"), tracker, policy="device", throttle_s=0.01)
    with tracker:
        for s in range(1, STEPS + 1):
            job.step(s)
            job.commit(s)
            ckpt.boundary(s, due=s == AT)
            assert not tracker.active and tracker.ops_seen == 0, "nothing to track: nothing installed"
    res = ckpt.finish(STEPS)
    assert res.valid and res.policy == "device" and res.step == AT
    assert res.gpu_buffered == res.objects and not res.cow_foreground
    _same(_file(str(tmp_path / "dev"), AT), _file(str(tmp_path / "stw"), AT))
    _same(_file(str(tmp_path / "dev"), AT), ref[AT])


def test_gpu_on_demand_restore_equals_full_restore(cuda_daemon, tmp_path):
    ckdir = str(tmp_path / "ck")
    _, ref = _run("job", ckdir, "cow")

    def cont(tracker=None):
        job = Job(gpu_anchor.connect("cuda:0", namespace="job"), hidden=H, layers=4, batch=64)
        assert job.committed_step() == AT
        with tracker if tracker is not None else torch.enable_grad():
            for s in range(AT + 1, STEPS + 1):
                job.step(s)
                job.commit(s)
        torch.cuda.synchronize()
        return job.snapshot()

    gpu_anchor.connect("cuda:0", namespace="job").drop_namespace()
    snapshot.restore(ckdir, AT, 0)
    full = cont()
    gpu_anchor.connect("cuda:0", namespace="job").drop_namespace()
    tracker = WriteSetTracker()
    r = od.OnDemandRestore(ckdir, tracker, step=AT, throttle_s=0.05).start()
    lazy = cont(tracker)
    stats = r.wait()
    _same(full, ref[STEPS])
    _same(lazy, full)
    assert stats["on_demand"]


def test_gpu_guard_rolls_back_an_abandoned_group(cuda_daemon):
    client = gpu_anchor.connect("cuda:0", namespace="g")
    job, tracker = Job(client, hidden=H, layers=3, in_backward=True), WriteSetTracker()
    guard = GroupGuard(client, tracker, job.tensors())
    with tracker:
        for s in (1, 2):
            guard.begin(s)
            job.step(s)
            guard.commit({STEP_KEY: b"%d" % s})
        torch.cuda.synchronize()
        want = job.snapshot()
        guard.begin(3)
        job.step(3)  # the "crash": the group is never committed
    torch.cuda.synchronize()
    assert any(not torch.equal(want[k], v) for k, v in job.snapshot().items())
    guard.close()
    fresh = GroupGuard(client, WriteSetTracker(), job.tensors())
    rolled = fresh.recover()
    assert len(rolled) == len(want)
    _same(job.snapshot(), want)
    assert job.committed_step() == 2


def test_gpu_migration_cuda0_to_cuda1(cuda_daemon, tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    from gpu_anchor.checkpoint.migrate import Migration
    from gpu_anchor.client import control
    path = os.path.join(os.environ["GPU_ANCHOR_SOCKET_DIR"], "cuda1.sock")
    proc = control.start("cuda:1", path)
    try:
        src = gpu_anchor.connect("cuda:0", namespace="job")
        job, tracker = Job(src, hidden=H, layers=4, batch=64), WriteSetTracker()
        m = Migration([src], tracker, {"cuda:0": "cuda:1"}, socket_paths={"cuda:1": path}, throttle_s=0.005)
        s = 0
        with tracker:
            while s < 2 or not m.ready():  # train on until the pre-copy is through
                s += 1
                job.step(s)
                job.commit(s)
                torch.cuda.synchronize()
                if s == 2:
                    m.start(s)
                assert s < 100000
        cut, final = s, s + 3
        restore = m.cutover(cut)
        with torch.cuda.device(1):
            moved = Job(gpu_anchor.connect("cuda:1", namespace="job", socket=path), hidden=H, layers=4, batch=64)
            assert moved.committed_step() == cut
            with tracker:
                for s in range(cut + 1, final + 1):
                    moved.step(s)
                    moved.commit(s)
            torch.cuda.synchronize()
        restore.wait()
        plain = Job(gpu_anchor.connect("cuda:0", namespace="ref"), hidden=H, layers=4, batch=64)
        for s in range(1, final + 1):
            plain.step(s)
            plain.commit(s)
        _same(moved.snapshot(), plain.snapshot())
        assert m.downtime_s is not None and m.result.policy == "recopy"
    finally:
        control.stop("cuda:1", path)
        proc.wait(timeout=30)


def test_gpu_serving_engine_migrates_cuda0_to_cuda1(cuda_daemon, tmp_path):
    """A serving engine (CUDA graphs on) moves to cuda:1 with 12 requests mid-generation;
    every request's tokens equal a fault-free run on cuda:0."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    import random

    from gpu_anchor.checkpoint import migrate
    from gpu_anchor.serve.migration import EngineMigration, provide
    provide(migrate)     # what gpu-anchor serve does for its engines
    from gpu_anchor.client import control
    from gpu_anchor.serve.engine import Engine, EngineConfig
    from gpu_anchor.serve.sequence import SamplingParams
    from gpu_anchor.testing.tiny import make_tiny_model
    model = make_tiny_model(str(tmp_path / "tiny"), "qwen3", seed=3)
    path = os.path.join(os.environ["GPU_ANCHOR_SOCKET_DIR"], "cuda1.sock")
    proc = control.start("cuda:1", path)
    rng = random.Random(0)
    jobs = [([rng.randrange(3, 380) for _ in range(rng.randint(5, 40))],
             SamplingParams(max_tokens=rng.randint(40, 80), temperature=0.0 if i % 2 else 0.8, seed=i))
            for i in range(12)]
    cfg = dict(model=model, dtype="float32", block_size=16, num_blocks=256, max_model_len=256)
    try:
        ref = Engine(EngineConfig(anchor=False, device="cuda:0", **cfg)).generate(
            [p for p, _ in jobs], [SamplingParams(**sp.to_dict()) for _, sp in jobs])
        eng = Engine(EngineConfig(device="cuda:0", namespace="srv", **cfg))
        out = {f"r{i}": [] for i in range(len(jobs))}

        def publish(events):
            for rid, i, ids, _ in events:
                out[rid][i:] = ids
        for i, (p, sp) in enumerate(jobs):
            eng.add_request(f"r{i}", p, SamplingParams(**sp.to_dict()))
        for _ in range(8):
            publish(eng.step())
        mig = EngineMigration(eng, "cuda:1", socket=path)
        mig.start()
        while not mig.ready():
            publish(eng.step())
        publish(eng.flush())
        eng = None
        new, events = mig.cutover()
        publish(events)
        assert new.device == torch.device("cuda:1") and mig.stats["restored"] == 12
        while new.has_work():
            publish(new.step())
            mig.poll()
        mig.finish()
        assert mig.placement == {"device": "cuda:1", "socket": path}
        assert [out[f"r{i}"] for i in range(len(jobs))] == ref
    finally:
        control.stop("cuda:1", path)
        proc.wait(timeout=30)
