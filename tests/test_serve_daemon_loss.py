"""``gpu-anchor serve`` when the anchored state is lost, and when it is stopped.

Real processes on the CPU (float32): the server (supervisor, frontend, forked engines), its
daemon, the stock ``openai`` client and plain HTTP.

- the daemon SIGKILLed three times while chat and completion streams (greedy and seeded sampling,
  with and without log-probabilities) are open: a fresh daemon, the weights loaded again,
  every open request recomputed from the tokens its client has; every stream equals its
  fault-free run token for token, with the same usage;
- the namespace dropped (``gpu-anchor drop``) or the state marked inconsistent under a live
  server: the server sees it, restarts the engine on a fresh namespace, same result;
- engines that fail at every start (the daemon lost and the weights file gone): every open
  stream ends with an SSE error event in the OpenAI shape and ``[DONE]`` on a cleanly closed
  connection, a waiting non-streaming request gets a JSON 503, ``/health`` answers 503;
- the daemon killed under an idle engine: replaced before the next request;
- the supervisor SIGKILLed: the frontend ends every open stream with an error event and exits;
- SIGTERM: open streams end with an error event; the namespace is freed and the daemon the
  server started is stopped, a daemon that was running before stays, one that other jobs
  use stays, and ``--keep-state`` keeps both for the next server, which maps instead of loading.
"""
from __future__ import annotations

import http.client
import json
import os
import re
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
from gpu_anchor.journal_keys import INCONSISTENT_KEY
from gpu_anchor.testing.tiny import make_tiny_model
from test_serve_http import _Stream, scrape, stop_server

NS = "serve-tiny-qwen3"
SERVE = ["--dtype", "float32", "--num-blocks", "600",
         "--max-num-batched-tokens", "32", "--max-model-len", "512", "--cpu-threads", "1"]


def _get(url):
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _wait(cond, what, timeout=120):
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


class _Server:
    def __init__(self, tmp_path, model, sock, device="cpu") -> None:
        self.tmp, self.model, self.sock, self.device, self.procs = tmp_path, model, sock, device, []
        self.log = tmp_path / "serve.log"

    def start(self, *extra) -> str:
        port_file = self.tmp / "port"
        port_file.unlink(missing_ok=True)
        proc = preloaded.Popen([sys.executable, "-m", "gpu_anchor.serve", self.model, "--port", "0", "--port-file",
                                str(port_file), "--socket", self.sock, *SERVE, "--device", self.device,
                                # vLLM's default block size on CUDA
                                "--block-size", "4" if self.device == "cpu" else "16", *extra],
                               stdout=subprocess.DEVNULL, stderr=open(self.log, "ab"), preload=preloaded.HF)
        self.procs.append(proc)
        _wait(lambda: port_file.exists() or proc.poll() is not None, "the port file")
        assert proc.poll() is None, self.log.read_text()[-3000:]
        self.proc, self.base = proc, f"http://127.0.0.1:{port_file.read_text()}"
        _wait(lambda: _get(self.base + "/health")[0] == 200, "the engine")
        return self.base

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(60)

    def health(self) -> dict:
        return _get(self.base + "/health")[1]

    def daemon_pid(self) -> int | None:
        hello = control.ping(self.device, self.sock)
        return hello and hello["pid"]


def _serving(tmp_path, socket_dir, device):
    model = make_tiny_model(str(tmp_path / "tiny-qwen3"), "qwen3", seed=3)
    srv = _Server(tmp_path, model, os.path.join(socket_dir, device.replace(":", "") + ".sock"), device)
    yield srv
    for p in srv.procs:
        stop_server(p)
    control.stop(device, srv.sock)       # whatever still answers there (a test's own daemon)


@pytest.fixture
def server(tmp_path, socket_dir):
    yield from _serving(tmp_path, socket_dir, "cpu")


@pytest.fixture
def gpu_server(tmp_path, socket_dir):
    yield from _serving(tmp_path, socket_dir, "cuda:0")


