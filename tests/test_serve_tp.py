"""Tensor-parallel serving (``gpu-anchor serve --tensor-parallel-size 2``).

CPU (gloo, one host daemon shared by the ranks, each rank in its own namespace), through the
real ``gpu-anchor serve`` process and HTTP with the stock ``openai`` client:

- the sharded forward equals the whole model's (in process, the two ranks as threads);
- TP = 2 answers as TP = 1 does (float32, greedy; log-probabilities within 1e-4);
- one rank SIGKILLed repeatedly mid-stream, then both ranks at once: every stream equals its
  fault-free run token for token;
- self-kills at every phase of a step, on a random rank, many times (``--fault-plan``);
- a rank whose anchored state is gone makes every rank recompute (the start-up agreement).

GPU (marked ``gpu``, skipped without two GPUs): the same over NCCL on two devices.
Size knob: ``GPU_ANCHOR_SERVE_TP_KILLS`` (self-kill campaign, default 12).
"""
from __future__ import annotations

import concurrent.futures
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import preloaded
from gpu_anchor.client import control
from gpu_anchor.testing.tiny import make_tiny_model
from test_serve_http import (_get, _reference, _Stream, _two_kill_jobs, _wait_up, own_daemon, scrape,
                             stop_server)

KILLS = int(os.environ.get("GPU_ANCHOR_SERVE_TP_KILLS", "12"))
CPU64 = ["--device", "cpu", "--dtype", "float64", "--block-size", "4", "--num-blocks", "600",
         "--max-num-batched-tokens", "32", "--max-model-len", "512", "--cpu-threads", "1"]
# the variables the two-GPU run keeps in every process (NVLink multicast off on the lent machines)
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


# ------------------------------------------------------------------ the sharded forward, in process
class _ThreadGroup:
    """``tp.Group``'s collectives between threads of this process (one per rank)."""

    def __init__(self, rank, size, shared, vocab_size):
        from gpu_anchor.serve import shards
        self.rank, self.size, self.shared = rank, size, shared
        self.vocab = shards.vocab_range(vocab_size, rank, size)

    def _exchange(self, t):
        s = self.shared
        s["barrier"].wait()
        s["parts"][self.rank] = t.clone()
        s["barrier"].wait()
        parts = [s["parts"][r] for r in range(self.size)]
        s["barrier"].wait()
        return parts

    def all_reduce(self, t):
        parts = self._exchange(t)
        acc = parts[0].clone()
        for p in parts[1:]:
            acc += p
        t.copy_(acc)
        return t

    def gather_vocab(self, logits):
        return torch.cat(self._exchange(logits), dim=1)


