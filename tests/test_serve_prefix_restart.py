"""The prefix cache across engine restarts: the blocks cached when an engine died are found again
by the next one (their records in the journal: ``block_manager.py``, "Cached blocks across a
restart"), and none is trusted that a step of the dead engine may have written.

The campaign SIGKILLs engines at every phase over requests sharing a system prompt, with a KV
cache small enough that cached blocks are reused every few steps (each reuse of a recorded block
first deletes its record).  After each restart, the KV of every block the new engine trusts is
compared with the KV the fault-free run computed for the same digest: a block written by the dead
engine's last steps would hold other tokens' KV.  The streams end as the fault-free run's.
Also: an engine migrated to another daemon and a hot standby's take-over find the blocks; on
CUDA (marked ``gpu``), an engine SIGKILLed mid decode after it reused recorded blocks."""
from __future__ import annotations

import dataclasses
import os
import random
import signal
import time

import pytest
import torch

from gpu_anchor.serve import block_manager
from gpu_anchor.serve.block_manager import BlockManager
from gpu_anchor.serve.engine import Engine, EngineConfig
from gpu_anchor.serve.sequence import SamplingParams
from gpu_anchor.testing.tiny import make_tiny_model
from test_serve_engine import PHASES, Client, _ctx

SYSTEM = [(7 * i) % 370 + 5 for i in range(37)]       # a "system prompt" of 37 tokens (9 full blocks)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("m") / "qwen3"), "qwen3", seed=3)


def _cfg(model, **kw):
    return EngineConfig(model=model, dtype="float64", block_size=4, num_blocks=32, max_batched_tokens=16,
                        max_num_seqs=3, cpu_threads=1, **kw)


def _requests(n=8, seed=4):
    rng = random.Random(seed)
    return {f"r{i}": (SYSTEM + [rng.randrange(3, 380) for _ in range(rng.randint(1, 12))],
                      SamplingParams(max_tokens=14, ignore_eos=True)) for i in range(n)}


def _block_kv(eng, b: int):
    return torch.stack([kv[:, b] for kv in eng.model.kv]).clone()


def _incarnation(cfg, client, conn):
    """An engine's life: restore, report the KV of every cached block it trusts, re-add what the
    client still waits for, step until done (or killed)."""
    eng = Engine(cfg)
    # by value (numpy): a tensor would cross as a descriptor that the parent fetches from this
    # process later, which fails once a fault has killed it (FileNotFoundError, seen in CI)
    trusted = {d: _block_kv(eng, b).numpy() for b, d in eng.blocks._digest.items() if b in eng.blocks._cached}
    msgs = [("trusted", trusted)] + [("ev", (s.rid, 0, s.output_ids, None)) for s in eng.restored]
    for rid in client.pending({s.rid for s in eng.restored}):
        prompt, params = client.requests[rid]
        msgs += [("ev", e) for e in eng.add_request(rid, prompt, SamplingParams(**params.to_dict()), client.out[rid])]
    conn.send(msgs)
    while eng.has_work():
        events = eng.step()
        conn.send([("ev", e) for e in events] + [("hits", eng.scheduler.prefix_hits),
                                                  ("unrecorded", eng.blocks.unrecorded)])


def _run(cfg, client, fault=None):
    """One incarnation in a fresh process; ``(exit code, {digest: KV it trusted}, prefix hits, unrecords)``."""
    a, b = _ctx().Pipe()
    p = _ctx().Process(target=_incarnation, args=(EngineConfig(**dict(cfg.__dict__, fault=fault)), client, b))
    p.start()
    b.close()
    trusted, hits, unrecorded = {}, 0, 0
    while True:
        try:
            batch = a.recv()
        except (EOFError, ConnectionResetError):       # the engine was SIGKILLed
            break
        for kind, x in batch:
            if kind == "ev":
                client.apply(*x)
            elif kind == "trusted":
                trusted = {d: torch.from_numpy(kv) for d, kv in x.items()}
            elif kind == "hits":
                hits = x
            elif kind == "unrecorded":
                unrecorded = x
    p.join()
    return p.exitcode, trusted, hits, unrecorded