def _jobs(n=6, tokens=220):
    """Chat and completions, greedy and seeded sampling, three with penalties, one with two
    choices; every third asks
    for log-probabilities with token ids, so its tokens are compared id by id (the others as text
    and usage)."""
    words = "fox dog engine block cache hello world numbers journal daemon".split()
    jobs = []
    for i in range(n):
        j = {"max_tokens": tokens + 7 * i, "stream": True, "stream_options": {"include_usage": True},
             "extra_body": {"ignore_eos": True}}
        j.update(temperature=0.8, top_p=0.9, seed=70 + i) if i % 4 >= 2 else j.update(temperature=0)
        if i % 2:
            j["messages"] = [{"role": "user", "content": " ".join(words[i:i + 3])}]
        else:
            j["prompt"] = " ".join(words[i:i + 4])
        if i % 3 == 0:
            j.update({"logprobs": True, "top_logprobs": 1} if i % 2 else {"logprobs": 1})
            j["extra_body"] = dict(j["extra_body"], return_tokens_as_token_ids=True)
        if i in (1, 3):         # penalties count the tokens so far: a recomputed request must too
            j.update(frequency_penalty=0.4) if i == 1 else j.update(presence_penalty=0.6)
        elif i == 4:
            j["extra_body"] = dict(j["extra_body"], repetition_penalty=1.3)
        if i == 2:
            j["n"] = 2
        jobs.append(j)
    return jobs


def _client(base):
    import openai
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", timeout=300, max_retries=0)


def _progress(streams, chunks=3):
    mark = [s.chunks for s in streams]
    _wait(lambda: all(s.chunks >= m + chunks or s.finish for s, m in zip(streams, mark)), "stream progress")


def _restores():
    from gpu_anchor.launch import jobstate
    job = {j["namespace"]: j for j in jobstate.load_all()}[NS]
    return [r for r in job["restarts"] if r["action"] == "restore"]


def test_openai_streams_equal_a_fault_free_run_over_three_daemon_kills(server):
    """The daemon SIGKILLed three times while streams are open (a crash loop to a supervisor that
    blamed the engine): each stream equals its fault-free run (ids and log-probabilities where
    asked, text, finish reason, usage)."""
    _three_daemon_kills(server)


@pytest.mark.gpu
def test_openai_streams_equal_a_fault_free_run_over_three_cuda_daemon_kills(gpu_server):
    """The same on cuda:0 (float32, CUDA graphs on): the CUDA daemon SIGKILLed three times; its
    memory is gone, the engine maps fresh VMM memory from a new daemon and recomputes."""
    _three_daemon_kills(gpu_server)


def test_constrained_streams_equal_a_fault_free_run_over_three_daemon_kills(server):
    """Structured output (a JSON schema, a regex, a tool call forced by tool_choice) beside plain
    streams: the daemon's state is lost three times, every request is recomputed from its
    record, whose grammar rebuilds its matcher, and each stream equals its fault-free run."""
    pytest.importorskip("llguidance",
                        reason="structured output needs llguidance (gpu-anchor[serve]; make test installs it)")
    colors = {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 30, "maxItems": 30}
    compact = {"disable_any_whitespace": True}
    tools = [{"type": "function", "function": {"name": "paint", "parameters": colors}}]
    jobs = _jobs(3) + [
        {"prompt": "colors", "max_tokens": 240, "temperature": 0.9, "seed": 5, "stream": True,
         "extra_body": {"structured_outputs": dict(compact, json=colors), "ignore_eos": True}},
        {"messages": [{"role": "user", "content": "a code"}], "max_tokens": 200, "temperature": 1.0, "seed": 6,
         "stream": True, "extra_body": {"guided_regex": "([A-Z]{3}-[0-9]{4}\n){15}"}},
        {"messages": [{"role": "user", "content": "paint"}], "max_tokens": 240, "temperature": 0.9, "seed": 7,
         "stream": True, "tools": tools, "tool_choice": {"type": "function", "function": {"name": "paint"}},
         "extra_body": {"structured_outputs": compact}}]
    ref = _three_daemon_kills(server, jobs)
    assert len(json.loads(ref[3]["text"])) == 30
    assert re.fullmatch("([A-Z]{3}-[0-9]{4}\n){15}", ref[4]["text"]) and ref[4]["finish"] == "stop"
    name, args = ref[5]["text"][len("<call "):-1].split(" ", 1)
    assert name == "paint" and len(json.loads(args)) == 30 and ref[5]["finish"] == "stop"


