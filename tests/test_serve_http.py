"""``gpu-anchor serve`` end to end: the stock ``openai`` client against the frontend process,
and a SIGKILL campaign (self-kills at every phase plus external kills at random times)
while ≥ 8 streams are open.  Every stream's text must equal the fault-free answer,
computed by an in-process engine.  Size knob: ``GPU_ANCHOR_SERVE_HTTP_KILLS`` (default 60).
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from gpu_anchor.testing.tiny import make_tiny_model

KILLS = int(os.environ.get("GPU_ANCHOR_SERVE_HTTP_KILLS", "60"))
SERVE = ["--device", "cpu", "--dtype", "float64", "--block-size", "4", "--num-blocks", "600",
         "--max-batched-tokens", "32", "--max-model-len", "512", "--cpu-threads", "1"]


def _get(url):
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.fixture
def server(tmp_path, host_daemon):
    model = make_tiny_model(str(tmp_path / "tiny-qwen3"), "qwen3", seed=3)
    port_file = tmp_path / "port"

    def start(*extra):
        proc = subprocess.Popen([sys.executable, "-m", "gpu_anchor.serve", model, "--port", "0",
                                 "--port-file", str(port_file), "--socket", host_daemon[0], *SERVE, *extra],
                                stdout=subprocess.DEVNULL, stderr=open(tmp_path / "serve.log", "ab"))
        deadline = time.time() + 120
        while not port_file.exists():
            assert proc.poll() is None and time.time() < deadline, (tmp_path / "serve.log").read_text()[-3000:]
            time.sleep(0.1)
        base = f"http://127.0.0.1:{port_file.read_text()}"
        procs.append(proc)
        return base

    procs = []
    yield model, start
    for p in procs:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()


def _wait_up(base, timeout=120):
    deadline = time.time() + timeout
    while _get(base + "/health")[0] != 200:
        assert time.time() < deadline
        time.sleep(0.05)


def test_openai_client_against_frontend(server):
    import openai
    model, start = server
    base = start()
    _wait_up(base)
    c = openai.OpenAI(base_url=base + "/v1", api_key="unused")
    assert [m.id for m in c.models.list().data] == ["tiny-qwen3"]
    r = c.completions.create(model="tiny-qwen3", prompt="The quick brown fox", max_tokens=12, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop") and r.usage.completion_tokens >= 1
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model="tiny-qwen3", prompt="The quick brown fox", max_tokens=12, temperature=0, stream=True))
    assert streamed == r.choices[0].text
    msgs = [{"role": "user", "content": "Hello world!"}]
    chat = c.chat.completions.create(model="tiny-qwen3", messages=msgs, max_tokens=10, temperature=0.7, seed=5)
    assert chat.choices[0].message.role == "assistant"
    chunks = list(c.chat.completions.create(model="tiny-qwen3", messages=msgs, max_tokens=10, temperature=0.7,
                                            seed=5, stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == chat.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == chat.choices[0].finish_reason
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model="tiny-qwen3", prompt="x", max_tokens=0)
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model="tiny-qwen3", prompt="x", max_tokens=10_000)
    code, text = _get(base + "/metrics")
    assert code == 200 and "gpu_anchor_serve_requests_total 4" in text
    assert "gpu_anchor_serve_engine_up 1" in text


def _reference(model, jobs):
    """Fault-free answers from an in-process engine, decoded like the frontend does."""
    from gpu_anchor.serve.engine import Engine, EngineConfig
    from gpu_anchor.serve.sequence import SamplingParams
    from gpu_anchor.serve.tokenizer import Codec
    codec = Codec(model, 384)
    eng = Engine(EngineConfig(model=model, anchor=False, dtype="float64", block_size=4, num_blocks=600))
    prompts = [codec.encode(codec.chat(j["messages"]) if "messages" in j else j["prompt"]) for j in jobs]
    params = [SamplingParams(max_tokens=j["max_tokens"], temperature=j["temperature"], seed=j.get("seed"),
                             top_p=j.get("top_p", 1.0)) for j in jobs]
    return [codec.decode(o) for o in eng.generate(prompts, params)]


def test_streams_survive_engine_sigkills(server):
    import openai
    model, start = server
    base = start("--fault-plan", f"11:2:{KILLS + 10}")
    rng = random.Random(0)
    words = "fox dog engine block cache hello world numbers journal daemon".split()
    jobs = []
    for i in range(10):
        j = {"max_tokens": rng.randint(60, 100), "temperature": 0.0 if i % 2 == 0 else 0.9}
        if i % 2:
            j.update(seed=100 + i, top_p=0.95)
        text = " ".join(rng.choice(words) for _ in range(rng.randint(2, 12)))
        j.update({"messages": [{"role": "user", "content": text}]} if i % 3 == 0 else {"prompt": text})
        jobs.append(j)
    ref = _reference(model, jobs)
    c = openai.OpenAI(base_url=base + "/v1", api_key="unused", timeout=300, max_retries=0)
    krng = random.Random(1)
    external = restarts = waves = 0
    while restarts < KILLS and waves < 6:           # waves of the same streams until enough kills
        got = [None] * len(jobs)

        def run(i):
            j = dict(jobs[i])
            if "messages" in j:
                s = c.chat.completions.create(model="tiny-qwen3", stream=True, **j)
                got[i] = "".join(ch.choices[0].delta.content or "" for ch in s)
            else:
                s = c.completions.create(model="tiny-qwen3", stream=True, **j)
                got[i] = "".join(ch.choices[0].text for ch in s)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):     # external kills at random moments, on top
            time.sleep(krng.uniform(0.02, 0.3))
            pid = json.loads(_get(base + "/health")[1]).get("engine_pid")
            if pid and external < 10:
                try:
                    os.kill(pid, signal.SIGKILL)
                    external += 1
                except ProcessLookupError:
                    pass
        for t in threads:
            t.join()
        assert got == ref
        waves += 1
        code, text = _get(base + "/metrics")
        metrics = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
        restarts = int(metrics["gpu_anchor_serve_engine_restarts_total"])
        assert int(metrics["gpu_anchor_serve_token_mismatch_total"]) == 0
    assert restarts >= KILLS, restarts
    assert int(metrics["gpu_anchor_serve_replayed_tokens_total"]) > 0
    # the one supervisor's job record, as `gpu-anchor status` shows it: every engine death was
    # classified by the decision table as shallow and restarted in place
    from gpu_anchor.launch import jobstate
    job = {j["namespace"]: j for j in jobstate.load_all()}["serve-tiny-qwen3"]
    assert job["kind"] == "serve" and job["state"] == "running" and job["supervisor_alive"]
    assert len(job["restarts"]) >= KILLS and {(r["action"], r["kind"]) for r in job["restarts"]} == \
        {("restart", "shallow")}, job["restarts"][:3]
    text = jobstate.format_jobs([job])
    assert "serving engine" in text and "engine: pid" in text and "restart in place" in text


def test_client_disconnect_aborts_and_bad_model_is_a_clear_error(server, tmp_path):
    import openai
    model, start = server
    base = start()
    _wait_up(base)
    c = openai.OpenAI(base_url=base + "/v1", api_key="unused")
    s = c.completions.create(model="tiny-qwen3", prompt="hello", max_tokens=400, temperature=0, stream=True,
                             extra_body={"ignore_eos": True})
    for i, _ in enumerate(s):
        if i == 3:
            break
    s.close()
    deadline = time.time() + 30
    while "gpu_anchor_serve_requests_open 0" not in _get(base + "/metrics")[1]:
        assert time.time() < deadline, "the abandoned request was not dropped"
        time.sleep(0.1)
    bad = tmp_path / "not-a-model"
    bad.mkdir()
    r = subprocess.run([sys.executable, "-m", "gpu_anchor.serve", str(bad), "--no-anchor"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "not-a-model" in r.stderr