def test_cached_blocks_are_found_again_after_a_sigkill_and_none_a_dead_step_wrote(model, host_daemon):
    reqs = _requests()
    # the fault-free run, in this process: the KV of every digest, read after the step that wrote it
    ref_eng = Engine(_cfg(model, anchor=False))
    ref = Client(reqs)
    for rid, (p, sp) in reqs.items():
        ref_eng.add_request(rid, p, SamplingParams(**sp.to_dict()))
    known: dict[bytes, torch.Tensor] = {}
    while ref_eng.has_work():
        for e in ref_eng.step():
            ref.apply(*e)
        for b, d in ref_eng.blocks._digest.items():
            known.setdefault(d, _block_kv(ref_eng, b))
    assert len(ref.done) == len(reqs)
    cfg = _cfg(model, socket=host_daemon[0], namespace="pc-restart")
    rng = random.Random(11)
    kills = {ph: 0 for ph in PHASES}
    found, hits_after, unrecords, wave = 0, 0, 0, 0
    while sum(kills.values()) < 24 or wave < 2:
        client = Client({f"w{wave}-{rid}": v for rid, v in reqs.items()})
        while len(client.done) < len(reqs):
            fault = (rng.randint(0, 12), rng.choice(PHASES)) if sum(kills.values()) < 24 else None
            code, trusted, hits, unrecorded = _run(cfg, client, fault)
            for d, kv in trusted.items():
                assert d in known, "a trusted block's digest names no prefix of the fault-free run"
                assert torch.allclose(kv, known[d], rtol=1e-9, atol=1e-12), \
                    f"a trusted cached block holds other KV than its digest's (after a kill at {fault})"
            found += len(trusted)
            hits_after += hits if trusted else 0
            unrecords += unrecorded
            if code == -9:
                kills[fault[1]] += 1
            else:
                assert code == 0
        assert client.mismatch == 0
        assert [client.out[f"w{wave}-{rid}"] for rid in reqs] == [ref.out[rid] for rid in reqs]
        wave += 1
    assert all(kills.values()), kills
    # not vacuous: blocks were found again and taken by later requests, and recorded blocks reused
    assert found > 0 and hits_after > 0 and unrecords > 0, (found, hits_after, unrecords)


def test_a_block_is_written_only_once_no_record_of_it_remains():
    """The block manager alone, its records kept in a model journal: cached blocks reused, a
    history taken back over a recorded block, then a restart's adoption of the records."""
    journal: dict[int, bytes] = {}
    deleted = []

    def unrecord(blocks):
        deleted.append(list(blocks))
        for b in blocks:
            journal.pop(b, None)

    bm = BlockManager(8, 2, prefix_caching=True)
    bm.recording, bm.unrecord = True, unrecord
    t1, t2 = [], []
    bm.grow("a", t1, 6)                 # blocks 0, 1, 2
    for i, b in enumerate(t1):
        bm.register(b, bytes([i]) * 16)
    bm.release(t1)
    bm.on_commit()
    records = bm.take_records()
    assert [b for b, _ in records] == [0, 1, 2]
    journal.update(records)
    bm.grow("b", t2, 10)                # the 5 plain free blocks first, nothing recorded touched
    assert t2 == [3, 4, 5, 6, 7] and not deleted
    bm.grow("b", t2, 12)                # the least recently released cached block: its record goes first
    assert t2[-1] == 0 and deleted == [[0]] and sorted(journal) == [1, 2]   # (a sixteenth of 2 cached: no more)
    bm.check()
    # a restart: the records of the blocks no table holds are trusted, the others' kept or dropped
    bm2 = BlockManager(8, 2, prefix_caching=True)
    bm2.recording = True
    bm2.adopt({"x": [5]}, {"x": 0})
    stale = bm2.adopt_records([(1, b"\x01" * 16), (5, b"\x05" * 16), (9, b"\x09" * 16), (2, b"\x01" * 16)])
    assert stale == [5, 9, 2] and bm2.num_cached == 1 and bm2.lookup([b"\x01" * 16]) == [1]
    bm2.check()
    # a history taken back over a block recorded and held by one table alone
    bm3 = BlockManager(8, 2, prefix_caching=True)
    bm3.recording, bm3.unrecord = True, unrecord
    bm3.adopt({})
    assert bm3.adopt_records([(3, b"\x07" * 16)]) == []
    t3 = []
    bm3.share(t3, bm3.lookup([b"\x07" * 16]))
    bm3.grow("c", t3, 3)
    deleted.clear()
    assert bm3.writable_from(t3, 0) == 0 and deleted == [[3]] and bm3.num_cached == 0
    assert block_manager.UNRECORD_BATCH >= 1


def _gpu_first_engine(cfg, batches, conn):
    """On CUDA: the first batch to its end (the engine idle: its cached blocks recorded), then
    the second one, SIGKILLed in a decode step after it reused recorded blocks (``cfg.fault``, set
    far away, only installs the mid-forward hook)."""
    eng = Engine(cfg)
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    eng.generate(batches[0], sp)
    conn.send(("idle", eng.blocks.num_cached))
    eng.cfg = dataclasses.replace(eng.cfg, fault=(eng.steps + 8, "mid_decode"))
    eng.generate(batches[1], sp)
    conn.send(("not killed", eng.blocks.unrecorded))


