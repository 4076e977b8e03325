"""The hot standby (``Engine(standby=True)``, ``gpu-anchor serve --hot-standby``) on the CPU.

- attaching writes nothing the live engine owns: with a live engine paused mid-stream (its
  requests running, its last commit landed), the journal, the weights' bytes and the KV bytes
  are the same before and after a standby attached; the standby then takes over from the
  SIGKILLed engine and every request ends as in a fault-free run.  An empty namespace, one
  without its layout record or weights fingerprint, a missing object and another layout are
  refused with ``NotAttachable`` (and still write nothing);
- the user's path: ``gpu-anchor serve --hot-standby`` under the stock openai client, the engine
  SIGKILLed twice (the second time once a new hot standby attached): every stream equals its
  fault-free run, and the job record, ``gpu-anchor status`` and ``/health`` say the hot standby
  took over;
- the daemon SIGKILLed with a hot standby attached: the standby is closed, never used, the
  destructive path runs, every stream still equals its fault-free run;
- a standby that failed to prepare is in the job record and warned about (never silent).
"""
from __future__ import annotations

import hashlib
import os
import signal

import pytest
import torch

from gpu_anchor.serve.engine import Engine, EngineConfig
from gpu_anchor.serve.sequence import SamplingParams
from gpu_anchor.serve.state import NotAttachable
from gpu_anchor.testing.tiny import make_tiny_model
from test_serve_daemon_loss import NS, _client, _jobs, _progress, _restores, _wait, gpu_server, server  # noqa: F401
from test_serve_engine import Client, _ctx, _requests
from test_serve_http import _Stream, scrape


# ---------------------------------------------------------------- the engine: attach writes nothing
def _live(cfg, reqs, conn):
    """The live engine (a process of its own): steps, pauses after a landed commit with its
    requests still running, steps on while the standby is attached, then waits to be killed."""
    eng = Engine(cfg)
    for rid, (prompt, params) in reqs.items():
        eng.add_request(rid, prompt, SamplingParams(**params.to_dict()))
    for pause in range(2):
        events = []
        for _ in range(8):
            events += eng.step()
        events += eng.flush()         # nothing in flight: the state is still while the test reads it
        conn.send(events)
        conn.recv()
    signal.pause()