def _three_daemon_kills(server, jobs=None) -> list[dict]:
    base = server.start()
    c = _client(base)
    jobs = jobs or _jobs()
    free = [_Stream(c, j) for j in jobs]
    ref = [s.result() for s in free]
    before = scrape(base)
    streams = [_Stream(c, j) for j in jobs]
    open_at_kill, daemons = [], [server.daemon_pid()]
    for _ in range(3):
        _progress(streams)
        open_at_kill.append(sum(s.open_choices for s in streams))
        os.kill(daemons[-1], signal.SIGKILL)
        _wait(lambda: server.daemon_pid() not in (None, daemons[-1]), "a fresh daemon")
        daemons.append(server.daemon_pid())
        _wait(lambda: server.health()["status"] == "ok", "an engine on the fresh daemon")
    got = [s.result() for s in streams]
    for j, r, g in zip(jobs, ref, got):
        assert g == r, (j, g, r)
    for s, f in zip(streams, free):
        if s.lps:
            assert max(abs(a - b) for a, b in zip(s.lps, f.lps)) < 1e-4
    assert open_at_kill[0] == sum(j.get("n", 1) for j in jobs) and open_at_kill[2] >= 1, open_at_kill
    m = scrape(base)

    def d(k):
        return m[k] - before.get(k, 0.0)
    assert d("gpu_anchor_serve_state_recoveries_total") == 3
    assert d("gpu_anchor_serve_state_recovery_seconds_count") == 3
    assert d("gpu_anchor_serve_state_recovery_stream_gap_seconds_count") == sum(open_at_kill)
    assert m["gpu_anchor_serve_token_mismatch_total"] == 0
    restores = _restores()
    assert len(restores) == 3 and all(r["kind"] == "destructive" and "daemon is not answering" in r["reason"]
                                      for r in restores), restores
    assert "daemon is not answering" in server.health()["last_state_loss"]["reason"]
    return ref


@pytest.mark.parametrize("how", ["drop", "inconsistent"])
def test_state_lost_under_a_live_server(server, how):
    """The namespace dropped with ``gpu-anchor drop``, or the state marked inconsistent, while
    streams are open and the engine is healthy: the server notices by itself, restarts the
    engine on a fresh namespace (the daemon, which was running before, stays) and every stream
    equals its fault-free run."""
    daemon = control.start("cpu", server.sock)
    base = server.start()
    c = _client(base)
    jobs = _jobs(4, tokens=200)
    ref = [s.result() for s in [_Stream(c, j) for j in jobs]]
    streams = [_Stream(c, j) for j in jobs]
    _progress(streams)
    engine = server.health()["engine_pid"]
    if how == "drop":
        subprocess.run([sys.executable, "-m", "gpu_anchor.cli", "drop", NS, "--socket", server.sock], check=True,
                       capture_output=True, timeout=60)
    else:
        import gpu_anchor
        gpu_anchor.connect("cpu", namespace=NS, socket=server.sock).journal.commit(
            {INCONSISTENT_KEY: b"marked by the test"})
    _wait(lambda: server.health().get("engine_pid") not in (None, engine), "the engine's replacement")
    got = [s.result() for s in streams]
    assert got == ref
    assert server.daemon_pid() == daemon.pid
    (r,) = _restores()
    assert ("are gone" if how == "drop" else "marked by the test") in r["reason"], r
    assert scrape(base)["gpu_anchor_serve_state_recoveries_total"] == 1
    assert "anchored state lost under engine" in server.log.read_text()


