"""LoRA adapters loaded and unloaded while serving (vLLM's /v1/load_lora_adapter, with
VLLM_ALLOW_RUNTIME_LORA_UPDATING=True): the engine's slots, the server through the ``openai``
client and plain HTTP, an engine SIGKILL in the middle of a stream on an adapter loaded at run
time, what a restarted engine trusts of a request's KV (its adapter's journal record and
digest), and every refusal."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
import urllib.error
import urllib.request

import pytest

from gpu_anchor.serve import lora as L
from gpu_anchor.serve.engine import Engine, EngineConfig
from gpu_anchor.serve.sequence import SamplingParams, Status
from test_serve_lora import PROMPTS, _peft_greedy, make_models

pytest.importorskip("peft", reason="peft makes the adapters (test extra)")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_models(tmp_path_factory.mktemp("lora-runtime"))


def _engine(base, **kw):
    return Engine(EngineConfig(model=base, anchor=False, dtype="float64", block_size=4, num_blocks=200,
                               max_batched_tokens=32, runtime_lora=True, **kw))


def test_the_engine_loads_and_unloads_adapters_between_steps(models):
    base, ads = models
    eng = _engine(base, max_loras=2)
    sp = {n: SamplingParams(max_tokens=10, ignore_eos=True, lora=n) for n in ("all", "qv")}
    with pytest.raises(ValueError, match="not served here"):
        eng.generate(PROMPTS[:1], sp["all"])
    eng.load_lora_adapter("all", ads["all"])
    eng.load_lora_adapter("qv", ads["qv"])
    want = {n: _peft_greedy(base, ads[n], PROMPTS[:2], 10) for n in ("all", "qv")}
    got = eng.generate(PROMPTS[:2] * 2, [sp["all"], sp["all"], sp["qv"], sp["qv"]])
    assert got == want["all"] + want["qv"]
    with pytest.raises(L.AdapterError, match="already loaded"):
        eng.load_lora_adapter("all", ads["qv"])
    # a third adapter with both slots taken waits on the host; a request on it takes the slot of
    # the least recently used adapter no running request uses ("all": both last used together,
    # the name breaks the tie), and a request on that one takes it back
    eng.load_lora_adapter("third", ads["qv"])
    assert eng.model.lora.parked == ["third"] and json.loads(eng.model.lora.record("third"))["slot"] == -1
    assert eng.generate(PROMPTS[:2], SamplingParams(max_tokens=10, ignore_eos=True, lora="third")) == want["qv"]
    assert eng.model.lora.parked == ["all"] and eng.model.lora.stats["swaps"] == 1
    assert eng.generate(PROMPTS[:2], sp["all"]) == want["all"]
    assert eng.model.lora.parked == ["qv"] and eng.model.lora.stats["swaps"] == 2
    eng.unload_lora_adapter("third")
    eng.add_request("busy", PROMPTS[0], SamplingParams(max_tokens=30, lora="qv"))
    with pytest.raises(L.AdapterError, match="in use by 1 request"):
        eng.unload_lora_adapter("qv")
    eng.abort("busy")
    eng.unload_lora_adapter("qv")
    with pytest.raises(L.AdapterError, match="'qv' is not loaded"):
        eng.unload_lora_adapter("qv")
    # the freed slot takes another adapter under the same name: its tokens, not the old one's
    # (the prefix cache's blocks named under the old "qv" are not found again)
    eng.load_lora_adapter("qv", ads["all"])
    assert eng.generate(PROMPTS[:2], sp["qv"]) == want["all"]
    eng.unload_lora_adapter("qv")
    eng.load_lora_adapter("qv", ads["qv"])
    assert eng.generate(PROMPTS[:2], sp["qv"]) == want["qv"]
    with pytest.raises(L.AdapterError, match="no adapter_config.json"):
        eng.load_lora_adapter("gone", "/nonexistent")
    assert set(eng.lora_slots) == {"all", "qv"}
    # load_inplace (vLLM's): the weights under a name change while a request on it runs, which
    # goes on; a bad file changes nothing
    slot, before = eng.lora_slots["all"], eng.model.lora.served["all"]
    eng.add_request("running", PROMPTS[0], SamplingParams(max_tokens=6, ignore_eos=True, lora="all"))
    eng.step()
    with pytest.raises(L.AdapterError, match="no adapter_config.json"):
        eng.load_lora_adapter("all", "/nonexistent", inplace=True)
    assert eng.model.lora.served["all"] == before
    eng.load_lora_adapter("all", ads["qv"], inplace=True)
    assert eng.lora_slots["all"] == slot and eng.model.lora.served["all"][0] == ads["qv"]
    while eng.has_work():
        eng.step()
    assert eng.generate(PROMPTS[:2], sp["all"]) == want["qv"]


def test_an_adapter_given_at_start_is_not_replaced_in_place(models):
    base, ads = models
    eng = _engine(base, max_loras=2, lora=(("given", ads["all"]),))
    with pytest.raises(L.AdapterError, match="'given' was given at start .--lora-modules. and is not replaced"):
        eng.load_lora_adapter("given", ads["qv"], inplace=True)
    assert eng.model.lora.served["given"][0] == ads["all"]


def test_loading_needs_the_runtime_switch(models):
    base, ads = models
    eng = Engine(EngineConfig(model=base, anchor=False, dtype="float64", block_size=4, num_blocks=64,
                              lora=(("all", ads["all"]),)))
    with pytest.raises(L.AdapterError, match="VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"):
        eng.load_lora_adapter("qv", ads["qv"])


def _restart(cfg, table, q):
    """A new engine on ``cfg``'s namespace (the previous one gone): what it restored, then the
    frontend's table of adapters loaded while serving (``sync_lora_adapters``), then every
    restored request run to its end."""
    eng = Engine(cfg)
    out = {s.rid: list(s.output_ids) for s in eng.restored}
    restored = {s.rid: (s.params.lora, s.num_computed) for s in eng.restored}
    served = dict(eng.model.lora.served)
    failed = eng.sync_lora_adapters(table)
    while eng.has_work():
        for rid, i, ids, _ in eng.step():
            assert i == len(out[rid]), (rid, i, len(out[rid]))
            out[rid] += ids
    q.put((restored, eng.recovery_notes, served, failed, dict(eng.model.lora.served), out))


def _run_and_restart(cfg, adapter_path, change, table, on_adapter=True):
    """An engine loads ``adapter_path`` as ``qv`` while serving and runs two requests (on it, on
    the base; ``on_adapter=False``: the base one only) four steps; then ``change()`` (the
    adapter's files), and ``_restart`` in a fresh process."""
    from forkserver_context import forkserver_context
    e1 = Engine(cfg)
    e1.load_lora_adapter("qv", adapter_path)
    for rid, name in (("on-qv", "qv"), ("on-base", None))[0 if on_adapter else 1:]:
        e1.add_request(rid, PROMPTS[0], SamplingParams(max_tokens=20, ignore_eos=True, lora=name))
    for _ in range(4):
        e1.step()
    e1.flush()
    change()
    q = forkserver_context(["gpu_anchor.serve.preload"]).Queue()
    p = forkserver_context(["gpu_anchor.serve.preload"]).Process(target=_restart, args=(cfg, table, q))
    p.start()
    got = q.get(timeout=180)
    p.join()
    return got


def test_a_request_on_an_adapter_loaded_while_serving_resumes_from_its_kv_after_a_restart(models, tmp_path,
                                                                                            host_daemon):
    """The adapter's journal record brings it back, into its slot, before the requests are
    restored: the request on it resumes from its KV (no note, no prefill again) and ends on
    peft's tokens.  Changed files (another adapter's tensors at the path) make the restarted
    engine drop that request by name instead of continuing it on KV of other weights; files
    gone, the same; either way the base model's request resumes.  The frontend's table then
    loads what is missing and unloads what it no longer serves."""
    base, ads = models
    want = {n: _peft_greedy(base, ads[n], PROMPTS[:1], 20)[0] for n in ("qv", "all")}
    plain = _peft_greedy(base, None, PROMPTS[:1], 20)[0]
    for case in ("same", "changed", "gone"):
        path = str(tmp_path / case)
        shutil.copytree(ads["qv"], path)

        def change():
            if case == "changed":
                for f in os.listdir(ads["all"]):
                    shutil.copy(os.path.join(ads["all"], f), os.path.join(path, f))
            elif case == "gone":
                shutil.rmtree(path)
        cfg = EngineConfig(model=base, socket=host_daemon[0], namespace=f"lora-rt-{case}", dtype="float64",
                           block_size=4, num_blocks=64, max_batched_tokens=32, runtime_lora=True, max_loras=2)
        table = [("qv", path)] if case != "gone" else [("qv", path), ("all", ads["all"])]
        restored, notes, served, failed, after, out = _run_and_restart(cfg, path, change, table)
        assert restored["on-base"][1] > 0 and out["on-base"] == plain
        if case == "same":
            assert not notes and restored["on-qv"][0] == "qv" and restored["on-qv"][1] > len(PROMPTS[0])
            assert out["on-qv"] == want["qv"] and served["qv"][0] == path and served["qv"][2] and not failed
        elif case == "changed":     # served again from the new files, for requests that come now
            assert "on-qv" not in restored and served["qv"][0] == path
            assert any("request on-qv: LoRA adapter 'qv' is not what its requests' KV was computed with: the tensors "
                       f"at {path} changed since" in n for n in notes), notes
        else:
            assert "on-qv" not in restored and "qv" not in served
            assert any("request on-qv: LoRA adapter 'qv' (loaded while serving from " in n and
                       "could not be loaded again" in n for n in notes), notes
            assert [n for n, _ in failed] == ["qv"] and set(after) == {"all"}


def test_a_request_on_an_adapter_that_waited_on_the_host_resumes_after_a_restart(models, host_daemon):
    """``--max-loras 1`` with two adapters given at start: a request on the second one (parked at
    start) took the slot, and one on the first waits for it, passed by a younger request on the
    second.  A restarted engine starts with the first in the slot again; the restored requests'
    adapter takes it back before their first step, the held request runs once they are done, and
    all three end on peft's tokens."""
    from forkserver_context import forkserver_context
    base, ads = models
    want = {n: _peft_greedy(base, ads[n], PROMPTS[:1], 20)[0] for n in ("qv", "all")}
    cfg = EngineConfig(model=base, socket=host_daemon[0], namespace="lora-parked-restart", dtype="float64",
                       block_size=4, num_blocks=64, max_batched_tokens=32, max_loras=1,
                       lora=(("all", ads["all"]), ("qv", ads["qv"])))
    e1 = Engine(cfg)
    assert e1.model.lora.parked == ["qv"]
    for rid, name in (("on-qv", "qv"), ("on-all", "all"), ("on-qv-2", "qv")):
        e1.add_request(rid, PROMPTS[0], SamplingParams(max_tokens=20, ignore_eos=True, lora=name))
    for _ in range(4):
        e1.step()
    assert e1.model.lora.parked == ["all"] and e1.scheduler.running_adapters() == {"qv"}
    assert {s.rid for s in e1.scheduler.seqs.values() if s.status is Status.RUNNING} == {"on-qv", "on-qv-2"}
    e1.flush()
    q = forkserver_context(["gpu_anchor.serve.preload"]).Queue()
    p = forkserver_context(["gpu_anchor.serve.preload"]).Process(target=_restart, args=(cfg, [], q))
    p.start()
    restored, notes, served, failed, after, out = q.get(timeout=180)
    p.join()
    assert not notes and not failed and restored["on-qv"][0] == "qv" and restored["on-qv"][1] > len(PROMPTS[0])
    assert restored["on-qv-2"][0] == "qv" and restored["on-qv-2"][1] > len(PROMPTS[0])
    assert out == {"on-qv": want["qv"], "on-all": want["all"], "on-qv-2": want["qv"]}


def test_a_restart_with_fewer_slots_than_the_running_requests_adapters_drops_the_younger_by_name(models,
                                                                                                  host_daemon):
    """Two requests running on two adapters, then a restart with ``--max-loras 1``: the older
    request resumes from its KV; the younger one's adapter has no slot, so it is dropped by name
    (the frontend recomputes it), never left running on another adapter's slot."""
    from forkserver_context import forkserver_context
    base, ads = models
    cfg = EngineConfig(model=base, socket=host_daemon[0], namespace="lora-fewer-slots", dtype="float64",
                       block_size=4, num_blocks=64, max_batched_tokens=32, max_loras=2,
                       lora=(("all", ads["all"]), ("qv", ads["qv"])))
    e1 = Engine(cfg)
    for rid, name in (("old", "qv"), ("young", "all")):
        e1.add_request(rid, PROMPTS[0], SamplingParams(max_tokens=20, ignore_eos=True, lora=name))
    for _ in range(4):
        e1.step()
    assert e1.scheduler.running_adapters() == {"qv", "all"}
    e1.flush()
    q = forkserver_context(["gpu_anchor.serve.preload"]).Queue()
    p = forkserver_context(["gpu_anchor.serve.preload"]).Process(target=_restart,
                                                                 args=(dataclasses.replace(cfg, max_loras=1), [], q))
    p.start()
    restored, notes, served, failed, after, out = q.get(timeout=180)
    p.join()
    assert set(restored) == {"old"} and out == {"old": _peft_greedy(base, ads["qv"], PROMPTS[:1], 20)[0]}
    assert notes == ["request young: LoRA adapter 'all' needs a slot, and the 1 of --max-loras hold the older "
                     "requests' adapters"], notes


def test_the_frontends_table_unloads_an_adapter_it_no_longer_serves(models, host_daemon):
    """An adapter the new engine restored from the journal that the frontend does not list (it
    had unloaded it, and the deletion of the record had not landed before the kill: here the
    record simply stays) is unloaded when the table comes; one a restored request still uses is
    kept, said in the log, and that request ends on its adapter."""
    base, ads = models
    cfg = EngineConfig(model=base, socket=host_daemon[0], namespace="lora-rt-table", dtype="float64",
                       block_size=4, num_blocks=64, runtime_lora=True, max_loras=2)
    restored, notes, served, failed, after, out = _run_and_restart(cfg, ads["qv"], lambda: None, [], on_adapter=False)
    assert set(restored) == {"on-base"} and "qv" in served and not failed and after == {}
    cfg = dataclasses.replace(cfg, namespace="lora-rt-table-busy")
    restored, notes, served, failed, after, out = _run_and_restart(cfg, ads["qv"], lambda: None, [])
    assert restored["on-qv"][0] == "qv" and set(after) == {"qv"} and not failed
    assert out["on-qv"] == _peft_greedy(base, ads["qv"], PROMPTS[:1], 20)[0]


def _post(url, path, body):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _server(base, tmp_path, sock, *extra, runtime=True):
    from tests.test_serve_api import start_server
    env = {k: v for k, v in os.environ.items() if k != L.RUNTIME_ENV}
    if runtime:
        env[L.RUNTIME_ENV] = "True"
    proc, url, _ = start_server(str(tmp_path), base, "--socket", sock, "--served-model-name", "tiny", "--enable-lora",
                                *extra, env=env)
    return proc, url


def _restored_with_its_adapter(tmp_path) -> None:
    """The server's log: the engine after the kill restored the open request (resumed from its
    KV, not dropped for want of its adapter and recomputed)."""
    text = (tmp_path / "serve.log").read_text()
    assert "serving again" in text and "; 1 restored request(s)" in text, text[-3000:]
    assert "is not served by this engine" not in text and "could not be loaded again" not in text, text[-3000:]


def _other_rank(engine_pid: int) -> int:
    """The pid of rank 1 of the engine group whose rank 0 is ``engine_pid`` (the job records)."""
    from gpu_anchor.launch import jobstate
    for job in jobstate.load_all():
        ranks = {int(r): info["pid"] for r, info in (job.get("ranks") or {}).items()}
        if ranks.get(0) == engine_pid and 1 in ranks:
            return ranks[1]
    raise AssertionError(f"no engine group with rank 0 at pid {engine_pid}")


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_the_server_loads_an_adapter_while_serving_and_keeps_it_across_an_engine_kill(models, tmp_path, host_daemon,
                                                                                      tp):
    """``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True gpu-anchor serve --enable-lora --max-loras 1``, no
    adapter at start: ``/v1/load_lora_adapter`` adds one (listed by ``/v1/models``, served by name
    with peft's tokens), a stream on it goes on across an engine SIGKILL (the new engine is given
    the adapter again before the open requests), ``/v1/unload_lora_adapter`` removes it; every
    bad call is refused naming why, and nothing changes then.  ``tp2``: rank 1 follows each load
    and unload, and after each kill (of rank 0, then of rank 1 alone) loads the adapter again from
    rank 0's table."""
    import openai

    from tests.test_serve_http import scrape, stop_server, stream_across_engine_kill
    base, ads = models
    want = _peft_greedy(base, ads["all"], [PROMPTS[0]], 24)[0]
    proc, url = _server(base, tmp_path, host_daemon[0], "--max-loras", "1", "--tensor-parallel-size", str(tp))
    try:
        c = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0)
        assert [m.id for m in c.models.list().data] == ["tiny"]
        status, text = _post(url, "/v1/load_lora_adapter", {"lora_name": "all", "lora_path": ads["all"]})
        assert status == 200 and "added successfully" in text
        cards = {m.id: m for m in c.models.list().data}
        assert set(cards) == {"tiny", "all"} and cards["all"].parent == "tiny" and cards["all"].root == ads["all"]

        def ask(**kw):
            return c.completions.create(model="all", prompt=PROMPTS[0], max_tokens=24, temperature=0, logprobs=0,
                                        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True}, **kw)
        r = ask()
        assert [int(t.split(":")[1]) for t in r.choices[0].logprobs.tokens] == want
        items = stream_across_engine_kill(url, lambda: ask(stream=True))
        assert [int(t.split(":")[1]) for x in items for t in (x.choices[0].logprobs.tokens if x.choices else [])] == want
        _restored_with_its_adapter(tmp_path)
        if tp == 2:          # rank 1 alone: the group starts again, and rank 1 loads the adapter from the table
            items = stream_across_engine_kill(url, lambda: ask(stream=True), victim=_other_rank)
            assert [int(t.split(":")[1]) for x in items
                    for t in (x.choices[0].logprobs.tokens if x.choices else [])] == want
        for body, status_want, why in (
                ({"lora_name": "all", "lora_path": ads["qv"]}, 400, "already been loaded"),
                *([({"lora_name": "qv", "lora_path": ads["qv"]}, 400,
                    "every one of the 1 slot(s) holds an adapter (all), and with --tensor-parallel-size every "
                    "adapter keeps a slot")] if tp == 2 else []),
                ({"lora_name": "x", "lora_path": str(tmp_path)}, 400, "no adapter_config.json"),
                ({"lora_name": "tiny", "lora_path": ads["qv"]}, 400, "base model's served name"),
                ({"lora_name": "qv"}, 400, "lora_path"), ({"lora_name": "qv", "lora_path": 3}, 400, "lora_path"),
                ({"lora_name": "all", "lora_path": ads["qv"], "load_inplace": "yes"}, 400, "load_inplace"),
                ({"lora_name": "all", "lora_path": str(tmp_path), "load_inplace": True}, 400, "no adapter_config.json")):
            status, text = _post(url, "/v1/load_lora_adapter", body)
            assert status == status_want and why in text, (body, status, text)
        if tp == 1:     # a second adapter, the one slot taken: it waits on the host, and a request takes the slot
            status, text = _post(url, "/v1/load_lora_adapter", {"lora_name": "qv", "lora_path": ads["qv"]})
            assert status == 200, text
            assert [int(t.split(":")[1]) for t in c.completions.create(
                model="qv", prompt=PROMPTS[0], max_tokens=12, temperature=0, logprobs=0,
                extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True}).choices[0].logprobs.tokens] == \
                _peft_greedy(base, ads["qv"], [PROMPTS[0]], 12)[0]
            assert [int(t.split(":")[1]) for t in ask().choices[0].logprobs.tokens] == want
            # /metrics: the swaps (qv in, all back) and vLLM's lora_requests_info with the one slot and
            # nothing running (the engine's statistics reach the frontend after the tokens do: wait)
            idle = ['vllm:lora_requests_info{max_lora="1",running_lora_adapters="",waiting_lora_adapters=""}']
            deadline = time.time() + 30
            while ((got := scrape(url)).get("gpu_anchor_serve_lora_swaps_total") != 2.0
                   or [k for k in got if k.startswith("vllm:lora_requests_info")] != idle):
                assert time.time() < deadline, {k: v for k, v in got.items() if "lora" in k}
                time.sleep(0.2)
            assert _post(url, "/v1/unload_lora_adapter", {"lora_name": "qv"})[0] == 200
        assert set(m.id for m in c.models.list().data) == {"tiny", "all"}
        assert [int(t.split(":")[1]) for t in ask().choices[0].logprobs.tokens] == want     # unchanged by the refusals
        # load_inplace: the same name now serves the other adapter's weights
        status, text = _post(url, "/v1/load_lora_adapter", {"lora_name": "all", "lora_path": ads["qv"],
                                                            "load_inplace": True})
        assert status == 200, text
        assert {m.id: m for m in c.models.list().data}["all"].root == ads["qv"]
        assert [int(t.split(":")[1]) for t in ask().choices[0].logprobs.tokens] == \
            _peft_greedy(base, ads["qv"], [PROMPTS[0]], 24)[0]
        status, text = _post(url, "/v1/unload_lora_adapter", {"lora_name": "all"})
        assert status == 200 and "removed successfully" in text
        assert _post(url, "/v1/unload_lora_adapter", {"lora_name": "all"})[0] == 404
        with pytest.raises(openai.NotFoundError):
            ask()
        status, _ = _post(url, "/v1/load_lora_adapter", {"lora_name": "qv", "lora_path": ads["qv"]})
        assert status == 200        # the slot freed by the unload
        assert [int(t.split(":")[1]) for t in c.completions.create(
            model="qv", prompt=PROMPTS[0], max_tokens=12, temperature=0, logprobs=0,
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True}).choices[0].logprobs.tokens] == \
            _peft_greedy(base, ads["qv"], [PROMPTS[0]], 12)[0]
    finally:
        stop_server(proc)


