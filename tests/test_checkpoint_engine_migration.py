"""Serving-engine migration between two real host daemons while requests are in flight.

In process: an engine on daemon A serves 10 requests; mid-generation it is pre-copied,
cut over and rebuilt on daemon B, which restores every sequence (KV included, no
prefill recomputed) and loads objects on demand.  End to end: ``gpu-anchor migrate``
against ``gpu-anchor serve`` with ≥ 8 open streams.  Both end by comparing every
request's output with a fault-free run.
"""
from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time

import pytest

from gpu_anchor.daemon import control
from gpu_anchor.serve.tiny import make_tiny_model

CFG = dict(dtype="float64", block_size=4, num_blocks=600, max_batched_tokens=32, max_model_len=512, cpu_threads=1)


@pytest.fixture
def two_daemons(host_daemon):
    other = os.path.join(os.environ["GPU_ANCHOR_SOCKET_DIR"], "other-host.sock")
    proc = control.start("cpu", other)
    yield host_daemon[0], other
    control.stop("cpu", other)
    proc.wait(timeout=10)


def _jobs(n=10, seed=0):
    from gpu_anchor.serve.sequence import SamplingParams
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(3, 380) for _ in range(rng.randint(3, 20))]
        p = SamplingParams(max_tokens=rng.randint(30, 60), temperature=0.0 if i % 2 == 0 else 0.9,
                           seed=100 + i, top_p=0.95 if i % 2 else 1.0)
        out.append((prompt, p))
    return out


def test_engine_migrates_between_host_daemons_mid_generation(tmp_path, two_daemons):
    from gpu_anchor.checkpoint.engine_migration import EngineMigration
    from gpu_anchor.serve.engine import Engine, EngineConfig
    from gpu_anchor.serve.sequence import SamplingParams
    src, dst = two_daemons
    model = make_tiny_model(str(tmp_path / "tiny"), "qwen3", seed=3)
    jobs = _jobs()
    ref = Engine(EngineConfig(model=model, anchor=False, **CFG)).generate(
        [j[0] for j in jobs], [SamplingParams(**j[1].to_dict()) for j in jobs])

    eng = Engine(EngineConfig(model=model, namespace="srv", socket=src, **CFG))
    out = {f"r{i}": [] for i in range(len(jobs))}

    def publish(events):
        for rid, i, ids, _ in events:
            assert i == len(out[rid]), "tokens arrive in order, none twice"
            out[rid] += ids

    for i, (prompt, p) in enumerate(jobs[:8]):
        publish(eng.add_request(f"r{i}", prompt, SamplingParams(**p.to_dict())))
    for _ in range(6):
        publish(eng.step())
    mig = EngineMigration(eng, "cpu", socket=dst, throttle_s=0.002)
    with pytest.raises(ValueError, match="same daemon"):
        EngineMigration(eng, "cpu")
    mig.start()
    n = 0
    while not mig.ready():
        publish(eng.step())
        n += 1
        assert n < 500
    assert n > 0, "the engine kept serving during the pre-copy"
    for i in (8, 9):                    # queued, never committed by the old engine: carried over
        publish(eng.add_request(f"r{i}", jobs[i][0], SamplingParams(**jobs[i][1].to_dict())))
    eng, events = mig.cutover()
    publish(events)
    assert mig.placement["socket"] == src, "the source stays authoritative until the restore is done"
    assert mig.stats["restored"] == 8 and mig.stats["carried"] == 2
    assert any(s.num_computed > 0 for s in eng.restored), "KV came along: no prefill recomputed"
    while eng.has_work():
        publish(eng.step())
        mig.poll()
    stats = mig.finish()
    assert mig.placement == {"device": "cpu", "socket": dst}
    assert stats["on_demand_objects"] > 0
    assert [out[f"r{i}"] for i in range(len(jobs))] == ref
    import gpu_anchor
    assert gpu_anchor.connect("cpu", namespace="srv", socket=src).names() == [], "the source was dropped"
