"""``gpu-anchor serve`` end to end: the stock ``openai`` client against the frontend process,
and a SIGKILL campaign (self-kills at every phase plus external kills at random times)
while ≥ 8 streams are open.  Every stream's text must equal the fault-free answer,
computed by an in-process engine.  Size knob: ``GPU_ANCHOR_SERVE_HTTP_KILLS`` (default 60).
"""
from __future__ import annotations

import contextlib
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

import preloaded
from gpu_anchor.client import control
from gpu_anchor.testing.tiny import make_tiny_model

KILLS = int(os.environ.get("GPU_ANCHOR_SERVE_HTTP_KILLS", "60"))
SERVE = ["--device", "cpu", "--dtype", "float64", "--block-size", "4", "--num-blocks", "600",
         "--max-num-batched-tokens", "32", "--max-model-len", "512", "--cpu-threads", "1"]


def _get(url):
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def scrape(base) -> dict:
    """``/metrics`` read with Prometheus' own parser: ``{name{labels}: value}``, the
    ``model_name`` label left out of the key."""
    from prometheus_client.parser import text_string_to_metric_families
    code, text = _get(base + "/metrics")
    assert code == 200, text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()) if k != "model_name")
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def stop_server(proc, timeout: float = 60) -> None:
    """SIGTERM a server that still runs (a clean stop), SIGKILL it if it is not gone in time."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture
def server(tmp_path, host_daemon):
    model = make_tiny_model(str(tmp_path / "tiny-qwen3"), "qwen3", seed=3)
    port_file = tmp_path / "port"

    def start(*extra, env=None):
        proc = preloaded.Popen([sys.executable, "-m", "gpu_anchor.serve", model, "--port", "0",
                                "--port-file", str(port_file), "--socket", host_daemon[0], *SERVE, *extra],
                               stdout=subprocess.DEVNULL, stderr=open(tmp_path / "serve.log", "ab"), env=env,
                               preload=preloaded.HF)
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
        stop_server(p)


def _wait_up(base, timeout=120):
    deadline = time.time() + timeout
    while _get(base + "/health")[0] != 200:
        assert time.time() < deadline
        time.sleep(0.05)


@contextlib.contextmanager
def own_daemon(tmp_path_factory, name: str):
    """A directory, a socket directory and a host daemon of a module's own server (its job record
    lands there, not where the other tests look): yields ``(directory, socket path)``."""
    d = tmp_path_factory.mktemp(name)
    (d / "sock").mkdir(mode=0o700)
    path = str(d / "sock" / "cpu.sock")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("GPU_ANCHOR_SOCKET_DIR", str(d / "sock"))
        env.delenv("GPU_ANCHOR_SOCKET", raising=False)
        daemon = control.start("cpu", path)
        try:
            yield d, path
        finally:
            control.stop("cpu", path)
            daemon.wait(10)


@pytest.fixture(scope="module")
def plain_server(tmp_path_factory):
    """One server with the default options and a daemon of its own, for the tests that only send
    requests (each counts from where it started): its base URL."""
    with own_daemon(tmp_path_factory, "plain") as (d, path):
        model = make_tiny_model(str(d / "tiny-qwen3"), "qwen3", seed=3)
        proc = preloaded.Popen([sys.executable, "-m", "gpu_anchor.serve", model, "--port", "0", "--port-file",
                                str(d / "port"), "--socket", path, *SERVE],
                               stdout=subprocess.DEVNULL, stderr=open(d / "serve.log", "ab"), preload=preloaded.HF)
        try:
            deadline = time.time() + 120
            while not (d / "port").exists():
                assert proc.poll() is None and time.time() < deadline, (d / "serve.log").read_text()[-3000:]
                time.sleep(0.1)
            base = f"http://127.0.0.1:{(d / 'port').read_text()}"
            _wait_up(base)
            yield base
        finally:
            stop_server(proc)


def test_openai_client_against_frontend(plain_server):
    import openai
    base = plain_server
    before = scrape(base)
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
    m = scrape(base)
    assert m["gpu_anchor_serve_requests_total"] - before.get("gpu_anchor_serve_requests_total", 0) == 4
    assert m["gpu_anchor_serve_engine_up"] == 1


def _reference(model, jobs):
    """Fault-free answers from an in-process engine: (text decoded like the frontend does, ids)."""
    from gpu_anchor.serve.engine import Engine, EngineConfig
    from gpu_anchor.serve.sequence import SamplingParams
    from gpu_anchor.serve.tokenizer import Codec
    codec = Codec(model, 384)
    eng = Engine(EngineConfig(model=model, anchor=False, dtype="float64", block_size=4, num_blocks=600))
    prompts = [codec.encode(codec.chat(j["messages"]) if "messages" in j else j["prompt"]) for j in jobs]
    params = [SamplingParams(max_tokens=j["max_tokens"], temperature=j["temperature"], seed=j.get("seed"),
                             top_p=j.get("top_p", 1.0)) for j in jobs]
    return [(codec.decode(o), o) for o in eng.generate(prompts, params)]


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
        if i % 4 == 1:     # with log-probabilities: a token replayed from the journal is recomputed instead
            j.update({"logprobs": True} if "messages" in j else {"logprobs": 0},
                     extra_body={"return_tokens_as_token_ids": True})
        jobs.append(j)
    ref = _reference(model, jobs)
    c = openai.OpenAI(base_url=base + "/v1", api_key="unused", timeout=300, max_retries=0)
    krng = random.Random(1)
    external = restarts = waves = 0
    while restarts < KILLS and waves < 6:           # waves of the same streams until enough kills
        streams = [_Stream(c, dict(j, stream=True)) for j in jobs]
        while any(s.thread.is_alive() for s in streams):     # external kills at random moments, on top
            time.sleep(krng.uniform(0.02, 0.3))
            pid = json.loads(_get(base + "/health")[1]).get("engine_pid")
            if pid and external < 10:
                try:
                    os.kill(pid, signal.SIGKILL)
                    external += 1
                except ProcessLookupError:
                    pass
        got = [s.result() for s in streams]
        assert [g["text"] for g in got] == [t for t, _ in ref]
        assert all(g["ids"] == ids for j, g, (_, ids) in zip(jobs, got, ref) if "logprobs" in j)
        waves += 1
        metrics = scrape(base)
        restarts = int(metrics["gpu_anchor_serve_engine_restarts_total"])
        assert metrics["gpu_anchor_serve_token_mismatch_total"] == 0
    assert restarts >= KILLS, restarts
    assert metrics["gpu_anchor_serve_replayed_tokens_total"] > 0
    # the one supervisor's job record, as `gpu-anchor status` shows it: every engine death was
    # classified by the decision table as shallow and restarted in place
    from gpu_anchor.launch import jobstate
    job = {j["namespace"]: j for j in jobstate.load_all()}["serve-tiny-qwen3"]
    assert job["kind"] == "serve" and job["state"] == "running" and job["supervisor_alive"]
    assert len(job["restarts"]) >= KILLS and {(r["action"], r["kind"]) for r in job["restarts"]} == \
        {("restart", "shallow")}, job["restarts"][:3]
    text = jobstate.format_jobs([job])
    assert "serving engine" in text and "engine: pid" in text and "restart in place" in text


def _two_kill_jobs():
    """Chat and completions, greedy and seeded sampling, two with two choices; the first four ask
    for log-probabilities with token ids (so their tokens are compared id by id), and the fifth
    with echo for the prompt's too; the others are compared as text."""
    jobs = []
    for i in range(8):
        j = {"max_tokens": 90 + 5 * i, "stream": True, "stream_options": {"include_usage": True},
             "extra_body": {"ignore_eos": i % 3 != 2}}
        if i % 4 >= 2:
            j.update(temperature=0.8, top_p=0.9, seed=40 + i)
        else:
            j.update(temperature=0)
        text = "fox dog engine block cache hello world numbers journal daemon".split()[i:i + 3]
        if i % 2:
            j["messages"] = [{"role": "user", "content": " ".join(text)}]
        else:
            j["prompt"] = " ".join(text)
        if i < 4:
            j.update({"logprobs": True, "top_logprobs": 2} if i % 2 else {"logprobs": 2})
            j["extra_body"] = dict(j["extra_body"], return_tokens_as_token_ids=True)
        if i in (6, 7):
            j["n"] = 2            # two choices: two engine requests, each resumed after a kill
        if i == 4:                # the prompt scored too (lm-evaluation-harness's way)
            j.update(echo=True, logprobs=1)
            j["extra_body"] = dict(j["extra_body"], return_tokens_as_token_ids=True)
        jobs.append(j)
    return jobs