def _raw_stream(base, body, out):
    """POST a streaming request with plain HTTP; ``out`` gets the SSE data lines and whether the
    body ended cleanly (chunked encoding terminated, no exception)."""
    conn = http.client.HTTPConnection(base.split("//")[1], timeout=300)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()                   # raises IncompleteRead if the connection is dropped
        out["status"], out["clean"] = resp.status, True
        out["events"] = [ln[6:] for ln in data.decode().split("\n") if ln.startswith("data: ")]
    except Exception as e:  # noqa: BLE001 — the test reports it
        out["clean"], out["error"] = False, repr(e)
    finally:
        conn.close()


def test_engines_failing_at_every_start_end_every_stream_with_an_error(server, tmp_path):
    """The daemon is lost and the weights file is gone: each new engine fails loading the
    weights, the server gives up, and every open request is told so: an error event and
    ``[DONE]`` on a cleanly ended stream (openai raises APIError with the reason), a JSON 503
    for a non-streaming request; /health and new requests answer 503."""
    import openai
    base = server.start()
    c = _client(base)
    streams = [_Stream(c, j) for j in _jobs(4, tokens=300)]
    raw = [{} for _ in range(2)]
    body = {"model": "tiny-qwen3", "prompt": "hello world", "max_tokens": 300, "stream": True, "ignore_eos": True}
    threads = [threading.Thread(target=_raw_stream, args=(base, dict(body, seed=i, temperature=0.5), raw[i]))
               for i in range(2)]
    plain = {}

    def non_streaming():
        try:
            c.completions.create(model="tiny-qwen3", prompt="the fox", max_tokens=300, extra_body={"ignore_eos": True})
        except openai.APIStatusError as e:
            plain["status"], plain["body"] = e.status_code, e.body
    threads.append(threading.Thread(target=non_streaming))
    for t in threads:
        t.start()
    _progress(streams)
    os.rename(os.path.join(server.model, "model.safetensors"), tmp_path / "moved-away.safetensors")
    os.kill(server.daemon_pid(), signal.SIGKILL)
    for t in threads:
        t.join(120)
    for s in streams:
        s.thread.join(120)
        assert isinstance(s.error, openai.APIError) and "stopped serving" in str(s.error), s.error
        assert s.finish is None and s.chunks >= 3
    for r in raw:
        assert r["clean"] and r["status"] == 200, r
        err = json.loads(r["events"][-2])["error"]
        assert r["events"][-1] == "[DONE]" and err["code"] == 503 and "crash loop" in err["message"], r["events"][-3:]
        assert err["type"] == "ServiceUnavailableError" and set(err) == {"message", "type", "param", "code"}
    assert plain["status"] == 503 and "stopped serving" in json.dumps(plain["body"]), plain
    code, health = _get(base + "/health")
    assert code == 503 and health["status"] == "failed" and "crash loop" in health["reason"], health
    with pytest.raises(openai.APIStatusError) as e:
        c.completions.create(model="tiny-qwen3", prompt="x", max_tokens=3)
    assert e.value.status_code == 503
    assert scrape(base)["gpu_anchor_serve_failed"] == 1
    log = server.log.read_text()
    assert log.count("before it was built") >= 3 and "gave up" in log
    assert server.stop() == 1


def _stream_until_stopped(server):
    """Streams open while the server is stopped: each must end with an error event, not a cut."""
    raw = [{} for _ in range(2)]
    body = {"model": "tiny-qwen3", "prompt": "hello world", "max_tokens": 400, "stream": True, "ignore_eos": True}
    threads = [threading.Thread(target=_raw_stream, args=(server.base, dict(body, temperature=0), r)) for r in raw]
    for t in threads:
        t.start()
    _wait(lambda: server.health()["open_requests"] == 2, "the streams")
    return raw, threads