@pytest.mark.gpu
def test_on_cuda_cached_blocks_are_found_again_after_a_sigkill(model, cuda_daemon):
    """On CUDA in bf16 with --deterministic's batch-invariant kernels (a block's KV does not
    depend on the batch it was computed in), CUDA graphs and asynchronous scheduling, anchored:
    an engine serves requests sharing one system prompt, goes idle, then serves requests on
    another one in a KV cache too small for both (recorded blocks reused) and is SIGKILLed mid
    decode.  The next engine trusts only blocks whose KV is bit for bit the fault-free engine's
    for their digest, and a request on the first system prompt, beside the six restored ones,
    takes the blocks found and gets the tokens of an engine without caching.  (The same test on
    the CPU in float64 with the emulated graph path passed before it ran on a GPU.)"""
    systems = [[(11 * i + k) % 370 + 5 for i in range(100)] for k in (0, 1)]
    batches = [[s + list(range(30 + i, 36 + 2 * i)) for i in range(6)] for s in systems]
    kw = dict(model=model, device="cuda:0", dtype="bfloat16", deterministic=True, block_size=16,
              num_blocks=30, max_batched_tokens=64, max_num_seqs=7)
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    ref = Engine(EngineConfig(**kw, anchor=False))
    known = {}
    for batch in batches:
        ref.generate(batch, sp)
        for b, d in ref.blocks._digest.items():
            known.setdefault(d, _block_kv(ref, b))
    cfg = EngineConfig(**kw, namespace="pc-restart-gpu", socket=cuda_daemon[0], fault=(10**9, "mid_decode"))
    a, b = _ctx().Pipe()
    p = _ctx().Process(target=_gpu_first_engine, args=(cfg, batches, b))
    p.start()
    b.close()
    said = []
    while True:
        try:
            said.append(a.recv())
        except (EOFError, ConnectionResetError):
            break
    p.join()
    assert p.exitcode == -9 and said[0][0] == "idle" and said[0][1] > 0, (p.exitcode, said)
    eng = Engine(dataclasses.replace(cfg, fault=None))
    trusted = {d: _block_kv(eng, b) for b, d in eng.blocks._digest.items() if b in eng.blocks._cached}
    # fewer than the idle engine's: the blocks the second batch reused lost their records first
    assert 0 < len(trusted) < said[0][1] and all(torch.equal(kv, known[d]) for d, kv in trusted.items())
    turn = systems[0] + [7, 8, 9]           # beside the killed engine's requests, restored
    eng.add_request("turn", turn, sp)
    got = []
    while eng.has_work():
        got += [t for rid, _, ids, _ in eng.step() if rid == "turn" for t in ids]
    off = Engine(EngineConfig(**kw, anchor=False, prefix_caching=False))
    assert eng.scheduler.cached_tokens["turn"] == 96 and [got] == off.generate([turn], sp)


def test_a_migrated_engine_finds_the_cached_blocks(model, tmp_path, host_daemon):
    """``EngineMigration`` to another daemon: the destination's engine finds the source's cached
    blocks (the journal's records came along with the KV), their KV equal to the source's, and a
    request on the same system prompt takes them and gets the tokens of an engine without caching."""
    from gpu_anchor.checkpoint import migrate
    from gpu_anchor.client import control
    from gpu_anchor.serve.migration import EngineMigration, provide
    provide(migrate)
    other = os.path.join(os.environ["GPU_ANCHOR_SOCKET_DIR"], "pc-other.sock")
    proc = control.start("cpu", other)
    try:
        sp = SamplingParams(max_tokens=8, ignore_eos=True)
        kw = dict(model=model, dtype="float64", block_size=4, num_blocks=64, max_batched_tokens=16, cpu_threads=1)
        src = Engine(EngineConfig(**kw, namespace="pc-migrate", socket=host_daemon[0]))
        src.generate([SYSTEM + [5, 6], SYSTEM + [7, 8, 9]], sp)          # idle: its cached blocks recorded
        cached = {d: _block_kv(src, b) for b, d in src.blocks._digest.items() if b in src.blocks._cached}
        assert len(cached) >= 9
        mig = EngineMigration(src, "cpu", socket=other, background=False)
        mig.start()
        deadline = time.time() + 120
        while not mig.ready():               # the pre-copy (the engine idle meanwhile)
            assert time.time() < deadline
            time.sleep(0.01)
        eng, _ = mig.cutover()
        found = {d: _block_kv(eng, b) for b, d in eng.blocks._digest.items() if b in eng.blocks._cached}
        assert found.keys() == cached.keys() and all(torch.equal(found[d], cached[d]) for d in found)
        hits = eng.scheduler.prefix_hits
        turn = SYSTEM + [11, 12, 13]
        got = eng.generate([turn], sp)
        assert eng.scheduler.prefix_hits - hits == 36
        mig.finish()
        assert got == Engine(EngineConfig(**kw, anchor=False, prefix_caching=False)).generate([turn], sp)
    finally:
        control.stop("cpu", other)
        proc.wait(timeout=10)