class _Choice:
    def __init__(self) -> None:
        self.text, self.ids, self.lps, self.finish = "", [], [], None


def stream_across_engine_kill(base: str, open_stream, after: int = 3, victim=None) -> list:
    """Read the stream ``open_stream()`` returns (an iterable) in a thread; once ``after`` items
    came, SIGKILL the server's engine from outside (``victim(engine pid)``: the pid to kill instead,
    another rank of its group).  Returns every item of the stream, having checked that it was
    still open at the kill, ended without error, and that another engine serves."""
    items, ended, failed = [], [], []

    def read():
        try:
            for x in open_stream():
                items.append(x)
            ended.append(True)
        except Exception as e:  # noqa: BLE001 — reported below, not lost in the thread
            failed.append(e)
    t = threading.Thread(target=read)
    t.start()
    deadline = time.time() + 120
    while len(items) < after:
        assert time.time() < deadline and t.is_alive(), f"the stream did not start ({failed})"
        time.sleep(0.005)
    pid = json.loads(_get(base + "/health")[1])["engine_pid"]
    os.kill(victim(pid) if victim is not None else pid, signal.SIGKILL)
    open_at_kill = t.is_alive()
    t.join(180)
    assert not failed and ended, failed or "the stream did not end"
    assert open_at_kill, "the stream ended before the kill"
    assert json.loads(_get(base + "/health")[1])["engine_pid"] != pid
    return items