def test_a_hot_standby_takes_over_a_stream_on_an_adapter_loaded_while_serving(models, tmp_path, host_daemon):
    """``--hot-standby``: the standby was built before the adapter was loaded; while it waits it
    loads the adapter from the journal's record, into its slot, so its take-over reads no file,
    and the stream on it goes on from its KV with peft's tokens."""
    import openai

    from gpu_anchor.launch import jobstate
    from tests.test_serve_daemon_loss import _wait
    from tests.test_serve_http import _get, stop_server, stream_across_engine_kill
    base, ads = models
    want = _peft_greedy(base, ads["all"], [PROMPTS[0]], 24)[0]
    proc, url = _server(base, tmp_path, host_daemon[0], "--max-loras", "1", "--hot-standby")
    try:
        assert _post(url, "/v1/load_lora_adapter", {"lora_name": "all", "lora_path": ads["all"]})[0] == 200

        def standby():
            sb = [(j.get("standbys") or {}).get("0") for j in jobstate.load_all()]
            return any(x and x.get("hot") for x in sb)
        _wait(standby, "an attached hot standby")
        ahead = "LoRA adapter 'all' (loaded while serving) read again from"
        _wait(lambda: ahead in (tmp_path / "serve.log").read_text(), "the standby loading the adapter ahead")
        c = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0)
        items = stream_across_engine_kill(url, lambda: c.completions.create(
            model="all", prompt=PROMPTS[0], max_tokens=24, temperature=0, logprobs=0, stream=True,
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True}))
        assert [int(t.split(":")[1]) for x in items for t in (x.choices[0].logprobs.tokens if x.choices else [])] == want
        health = json.loads(_get(url + "/health")[1])
        assert health["last_recovery"]["hot_standby"] == 1, health["last_recovery"]
        _restored_with_its_adapter(tmp_path)
        assert (tmp_path / "serve.log").read_text().count(ahead) == 1      # none at the take-over
    finally:
        stop_server(proc)