@pytest.mark.parametrize("case", ["started", "already_running", "shared", "keep_state"])
def test_clean_stop_frees_the_state_and_the_daemon_it_started(server, case):
    """SIGTERM: open streams end with an error event on a clean connection; then the namespace
    is freed and the daemon the server started is stopped — unless it was running before
    (``already_running``), other jobs keep objects in it (``shared``), or ``--keep-state``
    (both kept; the next server maps the weights instead of loading them).  One log line."""
    import gpu_anchor
    pre = control.start("cpu", server.sock) if case == "already_running" else None
    server.start(*(["--keep-state"] if case == "keep_state" else []))
    started_pid = server.daemon_pid()
    if case == "shared":
        other = gpu_anchor.connect("cpu", namespace="someone-else", socket=server.sock)
        held = other.bind([("w", (4,), __import__("torch").float32)])   # noqa: F841 (kept: a dropped tensor is freed)
    raw, threads = _stream_until_stopped(server)
    assert server.stop() == 0
    for t in threads:
        t.join(60)
    for r in raw:
        assert r["clean"] and r["events"][-1] == "[DONE]", r
        assert "shutting down" in json.loads(r["events"][-2])["error"]["message"]
    line = [ln for ln in server.log.read_text().splitlines() if "stopped (SIGTERM)" in ln]
    assert len(line) == 1, server.log.read_text()[-3000:]
    alive = control.ping("cpu", server.sock)
    names = gpu_anchor.connect("cpu", namespace=NS, socket=server.sock).names() if alive else []
    if case == "started":
        assert alive is None and f"stopped the daemon it started at {server.sock} (pid {started_pid})" in line[0]
        assert f"freed namespace {NS!r}" in line[0]
    elif case == "already_running":
        assert alive["pid"] == pre.pid and names == [] and "was running before this server and stays" in line[0]
    elif case == "shared":
        assert alive["pid"] == started_pid and names == [] and "namespace(s) someone-else" in line[0]
        assert other.names() == ["w"]
    else:
        assert alive["pid"] == started_pid and names and "kept namespace" in line[0] and "gpu-anchor drop" in line[0]
        before = server.log.read_text().count("loading weights")
        server.start()                      # maps what the first one kept: no weights loaded
        assert server.log.read_text().count("loading weights") == before
        assert server.stop() == 0           # it found the daemon running: frees the namespace, leaves the daemon
        assert control.ping("cpu", server.sock)["pid"] == started_pid
        assert gpu_anchor.connect("cpu", namespace=NS, socket=server.sock).names() == []


def test_daemon_lost_under_an_idle_engine_is_replaced_before_the_next_request(server):
    """No request open: the daemon's death is seen through the supervisor's idle connection, the
    engine is replaced on a fresh daemon at once, and the next request is served as before."""
    base = server.start()
    c = _client(base)
    job = {"prompt": "fox dog engine", "max_tokens": 40, "temperature": 0.7, "seed": 5, "extra_body": {"ignore_eos": True}}
    first = c.completions.create(model="tiny-qwen3", **job)
    engine, daemon = server.health()["engine_pid"], server.daemon_pid()
    os.kill(daemon, signal.SIGKILL)
    _wait(lambda: server.health().get("engine_pid") not in (None, engine) and server.health()["status"] == "ok",
          "a new engine without any request")
    assert server.daemon_pid() not in (None, daemon)
    assert "the daemon at" in server.log.read_text() and "died" in server.log.read_text()
    again = c.completions.create(model="tiny-qwen3", **job)
    assert again.choices[0].text == first.choices[0].text and again.usage == first.usage


def test_supervisor_killed_ends_every_stream_and_the_frontend(server):
    """The supervisor SIGKILLed (no clean stop): its engine dies with it, the frontend sees the
    control line close, ends every open stream with an error event and exits; the state stays."""
    from gpu_anchor.launch import jobstate
    import gpu_anchor
    server.start()
    frontend = {j["namespace"]: j for j in jobstate.load_all()}[NS]["frontend_pid"]
    raw, threads = _stream_until_stopped(server)
    server.proc.kill()
    for t in threads:
        t.join(60)
    for r in raw:
        assert r["clean"] and r["events"][-1] == "[DONE]", r
        assert "supervisor is gone" in json.loads(r["events"][-2])["error"]["message"]
    _wait(lambda: not control.pid_alive(frontend), "the frontend's exit", timeout=60)
    assert gpu_anchor.connect("cpu", namespace=NS, socket=server.sock).names(), "the anchored state stays"