def _live_until_killed(cfg, prompts, conn):
    eng = Engine(cfg)
    eng.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    conn.send({d: _block_kv(eng, b) for b, d in eng.blocks._digest.items() if b in eng.blocks._cached})
    time.sleep(600)                      # SIGKILLed here, idle


def test_a_hot_standby_takes_over_the_cached_blocks(model, host_daemon):
    """A hot standby attached beside a live engine that went idle with cached blocks; the live
    engine is SIGKILLed; the standby's take-over finds those blocks, KV equal, and a request on
    the same system prompt takes them and gets the tokens of an engine without caching."""
    kw = dict(model=model, dtype="float64", block_size=4, num_blocks=64, max_batched_tokens=16, cpu_threads=1)
    cfg = EngineConfig(**kw, namespace="pc-standby", socket=host_daemon[0])
    a, b = _ctx().Pipe()
    live = _ctx().Process(target=_live_until_killed, args=(cfg, [SYSTEM + [5, 6], SYSTEM + [7, 8, 9]], b))
    live.start()
    try:
        assert a.poll(120), "the live engine did not finish"
        cached = a.recv()
        assert len(cached) >= 9
        hot = Engine(cfg, standby=True)
        os.kill(live.pid, signal.SIGKILL)
        live.join()
    finally:
        if live.is_alive():
            live.kill()
    hot.take_over()
    found = {d: _block_kv(hot, b) for b, d in hot.blocks._digest.items() if b in hot.blocks._cached}
    assert found.keys() == cached.keys() and all(torch.equal(found[d], cached[d]) for d in found)
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    turn = SYSTEM + [11, 12, 13]
    got = hot.generate([turn], sp)
    assert hot.scheduler.prefix_hits == 36
    assert got == Engine(EngineConfig(**kw, anchor=False, prefix_caching=False)).generate([turn], sp)


def test_the_kv_memory_baseline_keeps_the_cached_blocks_across_a_restart(model, tmp_path, monkeypatch):
    """bench's KV-memory baseline (each step's KV mirrored in host memory, copied back at a
    restart): an engine on it goes idle with cached blocks and is closed; the next engine on the
    same state copies back the cached blocks the journal records beside the live ones, trusts
    them with the KV the first one computed, and a request on the same system prompt takes them
    and gets the tokens of an engine without caching.  So its benchmark rows keep the prefix
    cache across a restart, as gpu-anchor's do."""
    import gpu_anchor.serve.engine as E
    from bench.baselines.kv_memory import KVMemoryAnchor
    monkeypatch.setattr(KVMemoryAnchor, "model_dir", model)
    monkeypatch.setattr(KVMemoryAnchor, "state_dir", str(tmp_path))
    monkeypatch.setattr(E, "Anchor", KVMemoryAnchor)
    kw = dict(model=model, dtype="float64", block_size=4, num_blocks=64, max_batched_tokens=16, cpu_threads=1,
              anchor=False)
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    src = Engine(EngineConfig(**kw))
    src.anchor.attach(src)
    src.generate([SYSTEM + [5, 6], SYSTEM + [7, 8, 9]], sp)          # idle: its cached blocks recorded
    cached = {d: _block_kv(src, b) for b, d in src.blocks._digest.items() if b in src.blocks._cached}
    assert len(cached) >= 9
    src.close()
    eng = Engine(EngineConfig(**kw))
    eng.anchor.attach(eng)
    assert KVMemoryAnchor.timings["kv_blocks_restored"] >= 9 and not eng.restored
    found = {d: _block_kv(eng, b) for b, d in eng.blocks._digest.items() if b in eng.blocks._cached}
    assert found.keys() == cached.keys() and all(torch.equal(found[d], cached[d]) for d in found)
    turn = SYSTEM + [11, 12, 13]
    got = eng.generate([turn], sp)
    assert eng.scheduler.prefix_hits == 36
    eng.close()
    monkeypatch.undo()
    assert got == Engine(EngineConfig(**kw, prefix_caching=False)).generate([turn], sp)