def test_without_the_switch_the_routes_are_not_there(models, tmp_path, host_daemon):
    from tests.test_serve_http import stop_server
    base, ads = models
    proc, url = _server(base, tmp_path, host_daemon[0], "--lora-modules", f"all={ads['all']}", runtime=False)
    try:
        assert _post(url, "/v1/load_lora_adapter", {"lora_name": "qv", "lora_path": ads["qv"]})[0] == 404
    finally:
        stop_server(proc)


@pytest.mark.gpu
def test_on_cuda_adapters_loaded_while_serving_reach_the_graphs(models, cuda_daemon):
    """On CUDA in float32 (fused decoder kernels, CUDA graphs, anchored): graphs captured before
    any adapter was loaded, then an adapter loaded while serving, another put into the slot the
    first one freed, an in-place replacement under a running request's name, and a third adapter
    waiting on the host for the one slot and taking it in turns.  Each time the greedy tokens are
    transformers + peft's on the same GPU: a graph replay that read a slot's old weights, or a
    slot the kernels do not see, would give the other adapter's tokens."""
    import torch

    from test_serve_lora import _peft_greedy
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    base, ads = models
    torch.backends.cuda.matmul.allow_tf32 = False
    eng = Engine(EngineConfig(model=base, device="cuda:0", dtype="float32", block_size=16, num_blocks=256,
                              namespace="lora-runtime-gpu", socket=cuda_daemon[0], runtime_lora=True, max_loras=1))
    want = {n: _peft_greedy(base, ads.get(n), PROMPTS, 12, "cuda:0", "float32") for n in ("all", "qv", None)}
    sp = lambda n: SamplingParams(max_tokens=12, ignore_eos=True, lora=n)   # noqa: E731
    assert eng.generate(PROMPTS, sp(None)) == want[None]
    assert eng.step_counts["graph"] > 0 and eng.model.fused
    eng.load_lora_adapter("a", ads["all"])
    slot = eng.lora_slots["a"]
    assert eng.generate(PROMPTS + PROMPTS, [sp("a")] * 4 + [sp(None)] * 4) == want["all"] + want[None]
    graphs = eng.step_counts["graph"]
    eng.unload_lora_adapter("a")
    eng.load_lora_adapter("b", ads["qv"])
    assert eng.lora_slots["b"] == slot
    assert eng.generate(PROMPTS, sp("b")) == want["qv"]
    eng.add_request("running", PROMPTS[0], SamplingParams(max_tokens=30, ignore_eos=True, lora="b"))
    eng.step()
    eng.load_lora_adapter("b", ads["all"], inplace=True)
    while eng.has_work():
        eng.step()
    assert eng.generate(PROMPTS, sp("b")) == want["all"]
    assert eng.step_counts["graph"] > graphs
    # more adapters than the one slot: "c" waits on the host, then takes the slot, then "b" takes it back
    eng.load_lora_adapter("c", ads["qv"])
    assert eng.model.lora.parked == ["c"]
    assert eng.generate(PROMPTS, sp("c")) == want["qv"]
    assert eng.generate(PROMPTS, sp("b")) == want["all"]
    assert eng.model.lora.stats["swaps"] == 2