class _Stream:
    """One streamed request, read chunk by chunk in a thread: per choice (``n``), text, token
    ids and log-probabilities (when asked) and finish reason; usage.  ``text``, ``ids``,
    ``lps`` and ``finish`` are choice 0's; ``finish`` is set once every choice has finished."""

    def __init__(self, c, job) -> None:
        self.c, self.job = c, job
        self.choices = {i: _Choice() for i in range(job.get("n", 1))}
        self.chunks = 0
        self.usage = self.error = self.cached = None
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    text = property(lambda self: self.choices[0].text)
    ids = property(lambda self: self.choices[0].ids)
    lps = property(lambda self: self.choices[0].lps)

    @property
    def finish(self):
        return self.choices[0].finish if all(x.finish for x in self.choices.values()) else None

    @property
    def open_choices(self) -> int:
        """Choices not finished: each is a request of its own in the server (its metrics count them)."""
        return sum(x.finish is None for x in self.choices.values())

    def _run(self):
        try:
            chat = "messages" in self.job
            create = self.c.chat.completions.create if chat else self.c.completions.create
            for ch in create(model="tiny-qwen3", **self.job):
                if ch.usage is not None:
                    # a run after another with the same prompts finds them cached (prefix
                    # caching): the tokens it reports cached are kept apart from the usage compared
                    self.usage = ch.usage.model_dump()
                    self.cached = (self.usage.pop("prompt_tokens_details", None) or {}).get("cached_tokens")
                if not ch.choices:
                    continue
                x = ch.choices[0]
                got = self.choices[x.index]
                got.text += (x.delta.content or "") if chat else x.text
                for tc in (x.delta.tool_calls or []) if chat else ():     # a forced tool choice's call
                    got.text += f"<call {tc.function.name} {tc.function.arguments}>"
                lp = x.logprobs
                if lp is not None:
                    pairs = [(e.token, e.logprob) for e in lp.content] if chat else zip(lp.tokens, lp.token_logprobs)
                    for tok, v in pairs:
                        got.ids.append(int(tok.split(":")[1]))
                        if v is not None:         # echo: the prompt's first token has none
                            got.lps.append(v)
                if x.finish_reason:
                    got.finish = x.finish_reason
                self.chunks += 1
        except Exception as e:  # noqa: BLE001 — reported by the test, not lost in the thread
            self.error = e

    def result(self):
        self.thread.join(600)
        assert not self.thread.is_alive() and self.error is None, self.error
        return {"text": self.text, "ids": self.ids, "finish": self.finish, "usage": self.usage,
                "more": [(x.text, x.ids, x.finish) for i, x in sorted(self.choices.items()) if i]}