def _digests(sock, namespace, specs) -> dict:
    """The namespace's journal and every object's bytes, read through a non-owning lookup."""
    import gpu_anchor
    c = gpu_anchor.connect("cpu", namespace=namespace, socket=sock)
    out = {"journal": sorted(c.journal.get_many(prefix="").items())}
    for b in c.bind(specs, policy="lookup"):
        out[b.name] = hashlib.sha256(b.tensor.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest() \
            if b.tensor is not None else None
    c.close()
    return out


def test_standby_attach_writes_nothing_and_takes_over(tmp_path, host_daemon):
    sock = host_daemon[0]
    model = make_tiny_model(str(tmp_path / "tiny-qwen3"), "qwen3", seed=3)
    cfg = EngineConfig(model=model, dtype="float64", block_size=4, num_blocks=120, max_batched_tokens=24,
                       socket=sock, namespace="hot", cpu_threads=1)
    reqs = _requests(3, 3, max_tokens=40)
    ref = Client(reqs)
    fresh = Engine(EngineConfig(**dict(cfg.__dict__, anchor=False)))
    for rid, out in zip(reqs, fresh.generate([p for p, _ in reqs.values()], [sp for _, sp in reqs.values()])):
        ref.out[rid] = out

    with pytest.raises(NotAttachable, match="not anchored"):      # nothing there yet
        Engine(cfg, standby=True)

    a, b = _ctx().Pipe()
    live = _ctx().Process(target=_live, args=(cfg, reqs, b))
    live.start()
    client = Client(reqs)
    try:
        assert a.poll(120), "the live engine did not pause"
        for ev in a.recv():
            client.apply(*ev)
        import gpu_anchor
        objs = gpu_anchor.connect("cpu", namespace="hot", socket=sock).objects()
        specs = [(n, i.shape, getattr(torch, i.dtype)) for n, i in sorted(objs.items())]
        before = _digests(sock, "hot", specs)
        assert any(k.startswith("serve/st/") for k, _ in before["journal"]) and len(specs) > 10
        hot = Engine(cfg, standby=True)
        assert _digests(sock, "hot", specs) == before, "the standby's attach wrote into the live engine's state"
        # a layout it was not built for, refused before anything is written
        with pytest.raises(NotAttachable, match="another shape"):
            Engine(EngineConfig(**dict(cfg.__dict__, num_blocks=90)), standby=True)
        assert _digests(sock, "hot", specs) == before
        a.send("go on")                 # the live engine serves on while the standby is attached
        assert a.poll(120)
        for ev in a.recv():
            client.apply(*ev)
        assert len(client.done) < len(reqs)
        os.kill(live.pid, signal.SIGKILL)
        live.join()
    finally:
        if live.is_alive():
            live.kill()
    hot.take_over()
    assert hot.restored and {s.rid for s in hot.restored} == set(reqs) - set(client.done)
    assert not hot.recovery_notes
    for s in hot.restored:
        client.apply(s.rid, 0, s.output_ids, None)
    for rid in client.pending({s.rid for s in hot.restored}):
        prompt, params = reqs[rid]
        for ev in hot.add_request(rid, prompt, SamplingParams(**params.to_dict()), client.out[rid]):
            client.apply(*ev)
    assert hot.graphs is None and hot.cfg.graph_after_steps == 0
    while hot.has_work():
        for ev in hot.step():
            client.apply(*ev)
    assert client.mismatch == 0 and client.out == ref.out


def test_incomplete_namespaces_are_not_attachable(tmp_path, host_daemon):
    """Each refusal names what is missing, and the refused attach wrote nothing."""
    import gpu_anchor
    from gpu_anchor.serve import commit as C
    sock = host_daemon[0]
    model = make_tiny_model(str(tmp_path / "tiny-llama"), "llama", seed=1)
    cfg = EngineConfig(model=model, dtype="float32", block_size=4, num_blocks=32, socket=sock, namespace="part",
                       cpu_threads=1)
    eng = Engine(cfg)
    eng.add_request("a", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
    eng.step()
    eng.flush()
    c = gpu_anchor.connect("cpu", namespace="part", socket=sock)
    specs = [(n, i.shape, getattr(torch, i.dtype)) for n, i in sorted(c.objects().items())]
    layout, weights = c.journal.get(C.LAYOUT), c.journal.get(C.WEIGHTS)

    def refused(match):
        before = _digests(sock, "part", specs)
        with pytest.raises(NotAttachable, match=match):
            Engine(cfg, standby=True)
        assert _digests(sock, "part", specs) == before
    c.journal.commit({}, [C.LAYOUT])
    refused("no layout record")
    c.journal.commit({C.LAYOUT: layout}, [C.WEIGHTS])
    refused("no fingerprint of these weights")
    c.journal.commit({C.WEIGHTS: weights})
    hot = Engine(cfg, standby=True)              # complete again: attaches
    c.journal.commit({C.WEIGHTS: b"another model"})
    with pytest.raises(NotAttachable, match="fingerprint changed"):
        hot.take_over()                          # the state changed under the standby
    c.journal.commit({C.WEIGHTS: weights})
    c.free("kv_cache[1]")
    with pytest.raises(NotAttachable, match="1 of .* objects are not anchored"):
        Engine(cfg, standby=True)
    assert "kv_cache[1]" not in c.objects()      # the lookup created nothing
    c.close()


# ---------------------------------------------------------------- gpu-anchor serve --hot-standby
def _job():
    from gpu_anchor.launch import jobstate
    return {j["namespace"]: j for j in jobstate.load_all()}[NS]


def _hot_standby(not_pid=None) -> dict | None:
    """The job record's standby once it is attached (and is not ``not_pid``)."""
    sb = (_job().get("standbys") or {}).get("0")
    return sb if sb and sb.get("hot") and sb["pid"] != not_pid else None


def test_hot_standby_takes_over_after_two_engine_kills(server):
    """The engine SIGKILLed twice under open openai streams, each time with a hot standby attached
    (the second one made after the first take-over): every stream equals its fault-free run."""
    _two_engine_kills(server)


@pytest.mark.gpu
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_hot_standby_takes_over_after_two_cuda_engine_kills(gpu_server, async_scheduling):
    """The same on cuda:0 (float32): the standby's decode graphs are captured before the fault,
    against the live engine's mapped weights and KV cache, and replayed after the take-over;
    also with asynchronous scheduling (a step launched ahead in flight at each kill)."""
    _two_engine_kills(gpu_server, *(["--async-scheduling"] if async_scheduling else []))


def _two_engine_kills(server, *flags):
    from gpu_anchor.launch import jobstate
    base = server.start("--hot-standby", *flags)
    c = _client(base)
    jobs = _jobs(tokens=380)
    ref = [s.result() for s in [_Stream(c, j) for j in jobs]]
    before = scrape(base)
    open_at_kill, standbys = [], []
    for _ in range(2):
        _wait(lambda: _hot_standby(standbys[-1]["pid"] if standbys else None), "an attached hot standby")
        standbys.append(_hot_standby())
        if server.device != "cpu":            # what it holds of the device, for the KV cache's sizing
            assert standbys[-1]["allocator_peak_bytes"] >= standbys[-1]["allocator_bytes"] > 0, standbys[-1]
        # fresh streams for each kill: on a GPU the first ones end before the next standby is ready
        streams = [_Stream(c, j) for j in jobs]
        _progress(streams)
        open_at_kill.append(sum(s.finish is None for s in streams))
        os.kill(server.health()["engine_pid"], signal.SIGKILL)
        _wait(lambda: server.health().get("engine_pid") == standbys[-1]["pid"] and server.health()["status"] == "ok",
              "the hot standby serving")
        assert server.health()["last_recovery"]["hot_standby"] == 1, server.health()["last_recovery"]
        assert _job()["ranks"]["0"] == {"pid": standbys[-1]["pid"], "how": "hot standby", "device": server.device}
        got = [s.result() for s in streams]
        for j, r, g in zip(jobs, ref, got):
            assert g == r, (j, g, r)
    assert open_at_kill == [len(jobs)] * 2, open_at_kill
    m = scrape(base)
    assert m["gpu_anchor_serve_engine_restarts_total"] - before.get("gpu_anchor_serve_engine_restarts_total", 0) == 2
    assert m["gpu_anchor_serve_token_mismatch_total"] == 0
    job = _job()
    assert [(r["action"], r["kind"]) for r in job["restarts"]] == [("restart", "shallow")] * 2
    text = jobstate.format_jobs([job])
    assert f"engine: pid {standbys[-1]['pid']}, hot standby" in text, text
    assert server.log.read_text().count("the hot standby takes over") == 2


def test_hot_standby_takes_over_at_the_lifeline_before_the_exit(server, monkeypatch):
    """An engine whose exit lags the end of its descriptors, as a CUDA context's teardown makes it
    lag (~0.1 s on an H200; 4 s here): the hot standby takes over at the engine's lifeline, once
    the step fence and the daemon's ``await_gone`` say the dying engine can change nothing; every
    stream equals its fault-free run; the exit, classified when it comes, keeps the take-over
    (one restart, marked early)."""
    from gpu_anchor.serve.worker import LINGER_ENV
    monkeypatch.setenv(LINGER_ENV, "4")
    base = server.start("--hot-standby")
    c = _client(base)
    jobs = _jobs(tokens=300)
    ref = [s.result() for s in [_Stream(c, j) for j in jobs]]
    _wait(lambda: _hot_standby(), "an attached hot standby")
    sb = _hot_standby()
    streams = [_Stream(c, j) for j in jobs]
    _progress(streams)
    old = server.health()["engine_pid"]
    os.kill(old, signal.SIGUSR2)            # descriptors closed now, the exit 4 s later
    _wait(lambda: server.health().get("engine_pid") == sb["pid"] and server.health()["status"] == "ok",
          "the hot standby serving")
    rec = server.health()["last_recovery"]
    assert rec["hot_standby"] == 1 and rec["quiesced_by"] == "fence", rec
    got = [s.result() for s in streams]
    for j, r, g in zip(jobs, ref, got):
        assert g == r, (j, g, r)
    _wait(lambda: "its hot standby had already taken over" in server.log.read_text(),
          "the old engine's exit, classified")
    r = _job()["restarts"]
    assert [(x["action"], x["kind"], x.get("early")) for x in r] == [("restart", "shallow", True)], r
    log = server.log.read_text()
    assert "lifeline end, before its exit" in log, log[-3000:]


def test_daemon_killed_with_a_hot_standby_attached_is_survived_without_it(server):
    """The standby maps the lost daemon's memory: it is closed and never used; the destructive path
    (a fresh daemon, the weights loaded, every open request recomputed) serves every stream to
    the end, equal to its fault-free run; a new hot standby attaches to the new state."""
    base = server.start("--hot-standby")
    c = _client(base)
    jobs = _jobs(tokens=300)
    ref = [s.result() for s in [_Stream(c, j) for j in jobs]]
    _wait(lambda: _hot_standby(), "an attached hot standby")
    old = _hot_standby()
    streams = [_Stream(c, j) for j in jobs]
    _progress(streams)
    daemon = server.daemon_pid()
    os.kill(daemon, signal.SIGKILL)
    _wait(lambda: server.daemon_pid() not in (None, daemon), "a fresh daemon")
    _wait(lambda: server.health()["status"] == "ok", "an engine on the fresh daemon")
    got = [s.result() for s in streams]
    for j, r, g in zip(jobs, ref, got):
        assert g == r, (j, g, r)
    assert server.health()["engine_pid"] != old["pid"] and _job()["ranks"]["0"]["how"] == "forked"
    with pytest.raises(ProcessLookupError):
        os.kill(old["pid"], 0)                    # closed and reaped
    assert [r["kind"] for r in _restores()] == ["destructive"]
    assert "closed: restore" in server.log.read_text()
    _wait(lambda: _hot_standby(old["pid"]), "a hot standby attached to the new state")


def test_prewarm_runs_a_one_layer_tied_scratch_engine(tmp_path, monkeypatch):
    """The standby's pre-warm (``serve/prewarm.py``): one decoder layer, the LM head tied to the
    embedding (one vocabulary-sized matrix less), the live engine's widths; it runs every
    sequence through a prefill and decode steps and leaves nothing behind."""
    import weakref

    from gpu_anchor.serve import prewarm
    model = make_tiny_model(str(tmp_path / "qwen3"), "qwen3", seed=3)
    cfg = EngineConfig(model=model, dtype="float32", block_size=4, num_blocks=64, max_num_seqs=6,
                       max_batched_tokens=64, max_model_len=64)
    hf = prewarm.scratch_model(cfg)
    assert hf["num_hidden_layers"] == 1 and hf["tie_word_embeddings"] is True
    built = []
    real = prewarm.Engine

    class Seen(real):
        def __init__(self, c, *a, **kw):
            super().__init__(c, *a, **kw)
            built.append((weakref.ref(self), sorted(self.state.weights), self.cfg.anchor))
    monkeypatch.setattr(prewarm, "Engine", Seen)
    assert prewarm.warm_engine(cfg)["engine_prewarm_s"] > 0
    (ref, names, anchored), = built
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    assert sum(".layers." in n for n in names) and not any(".layers.1." in n for n in names)
    assert ref() is None and anchored is False      # freed at return; it never used the daemon


def test_a_standby_that_failed_to_prepare_is_reported(caplog):
    """A standby whose preparation raised (say, out of device memory in its pre-warm) is noted in
    the job record and warned about, naming what an engine failure costs until the next engine
    starts (when the supervisor closes it and tries a new one) and the flags that shrink it."""
    import logging

    from gpu_anchor.launch.serve_standby import StandbyKeeper

    class _Standby:
        pid, info = 4242, {"failed": "OutOfMemoryError: CUDA out of memory"}

        def ready(self, timeout=0.0):
            return False

    class _State:
        def __init__(self):
            self.data, self.saved = {}, 0

        def save(self):
            self.saved += 1

    keeper = StandbyKeeper()
    keeper.standby, keeper.standby_noted, keeper.state = _Standby(), False, _State()
    with caplog.at_level(logging.WARNING, logger="gpu_anchor.serve"):
        keeper._note_standby()
    assert keeper.state.data["standbys"]["0"] == {"pid": 4242, "failed": "OutOfMemoryError: CUDA out of memory"}
    assert keeper.state.saved == 1
    assert "standby 4242 failed while preparing (OutOfMemoryError" in caplog.text
    assert "--no-prewarm" in caplog.text and "fresh engine" in caplog.text