def _forward(path, dtype, rank, n, tp, adapters=(), lora_rows=None):
    """The whole model's (``n`` = 1) or rank ``rank``'s logits and KV for a fixed mixed step;
    ``adapters``: ``[(name, path)]`` served in slots 0.., ``lora_rows``: each token's slot."""
    from gpu_anchor.serve import lora as L
    from gpu_anchor.serve import lora_slots
    from gpu_anchor.serve import shards
    from gpu_anchor.serve.attention import step_inputs
    from gpu_anchor.serve.model_runner import Model, head_dim, load_config, load_weights, param_specs
    mc = load_config(path)
    specs = shards.shard_specs(param_specs(mc, dtype), mc.vocab_size, rank, n)
    w = {name: torch.empty(shape, dtype=dtype) for name, shape, _ in specs}
    load_weights(path, w, part=(lambda name, shape: shards.index(name, shape, mc.vocab_size, rank, n)))
    kv = [torch.zeros(2, 16, 4, mc.num_key_value_heads // n, head_dim(mc), dtype=dtype)
          for _ in range(mc.num_hidden_layers)]
    # two sequences: a 5-token prefill and a 2-token chunk, logits of their last tokens
    plan = {"ids": [5, 7, 9, 11, 13, 2, 3], "pos": [0, 1, 2, 3, 4, 0, 1], "slots": [0, 1, 2, 3, 4, 8, 9],
            "tseq": [0] * 5 + [1] * 2, "q_starts": [0, 5], "q_lens": [5, 2], "ctx": [5, 2], "tables": [[0, 1], [2]],
            "rows": [4, 6]}
    if adapters:
        plan["lora"] = lora_rows
    ids, meta, rows = step_inputs(plan, "cpu")
    model = Model(mc, w, kv, "cpu", tp=tp)
    model.lora = lora_slots.load(list(adapters), w, dtype, "cpu", None, part=(rank, n),
                        full=L.full_shapes(mc) if n > 1 else None)
    return model.forward(ids, meta, rows), kv


@pytest.mark.parametrize("family,kw", [("qwen2", {}), ("qwen3", {}), ("llama", {"tie_word_embeddings": True,
                                                                               "vocab_size": 383}), ("mistral", {})])
def test_sharded_forward_equals_the_whole_model(tmp_path, family, kw):
    """qwen2: q/k/v biases; qwen3: q_norm/k_norm; llama: a tied lm_head and a vocabulary that
    does not split evenly (383 = 192 + 191).  Float64: equal to 1e-12; the KV cache of each
    rank is its KV heads' slice of the whole model's."""
    path = make_tiny_model(str(tmp_path / family), family, seed=1, **kw)
    _sharded_equals_whole(path)


def _sharded_equals_whole(path, **kw):
    """``_forward`` on two ranks (threads) equals it on one: logits to 1e-12, each rank's KV its
    heads' slice of the whole model's."""
    whole, whole_kv = _forward(path, torch.float64, 0, 1, None, **kw)
    shared = {"barrier": threading.Barrier(2), "parts": {}}
    out, errors = {}, []

    def rank(r):
        try:
            from gpu_anchor.serve.model_runner import load_config
            out[r] = _forward(path, torch.float64, r, 2, _ThreadGroup(r, 2, shared, load_config(path).vocab_size),
                              **kw)
        except Exception as e:  # noqa: BLE001 — reported below
            errors.append(e)
            shared["barrier"].abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    [t.start() for t in threads]
    [t.join(120) for t in threads]
    assert not errors, errors
    hkv = whole_kv[0].shape[3] // 2
    for r in range(2):
        logits, kv = out[r]
        assert logits.shape == whole.shape and (logits - whole).abs().max().item() < 1e-12
        for layer in range(len(kv)):
            mine = whole_kv[layer][:, :, :, r * hkv:(r + 1) * hkv]
            assert (kv[layer] - mine).abs().max().item() < 1e-12
    return whole


@pytest.mark.parametrize("rows", [[0] * 5 + [1] * 2, [-1] * 5 + [0] * 2], ids=["two-adapters", "base-and-one"])
def test_sharded_lora_adapters_equal_the_whole_model(tmp_path, rows):
    """peft adapters under two-way tensor parallelism: each rank serves its cut of them (``B``'s
    rows of a column-parallel projection, ``A``'s columns of a row-parallel one, whose partial
    terms join the partial output before the all-reduce); the logits equal one whole model's
    with the same adapters, which differ from the base model's."""
    pytest.importorskip("peft", reason="peft makes the adapters (test extra)")
    from test_serve_lora import make_models
    base, ads = make_models(tmp_path)
    adapters = [("all", ads["all"]), ("qv", ads["qv"])]
    with_adapters = _sharded_equals_whole(base, adapters=adapters, lora_rows=rows)
    plain = _forward(base, torch.float64, 0, 1, None)[0]
    assert (with_adapters - plain).abs().max().item() > 1e-3


def test_shard_rules_and_clear_errors(tmp_path):
    from gpu_anchor.serve import shards
    from gpu_anchor.serve.model_runner import load_config, param_specs
    mc = load_config(make_tiny_model(str(tmp_path / "m"), "qwen2", seed=0))
    full = dict((n, s) for n, s, _ in param_specs(mc, torch.float32))
    parts = [dict((n, s) for n, s, _ in shards.shard_specs(param_specs(mc, torch.float32), mc.vocab_size, r, 2))
             for r in range(2)]
    assert parts[0]["model.layers.0.self_attn.q_proj.weight"] == (full["model.layers.0.self_attn.q_proj.weight"][0] // 2,
                                                                  mc.hidden_size)
    assert parts[1]["model.layers.0.self_attn.k_proj.bias"] == (full["model.layers.0.self_attn.k_proj.bias"][0] // 2,)
    assert parts[0]["model.layers.0.mlp.down_proj.weight"] == (mc.hidden_size, mc.intermediate_size // 2)
    assert parts[1]["lm_head.weight"] == (mc.vocab_size // 2, mc.hidden_size)
    assert parts[0]["model.norm.weight"] == full["model.norm.weight"]          # replicated
    for n in (3, 5):
        with pytest.raises(ValueError, match=f"num_attention_heads 4 is not divisible by {n}"):
            shards.check(mc, n)
    with pytest.raises(ValueError, match="num_key_value_heads 2 is not divisible by 4"):
        shards.check(mc, 4)


def test_random_weights_are_drawn_in_row_blocks_and_every_shard_is_a_slice_of_the_whole(monkeypatch):
    """``init_random`` draws a tensor a few rows at a time (bounded memory); each rank's shard of a
    2- or 3-way split is exactly its slice of the whole tensor's draw (rows, columns, vocabulary)."""
    from gpu_anchor.serve import model_runner as M, shards

    class Cfg:
        initializer_range = 0.02
    monkeypatch.setattr(M, "DRAW_ELEMENTS", 40)          # several blocks per tensor
    full = {"model.layers.0.self_attn.q_proj.weight": (12, 8), "model.layers.0.self_attn.o_proj.weight": (8, 12),
            "model.embed_tokens.weight": (30, 8), "model.layers.0.input_layernorm.weight": (8,),
            "lm_head.weight": (30, 8)}
    whole = {n: torch.empty(s) for n, s in full.items()}
    M.init_random(whole, Cfg, seed=3)
    assert torch.equal(whole["model.layers.0.input_layernorm.weight"], torch.ones(8))
    for n in (2, 3):
        for r in range(n):
            specs = shards.shard_specs([(k, s, torch.float32) for k, s in full.items()], 30, r, n)
            part = {k: torch.empty(s) for k, s, _ in specs}
            M.init_random(part, Cfg, seed=3, full_shapes=full,
                          part=lambda name, shape: shards.index(name, shape, 30, r, n))
            for k, _, _ in specs:
                ix = shards.index(k, full[k], 30, r, n)
                assert torch.equal(part[k], whole[k] if ix is None else whole[k][ix]), (k, n, r)


def test_bad_tensor_parallel_options_are_refused_clearly(tmp_path):
    model = make_tiny_model(str(tmp_path / "tiny-qwen3"), "qwen3", seed=3)

    def serve(*argv):
        return preloaded.run([sys.executable, "-m", "gpu_anchor.serve", model, "--device", "cpu", "--no-anchor",
                              *argv], timeout=180, preload=preloaded.HF)
    r = serve("--tensor-parallel-size", "3")
    assert r.returncode == 2 and "num_attention_heads 4 is not divisible by 3" in r.stderr, r.stderr
    r = serve("--tensor-parallel-size", "2", "--warm-pool")
    assert r.returncode == 2 and "a standby per rank is not built yet" in r.stderr, r.stderr
    r = serve("--tensor-parallel-size", "0")
    assert r.returncode == 2 and "must be >= 1" in r.stderr, r.stderr


# ------------------------------------------------------------------ through gpu-anchor serve
def _start(directory, port_file, model, *args, env=None):
    """``gpu-anchor serve MODEL ARGS`` logging to ``directory/serve.log``: (process, base URL)."""
    proc = preloaded.Popen([sys.executable, "-m", "gpu_anchor.serve", model, "--port", "0",
                            "--port-file", str(port_file), *args],
                           stdout=subprocess.DEVNULL, stderr=open(directory / "serve.log", "ab"), env=env,
                           preload=preloaded.HF)
    deadline = time.time() + 180
    while not port_file.exists():
        if proc.poll() is not None or time.time() > deadline:
            stop_server(proc)
            raise AssertionError((directory / "serve.log").read_text()[-3000:])
        time.sleep(0.1)
    return proc, f"http://127.0.0.1:{port_file.read_text()}"


@pytest.fixture
def serve(tmp_path, host_daemon):
    """``start(*args, env=None, socket=True) -> base URL`` of a ``gpu-anchor serve`` of the tiny
    Qwen3 (``socket``: use the test's host daemon; else each device's default one, in the
    test's socket directory); ``stop()`` stops the last one."""
    model = make_tiny_model(str(tmp_path / "tiny-qwen3"), "qwen3", seed=3)
    procs, count = [], itertools.count()

    def start(*extra, env=None, socket=True):
        port_file = tmp_path / f"port{next(count)}"          # start() may run in two threads at once
        sock = ["--socket", host_daemon[0]] if socket else []
        proc, base = _start(tmp_path, port_file, model, *sock, *extra, env=env)
        procs.append(proc)
        return base

    def stop():
        p = procs[-1]
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()

    start.stop, start.model, start.log = stop, model, tmp_path / "serve.log"
    yield start
    for p in procs:
        stop_server(p)


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    """One float64 ``--tensor-parallel-size 2`` server, with a daemon and a socket directory of
    its own, for the tests that stream through it and kill or drop its ranks: each counts
    what its own faults did (restarts, log lines) from where it started, and ends with the
    group serving.  ``{"base", "log", "socket"}``."""
    with own_daemon(tmp_path_factory, "tp2") as (d, path):
        model = make_tiny_model(str(d / "tiny-qwen3"), "qwen3", seed=3)
        proc, base = _start(d, d / "port", model, "--socket", path, *CPU64, "--tensor-parallel-size", "2")
        try:
            _wait_up(base)
            yield {"base": base, "log": d / "serve.log", "socket": path}
        finally:
            stop_server(proc)


def _client(base):
    import openai
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", timeout=300, max_retries=0)


def _job(namespace="serve-tiny-qwen3") -> dict:
    """The job record ``gpu-anchor status`` shows."""
    from gpu_anchor.launch import jobstate
    return {j["namespace"]: j for j in jobstate.load_all()}[namespace]


def _ranks() -> dict[int, int]:
    """rank -> pid of the engine group now running."""
    return {int(r): info["pid"] for r, info in _job()["ranks"].items()}


def _wait(cond, what, timeout=180):
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _serving_group(base, old_pid):
    """Wait for a new engine group to serve; its ranks' pids."""
    def up():
        pid = json.loads(_get(base + "/health")[1]).get("engine_pid")
        return pid not in (None, old_pid) and _ranks().get(0) == pid
    _wait(up, "a new engine group")
    return _ranks()


def _kill_while_streaming(base, jobs, victims, kills):
    """Stream ``jobs``; ``kills`` times, once every stream made progress and a group serves,
    SIGKILL the ranks ``victims(ranks)`` names.  Returns the results and how many streams were
    open at each kill."""
    c = _client(base)
    streams = [_Stream(c, j) for j in jobs]
    open_at_kill, pid0 = [], None
    for _ in range(kills):
        mark = [s.chunks for s in streams]
        _wait(lambda: all(s.chunks >= m + 3 or s.finish for s, m in zip(streams, mark)), "stream progress")
        ranks = _serving_group(base, pid0)
        pid0 = ranks[0]
        open_at_kill.append(sum(s.finish is None for s in streams))
        for r in victims(ranks):
            os.kill(ranks[r], signal.SIGKILL)
    return [s.result() for s in streams], open_at_kill


def test_tp2_answers_as_tp1(serve):
    """Float32: the same greedy tokens; the logits differ only where the all-reduce sums two
    halves instead of one whole (last bits), so the log-probabilities agree to 1e-4."""
    args = ["--device", "cpu", "--dtype", "float32", "--block-size", "4", "--num-blocks", "300",
            "--max-num-batched-tokens", "32", "--max-model-len", "512", "--cpu-threads", "1"]
    jobs = [j for j in _two_kill_jobs() if j.get("temperature") == 0]
    assert any("logprobs" in j for j in jobs) and any("logprobs" not in j for j in jobs)
    got = {}
    # both servers start at once, each in its own namespace: their start-ups overlap
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        bases = dict(zip((1, 2), pool.map(
            lambda tp: serve(*args, "--tensor-parallel-size", str(tp), "--namespace", f"tp{tp}"), (1, 2))))
    for tp, base in bases.items():
        _wait_up(base)
        streams = [_Stream(_client(base), j) for j in jobs]
        got[tp] = [s.result() for s in streams]
        got[tp, "lps"] = [s.lps for s in streams]
    assert [g["ids"] for g in got[1]] == [g["ids"] for g in got[2]]
    assert all(g["ids"] for g, j in zip(got[1], jobs) if "logprobs" in j)
    assert [g["text"] for g in got[1]] == [g["text"] for g in got[2]]
    diff = max(abs(a - b) for x, y in zip(got[1, "lps"], got[2, "lps"]) for a, b in zip(x, y))
    assert diff < 1e-4, diff


def test_rank_kills_keep_every_stream_token_identical(tp2):
    """Rank 1 SIGKILLed three times mid-stream, then both ranks at once twice: every stream
    (chat and completions, greedy and seeded sampling, with and without log-probabilities)
    equals its fault-free run, with the same usage; no replayed token differs."""
    base = tp2["base"]
    n0, log0 = len(_job()["restarts"]), len(tp2["log"].read_text())
    jobs = _two_kill_jobs()
    ref = [s.result() for s in [_Stream(_client(base), j) for j in jobs]]
    before = scrape(base)
    got, open1 = _kill_while_streaming(base, jobs, lambda ranks: [1], 3)
    assert got == ref
    got, open2 = _kill_while_streaming(base, jobs, lambda ranks: sorted(ranks), 2)
    assert got == ref
    assert open1[0] == len(jobs) and open2[0] == len(jobs), (open1, open2)
    m = scrape(base)
    assert m["gpu_anchor_serve_engine_restarts_total"] - before.get("gpu_anchor_serve_engine_restarts_total", 0) == 5
    assert m["gpu_anchor_serve_token_mismatch_total"] == 0
    from gpu_anchor.launch import jobstate
    job = _job()
    ours = job["restarts"][n0:]
    assert job["nproc"] == 2 and len(ours) == 5
    assert {(r["action"], r["kind"]) for r in ours} == {("restart", "shallow")}
    assert all("engine rank 1 killed by SIGKILL" in r["reason"] for r in ours[:3]), ours
    text = jobstate.format_jobs([job])
    assert "serving engine group (2 tensor-parallel ranks)" in text and "engine rank 1: pid" in text, text
    # not built for a group: a migration is refused with a reason, and the group serves on
    import urllib.error
    import urllib.request
    req = urllib.request.Request(base + "/admin/migrate", json.dumps({"device": "cpu"}).encode(),
                                 {"content-type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=60)
    assert e.value.code == 400 and "tensor-parallel engine group is not supported" in e.value.read().decode()
    assert [s.result() for s in [_Stream(_client(base), j) for j in jobs[:2]]] == ref[:2]
    # the anchored KV was reused every time: no rank asked for a recompute
    assert "anchored KV state unusable" not in tp2["log"].read_text()[log0:]


def test_constrained_streams_across_rank_kills(tp2):
    """Structured output on a tensor-parallel group (rank 0 masks and samples): a JSON-schema
    stream and a regex stream, rank 1 SIGKILLed twice mid-stream; each equals its fault-free run."""
    pytest.importorskip("llguidance",
                        reason="structured output needs llguidance (gpu-anchor[serve]; make test installs it)")
    colors = {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 40, "maxItems": 40}
    jobs = [{"prompt": "colors", "max_tokens": 300, "temperature": 0.9, "seed": 3, "stream": True,
             "extra_body": {"structured_outputs": {"json": colors, "disable_any_whitespace": True}}},
            {"messages": [{"role": "user", "content": "codes"}], "max_tokens": 200, "temperature": 1.0, "seed": 4,
             "stream": True, "extra_body": {"guided_regex": "([A-Z]{3}-[0-9]{4}\n){12}"}}]
    ref = [s.result() for s in [_Stream(_client(tp2["base"]), j) for j in jobs]]
    assert len(json.loads(ref[0]["text"])) == 40 and ref[1]["finish"] == "stop"
    got, open_at = _kill_while_streaming(tp2["base"], jobs, lambda ranks: [1], 2)
    assert got == ref and open_at[0] == len(jobs), open_at


def test_self_kills_at_every_phase_on_either_rank(serve):
    """``--fault-plan``: every engine group has one random rank SIGKILL itself at a random step
    and phase (between steps, mid-prefill, mid-decode, before and after rank 0's commit)."""
    base = serve(*CPU64, "--tensor-parallel-size", "2", "--fault-plan", f"7:2:{KILLS}")
    # without ignore_eos (the in-process reference stops at EOS as the server does)
    jobs = [{k: v for k, v in j.items() if k not in ("extra_body", "echo", "logprobs")} for j in _two_kill_jobs()[4:]]
    jobs += [dict(j, max_tokens=40) for j in jobs]
    ref = _reference(serve.model, jobs)
    c = _client(base)
    waves = 0
    while waves < 6:
        got = [s.result() for s in [_Stream(c, j) for j in jobs]]
        assert [g["text"] for g in got] == [t for t, _ in ref]
        waves += 1
        if scrape(base)["gpu_anchor_serve_engine_restarts_total"] >= KILLS:
            break
    m = scrape(base)
    assert m["gpu_anchor_serve_engine_restarts_total"] >= KILLS and m["gpu_anchor_serve_token_mismatch_total"] == 0
    job = _job()
    assert {r["rank"] for r in job["restarts"]} == {0, 1}, [r["reason"] for r in job["restarts"]]


def test_a_rank_whose_state_is_gone_makes_every_rank_recompute(tp2):
    """Rank 1's anchored weights and KV dropped from the daemon, then rank 1 killed: the new
    rank 1 reloads its shard and says its KV is new; rank 0 (whose KV is intact) recomputes
    every request's prefill with it, and every stream still equals its fault-free run."""
    from gpu_anchor.client.channel import Channel
    base, log0 = tp2["base"], len(tp2["log"].read_text())
    jobs = _two_kill_jobs()[:4]
    ref = [s.result() for s in [_Stream(_client(base), j) for j in jobs]]

    def drop_rank1(ranks):
        ch = Channel("cpu", tp2["socket"], timeout=10)
        try:
            ch.request({"op": "drop", "namespace": "serve-tiny-qwen3/rank1"})
        finally:
            ch.close()
        return [1]
    got, _ = _kill_while_streaming(base, jobs, drop_rank1, 1)
    assert got == ref
    log = tp2["log"].read_text()[log0:]
    assert "rank 1: the KV cache memory is new" in log and "recomputing the prefill" in log, log[-3000:]
    assert scrape(base)["gpu_anchor_serve_token_mismatch_total"] == 0


# ------------------------------------------------------------------ two GPUs, NCCL
def _two_gpus() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


@pytest.mark.gpu
@pytest.mark.skipif(not _two_gpus(), reason="needs two CUDA GPUs")
@pytest.mark.parametrize("mode", ["float64-eager", "float32-graphs"])
def test_two_gpus_nccl_rank_kills_token_identical(serve, tmp_path, mode):
    """``--tensor-parallel-size 2`` on cuda:0 + cuda:1 (NCCL; a daemon per GPU): TP = 2 greedy
    equals TP = 1; rank 1 SIGKILLed three times mid-stream, then both ranks twice: every stream
    equals its fault-free run.  float64 runs the reference attention eagerly (exact on any
    batch); float32 runs the Triton kernel and CUDA-graph decode, whose captured graphs hold
    the NCCL all-reduces.  The NVLink-multicast switches are set in every process."""
    dtype, graphs = mode.split("-")
    args = ["--device", "cuda:0", "--dtype", dtype, "--block-size", "16", "--num-blocks", "400",
            "--max-num-batched-tokens", "64", "--max-model-len", "512"] + (["--enforce-eager"] if graphs == "eager" else [])
    env = dict(os.environ, **NCCL_ENV)
    jobs = _two_kill_jobs()
    greedy = [j for j in jobs if j.get("temperature") == 0]
    try:
        base = serve(*args, "--namespace", f"gpu-tp1-{mode}", env=env, socket=False)
        _wait_up(base)
        tp1 = [s.result() for s in [_Stream(_client(base), j) for j in greedy]]
        serve.stop()
        base = serve(*args, "--tensor-parallel-size", "2", env=env, socket=False)
        _wait_up(base)
        ranks = _ranks()
        for pid in [*ranks.values(), _job()["supervisor_pid"], _job()["frontend_pid"]]:
            with open(f"/proc/{pid}/environ", "rb") as f:
                seen = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            assert all(seen.get(k.encode()) == v.encode() for k, v in NCCL_ENV.items()), seen
        ref = [s.result() for s in [_Stream(_client(base), j) for j in jobs]]
        assert [(r["text"], r["ids"]) for r, j in zip(ref, jobs) if j in greedy] == \
            [(t["text"], t["ids"]) for t in tp1]
        got, _ = _kill_while_streaming(base, jobs, lambda ranks: [1], 3)
        assert got == ref
        got, _ = _kill_while_streaming(base, jobs, lambda ranks: sorted(ranks), 2)
        assert got == ref
        m = scrape(base)
        assert m["gpu_anchor_serve_engine_restarts_total"] == 5 and m["gpu_anchor_serve_token_mismatch_total"] == 0
        assert "anchored KV state unusable" not in serve.log.read_text()
        serve.stop()
    finally:
        from gpu_anchor.paths import default_socket
        for dev in ("cuda:0", "cuda:1"):          # the daemons serve started hold GPU memory: stop them
            if control.ping(dev, default_socket(dev)) is not None:
                control.stop(dev, default_socket(dev))


def test_a_rank_follows_rank_0s_adapter_table_or_stops_naming_why(tmp_path):
    """``lora_slots.follow_table`` on a rank > 0: it loads what rank 0's table names into the
    same slot, drops what the table no longer names, and raises, naming the adapter, when the
    file's tensors are not what rank 0 read or rank 0's slot is taken here."""
    pytest.importorskip("peft", reason="peft makes the adapters (test extra)")
    from safetensors.torch import load_file

    from gpu_anchor.serve import lora as L
    from gpu_anchor.serve import lora_slots
    from test_serve_lora import make_models
    base, ads = make_models(tmp_path)
    w = load_file(os.path.join(base, "model.safetensors"))
    read = lambda name, path: L.read(name, path, w, 16)          # noqa: E731
    digest = {n: read(n, p).digest for n, p in ads.items()}
    mine = lora_slots.load([], w, torch.float32, "cpu", None, 16, 2, runtime=True)
    lora_slots.follow_table(mine, [["qv", ads["qv"], 1, digest["qv"]]], read)
    assert mine.slots == {"qv": 1}
    lora_slots.follow_table(mine, [["all", ads["all"], 0, digest["all"]]], read)
    assert mine.slots == {"all": 0}
    with pytest.raises(L.AdapterError, match="'qv': the tensors at .* are not the ones rank 0 read"):
        lora_slots.follow_table(mine, [["all", ads["all"], 0, digest["all"]], ["qv", ads["qv"], 1, digest["all"]]],
                                read)
    other = lora_slots.load([], w, torch.float32, "cpu", None, 16, 2, runtime=True)
    other.put(read("all", ads["all"]), 1)          # given at start here (not in the table), where rank 0 has none
    with pytest.raises(L.AdapterError, match="'qv': slot 1 is not free on this rank"):
        lora_slots.follow_table(other, [["qv", ads["qv"], 1, digest["qv"]]], read)