def test_openai_streams_equal_a_fault_free_run_over_two_engine_kills(server):
    """The stock openai client streams chat and completions; the engine is SIGKILLed from outside
    twice while every stream is open; each stream equals the same request's fault-free run
    token for token (ids and log-probabilities where asked), with the same usage.  The key
    comes from VLLM_API_KEY, as vLLM users set it."""
    import openai
    model, start = server
    base = start(env=dict(os.environ, VLLM_API_KEY="k-123"))
    _wait_up(base)
    c = openai.OpenAI(base_url=base + "/v1", api_key="k-123", timeout=300, max_retries=0)
    jobs = _two_kill_jobs()
    free = [_Stream(c, j) for j in jobs]
    ref = [s.result() for s in free]
    assert all(len(r["ids"]) == r["usage"]["completion_tokens"] for r in ref[:4])
    before = scrape(base)

    def wait(cond, what):
        deadline = time.time() + 120
        while not cond():
            assert time.time() < deadline, f"timed out waiting for {what}"
            time.sleep(0.01)

    streams = [_Stream(c, j) for j in jobs]
    open_at_kill = []
    pid = None
    for k in range(2):
        mark = [s.chunks for s in streams]
        wait(lambda: all(s.chunks >= m + 3 or s.finish for s, m in zip(streams, mark)), "stream progress")
        wait(lambda: json.loads(_get(base + "/health")[1]).get("engine_pid") not in (None, pid), "a new engine")
        pid = json.loads(_get(base + "/health")[1])["engine_pid"]
        open_at_kill.append(sum(s.open_choices for s in streams))
        os.kill(pid, signal.SIGKILL)
    got = [s.result() for s in streams]
    for j, r, g, s in zip(jobs, ref, got, streams):
        assert g == r, (j, g, r)
        if r["ids"]:
            assert max(abs(a - b) for a, b in zip(s.lps, free[streams.index(s)].lps)) < 1e-6
    assert open_at_kill[0] == sum(j.get("n", 1) for j in jobs) and open_at_kill[1] >= 1, open_at_kill
    m = scrape(base)

    def d(k):
        return m[k] - before.get(k, 0.0)
    assert d("gpu_anchor_serve_engine_restarts_total") == 2 and d("gpu_anchor_serve_engine_recovery_seconds_count") == 2
    assert d("gpu_anchor_serve_recovery_stream_gap_seconds_count") == sum(open_at_kill)
    assert m["gpu_anchor_serve_token_mismatch_total"] == 0


def test_client_disconnect_aborts_and_bad_model_is_a_clear_error(plain_server, tmp_path):
    import openai
    base = plain_server
    c = openai.OpenAI(base_url=base + "/v1", api_key="unused")
    s = c.completions.create(model="tiny-qwen3", prompt="hello", max_tokens=400, temperature=0, stream=True,
                             extra_body={"ignore_eos": True})
    for i, _ in enumerate(s):
        if i == 3:
            break
    s.close()
    deadline = time.time() + 30
    while scrape(base)["gpu_anchor_serve_requests_open"] != 0:
        assert time.time() < deadline, "the abandoned request was not dropped"
        time.sleep(0.1)
    bad = tmp_path / "not-a-model"
    bad.mkdir()
    r = preloaded.run([sys.executable, "-m", "gpu_anchor.serve", str(bad), "--no-anchor"], timeout=120,
                      preload=preloaded.HF)
    assert r.returncode == 2 and "not-a-model" in r.stderr
