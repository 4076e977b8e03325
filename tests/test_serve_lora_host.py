"""``--max-cpu-loras`` (vLLM's): the host keeps the tensors of that many adapters, and a parked
adapter beyond them is read again from its files when a request needs it; its requests are ended
with the reason, naming it, when those files are gone or changed (never run on other weights).
Through the engine, through ``gpu-anchor serve`` with the ``openai`` client, and across an
engine SIGKILL in the middle of a stream on such an adapter."""
from __future__ import annotations

import json
import os
import shutil
import sys
import threading
import time

import pytest

import preloaded
from gpu_anchor.serve.engine import Engine, EngineConfig
from gpu_anchor.serve.sequence import SamplingParams
from test_serve_lora import PROMPTS, _adapter, _peft_greedy, make_models, serve_refuses

pytest.importorskip("peft", reason="peft makes the adapters (test extra)")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The tiny Qwen3, ``all`` and ``qv`` (``make_models``), and ``mlp`` (rank 4 on gate and down)."""
    d = tmp_path_factory.mktemp("lora-host")
    base, ads = make_models(d)
    ads["mlp"] = _adapter(base, str(d / "mlp"), seed=7, target_modules=["gate_proj", "down_proj"])
    return base, ads


@pytest.fixture(scope="module")
def want(models):
    base, ads = models
    return {n: _peft_greedy(base, ads.get(n), PROMPTS, 10) for n in ("all", "qv", "mlp", None)}


def _engine(base, lora, **kw):
    return Engine(EngineConfig(model=base, anchor=False, dtype="float64", block_size=4, num_blocks=200,
                               max_batched_tokens=32, lora=tuple(lora), **kw))


def _run(eng, jobs, max_tokens=10):
    """Run ``jobs`` ([(rid, prompt, adapter)]) to their end, checking after every step that the
    host holds no more adapters' tensors than ``--max-cpu-loras``; ``(tokens, failures)``."""
    out = {rid: [] for rid, _, _ in jobs}
    for rid, p, n in jobs:
        eng.add_request(rid, p, SamplingParams(max_tokens=max_tokens, ignore_eos=True, lora=n))
    failures = []
    while eng.has_work():
        for rid, _, toks, _ in eng.step():
            out[rid] += toks
        failures += eng.failures
        eng.failures.clear()
        bound = eng.cfg.max_cpu_loras
        assert bound is None or len(eng.model.lora.host) <= bound, list(eng.model.lora.host)
    return out, failures


def test_adapters_beyond_the_host_bound_are_read_again_and_decode_as_peft(models, want):
    """Three adapters, one slot, the host keeping one adapter's tensors: every prompt on every
    adapter and on the base model, all in one engine; the adapters take the slot in turns, each
    one read again from its files when it comes back, and every request ends on peft's tokens."""
    base, ads = models
    eng = _engine(base, ads.items(), max_loras=1, max_cpu_loras=1)
    lo = eng.model.lora
    assert lo.parked == ["qv", "mlp"] and list(lo.host) == ["all"]
    jobs = [(f"{n}-{i}", p, n) for i, p in enumerate(PROMPTS) for n in ("all", "qv", "mlp", None)]
    got, failures = _run(eng, jobs)
    assert not failures
    for rid, _, n in jobs:
        assert got[rid] == want[n][int(rid.rsplit("-", 1)[1])], rid
    assert lo.stats["swaps"] >= 2 and lo.host.stats["reads"] >= 2, (lo.stats, lo.host.stats)
    # unbounded (the default): nothing is read again, the same tokens
    eng = _engine(base, ads.items(), max_loras=1)
    again, failures = _run(eng, jobs)
    assert again == got and not failures and eng.model.lora.host.stats["reads"] == 0 and len(eng.model.lora.host) == 3


def test_a_parked_adapter_whose_files_changed_or_went_is_refused_by_name(models, want, tmp_path):
    """``b`` (a copy of ``qv``) waits on disk; its files are rewritten with other tensors: a
    request on it is ended with the reason, naming it, while the requests on ``all`` and the base
    model in the same steps end on peft's tokens.  Its files removed: the same, with the reason.
    Put back as they were: served again, on peft's tokens."""
    from safetensors.torch import load_file, save_file
    base, ads = models
    b = shutil.copytree(ads["qv"], tmp_path / "b")
    eng = _engine(base, [("all", ads["all"]), ("b", str(b))], max_loras=1, max_cpu_loras=1)
    assert eng.model.lora.parked == ["b"] and "b" not in eng.model.lora.host
    f = os.path.join(b, "adapter_model.safetensors")
    original = open(f, "rb").read()
    save_file({k: t * 2 for k, t in load_file(f).items()}, f)
    jobs = [("on-all", PROMPTS[0], "all"), ("on-b", PROMPTS[1], "b"), ("on-base", PROMPTS[2], None)]
    got, failures = _run(eng, jobs)
    assert [rid for rid, _ in failures] == ["on-b"]
    assert f"LoRA adapter 'b': its tensors at {b} are not the ones it was served with" in failures[0][1]
    assert "the files changed" in failures[0][1]
    assert got["on-all"] == want["all"][0] and got["on-base"] == want[None][2] and got["on-b"] == []
    assert eng.model.lora.slots == {"all": 0}         # nothing of the changed files was written
    shutil.rmtree(b)
    got, failures = _run(eng, [("on-b-2", PROMPTS[1], "b")])
    assert failures == [("on-b-2", f"LoRA adapter 'b': no adapter_config.json in {b} (a directory as peft's "
                                   "save_pretrained writes it)")]
    shutil.copytree(ads["qv"], b)
    assert open(f, "rb").read() == original
    got, failures = _run(eng, [("on-b-3", PROMPTS[1], "b")])
    assert not failures and got["on-b-3"] == want["qv"][1]
    # the offline ``generate`` raises the reason
    gone = shutil.copytree(ads["all"], tmp_path / "all")
    eng = _engine(base, [("b", str(b)), ("all", str(gone))], max_loras=1, max_cpu_loras=1)
    shutil.rmtree(gone)
    with pytest.raises(ValueError, match="request gen-0: LoRA adapter 'all': no adapter_config.json"):
        eng.generate([PROMPTS[0]], SamplingParams(max_tokens=4, lora="all"))


def test_a_request_waits_for_its_adapters_files_while_the_others_decode(models, want):
    """``mlp``'s files are read on a thread of their own, held there until the test lets them
    go: meanwhile its request waits and the requests on ``all`` and on the base model decode
    step after step; once read, ``mlp``'s request is admitted and ends on peft's tokens, and its
    files were read once, by that thread (the step that puts it in a slot reads nothing)."""
    base, ads = models
    eng = _engine(base, ads.items(), max_loras=2, max_cpu_loras=2)
    lo = eng.model.lora
    assert lo.parked == ["mlp"] and "mlp" not in lo.host
    gate, reads, inner = threading.Event(), [], lo.host._reader

    def gated(name, path):
        reads.append((name, threading.current_thread().name))
        assert gate.wait(120), "the test never let the read finish"
        return inner(name, path)
    lo.host._reader = gated
    jobs = [("on-all", PROMPTS[0], "all"), ("on-mlp", PROMPTS[1], "mlp"), ("on-base", PROMPTS[2], None)]
    out = {rid: [] for rid, _, _ in jobs}
    for rid, p, n in jobs:
        eng.add_request(rid, p, SamplingParams(max_tokens=10, ignore_eos=True, lora=n))
    for _ in range(6):
        for rid, _, toks, _ in eng.step():
            out[rid] += toks
    assert len(out["on-all"]) >= 5 and len(out["on-base"]) >= 5 and out["on-mlp"] == [], out
    assert eng.load()["lora"]["waiting"] == ["mlp"] and reads == [("mlp", "lora-read-mlp")]
    gate.set()
    while eng.has_work():
        for rid, _, toks, _ in eng.step():
            out[rid] += toks
    assert not eng.failures
    assert out == {"on-all": want["all"][0], "on-mlp": want["mlp"][1], "on-base": want[None][2]}
    assert reads == [("mlp", "lora-read-mlp")] and lo.host.stats["read_ahead"] == 1 and lo.host.stats["reads"] == 1
    assert lo.slots.keys() >= {"mlp"} and len(lo.host) <= 2


def _host(capacity=1):
    """A ``HostCopies`` over fake adapters whose reads the test finishes (``go[name].set()``)."""
    from gpu_anchor.serve.lora import Adapter
    from gpu_anchor.serve.lora_host import HostCopies
    served, go, calls, files = {}, {}, [], {}

    def reader(name, path):
        calls.append(name)
        assert go.setdefault(name, threading.Event()).wait(60)
        if files.get(name) is None:
            raise FileNotFoundError(f"no adapter_config.json in {path}")
        return Adapter(name, path, 4, {}, files[name])
    return HostCopies(capacity, reader, served), served, go, calls, files


def _settle(host):
    host._ahead.done.wait(60)


def test_reads_ahead_go_one_at_a_time_and_join_the_lru_only_as_served():
    host, served, go, calls, files = _host(capacity=1)
    for n in "abc":
        served[n], files[n], go[n] = (f"/ads/{n}", f"d-{n}", False), f"d-{n}", threading.Event()
    assert not host.ready("a") and not host.ready("b") and calls == ["a"]    # b waits its turn
    go["a"].set()
    _settle(host)
    assert host.ready("a")
    assert not host.ready("b")                  # a's read, not taken by a step, joins the LRU
    assert list(host) == ["a"] and calls == ["a", "b"]
    served["b"] = ("/ads/b", "d-b2", True)      # replaced (load_inplace) while its old files were read
    go["b"].set()
    _settle(host)
    assert not host.ready("c") and list(host) == ["a"]     # b's read is not what b is served as now
    assert host.fetch(["a"]) == {} and host.stats["wait_s"] == 0.0
    go["c"].set()
    assert host.fetch(["c"]) == {} and list(host) == ["c"]    # the read under way, waited for; a dropped
    assert calls == ["a", "b", "c"] and host.stats["reads"] == 2 and host.stats["read_ahead"] == 3    # a and c


def test_a_failed_read_ahead_is_read_again_by_the_step():
    host, served, go, calls, files = _host()
    served["a"] = ("/ads/a", "d-a", False)
    go["a"] = threading.Event()
    go["a"].set()
    assert not host.ready("a")
    _settle(host)
    assert host.ready("a")                      # the read ended: the step learns how
    files["a"] = "d-a"                          # the files came back meanwhile
    assert host.fetch(["a"]) == {} and calls == ["a", "a"] and "a" in host
    served["b"], go["b"] = ("/ads/b", "d-b", False), go["a"]
    assert not host.ready("b")
    _settle(host)
    assert host.fetch(["b"]) == {"b": "LoRA adapter 'b': FileNotFoundError: no adapter_config.json in /ads/b"}
    files["b"] = "other"
    assert "its tensors at /ads/b are not the ones it was served with" in host.fetch(["b"])["b"]
    assert list(host) == ["a"] and host.stats["reads"] == 1
    # read ahead, then the files and the adapter replaced (load_inplace of the same path) before a
    # step takes the read: the step reads the new files instead of refusing the stale tensors
    assert not host.ready("b")
    _settle(host)
    served["b"], files["b"] = ("/ads/b", "new", True), "new"
    calls.clear()
    assert host.fetch(["b"]) == {} and calls == ["b"] and host["b"].digest == "new"


def test_the_bound_is_checked_before_anything_starts(models, capsys):
    base, ads = models
    args = [base, "--device", "cpu", "--enable-lora", "--lora-modules", f"a={ads['all']}", f"b={ads['qv']}"]
    r = preloaded.run([sys.executable, "-m", "gpu_anchor.serve", *args, "--max-loras", "2", "--max-cpu-loras", "1"],
                      timeout=120, preload=preloaded.HF)
    assert r.returncode == 2 and "--max-cpu-loras (1) must be at least --max-loras (2)" in r.stderr, r.stderr[-2000:]
    code, err = serve_refuses(capsys, *args, "--max-cpu-loras", "0")
    assert code == 2 and "--max-cpu-loras (0) must be at least --max-loras (2)" in err, err[-2000:]


def test_the_server_reads_a_parked_adapter_again_across_an_engine_kill(models, want, tmp_path, host_daemon):
    """``gpu-anchor serve --enable-lora --max-loras 1 --max-cpu-loras 1`` with three adapters:
    the ``openai`` client gets peft's tokens on each; a stream on ``mlp`` (beyond the host's
    bound) whose engine is SIGKILLed in the middle ends on peft's tokens (the new engine keeps only
    ``all``'s tensors and reads ``mlp``'s again for the restored request); then, ``qv``'s files
    changed, a request on it is refused with the reason and one on ``all`` still served."""
    import openai
    from safetensors.torch import load_file, save_file

    from tests.test_serve_api import start_server
    from tests.test_serve_http import scrape, stop_server, stream_across_engine_kill
    base, ads = models
    qv = shutil.copytree(ads["qv"], tmp_path / "qv")
    proc, url, log = start_server(str(tmp_path), base, "--socket", host_daemon[0], "--served-model-name", "tiny",
                                  "--enable-lora", "--max-loras", "1", "--max-cpu-loras", "1", "--lora-modules",
                                  f"all={ads['all']}", f"qv={qv}", json.dumps({"name": "mlp", "path": ads["mlp"]}))
    try:
        c = openai.OpenAI(base_url=url + "/v1", api_key="-")
        long = _peft_greedy(base, ads["mlp"], PROMPTS[:1], 24)[0]

        def ids(r):
            return [int(t.split(":")[1]) for t in r.choices[0].logprobs.tokens]
        kw = dict(prompt=PROMPTS[0], temperature=0, logprobs=0,
                  extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
        for n in ("all", "qv", "mlp"):
            assert ids(c.completions.create(model=n, max_tokens=10, **kw)) == want[n][0], n
        items = stream_across_engine_kill(url, lambda: c.completions.create(model="mlp", max_tokens=24, stream=True,
                                                                            **kw))
        assert [t for x in items if x.choices for t in ids(x)] == long
        text = open(log).read()
        assert "; 1 restored request(s)" in text, text[-3000:]
        f = os.path.join(qv, "adapter_model.safetensors")
        save_file({k: t * 2 for k, t in load_file(f).items()}, f)
        with pytest.raises(openai.BadRequestError, match="LoRA adapter 'qv': its tensors at .* are not the ones"):
            c.completions.create(model="qv", max_tokens=10, **kw)
        assert ids(c.completions.create(model="all", max_tokens=10, **kw)) == want["all"][0]
        # /metrics: the reads of files (the first engine's and its successor's, summed) and the
        # seconds steps waited for them, a counter (the engine's statistics come after the tokens)
        deadline = time.time() + 30
        while (got := scrape(url)).get("gpu_anchor_serve_lora_reads_total", 0) < 2:
            assert time.time() < deadline, {k: v for k, v in got.items() if "lora" in k}
            time.sleep(0.2)
        assert got["gpu_anchor_serve_lora_read_wait_seconds_total"] >= 0
    finally:
        stop_server(proc)


@pytest.mark.gpu
def test_on_cuda_adapters_read_again_reach_the_graphs_as_peft(models, cuda_daemon):
    """On CUDA in float32 (fused kernels, CUDA graphs, asynchronous scheduling; anchored): three
    adapters, one slot, the host keeping one adapter's tensors; every request on every adapter and
    on the base model ends on transformers + peft's greedy tokens on the same GPU."""
    import torch
    base, ads = models
    torch.backends.cuda.matmul.allow_tf32 = False
    eng = Engine(EngineConfig(model=base, device="cuda:0", dtype="float32", block_size=16, num_blocks=256,
                              namespace="lora-host-gpu", socket=cuda_daemon[0], lora=tuple(ads.items()),
                              max_loras=1, max_cpu_loras=1))
    jobs = [(f"{n}-{i}", p, n) for i, p in enumerate(PROMPTS) for n in ("all", "qv", "mlp", None)]
    got, failures = _run(eng, jobs, max_tokens=12)
    assert not failures and eng.step_counts["graph"] > 0 and eng.model.fused
    host = eng.model.lora.host
    assert host.stats["reads"] >= 2, host.stats
    for n in ("all", "qv", "mlp", None):
        want = _peft_greedy(base, ads.get(n), PROMPTS, 12, "cuda:0", "float32")
        assert [got[f"{n}-{i}"] for i in range(len(PROMPTS))] == want, n


def test_the_digest_is_the_one_journals_hold():
    """``lora._digest`` hashes in chunks: the value must stay the one a tensor-by-tensor hash
    gives (journal records of adapters written before the change are compared with it)."""
    import hashlib

    import torch

    from gpu_anchor.serve.lora import _digest
    g = torch.Generator().manual_seed(0)
    tensors = {(layer, p): (torch.randn(4, 32, generator=g).to(dt), torch.randn(48, 4, generator=g).to(dt))
               for layer, dt in ((0, torch.bfloat16), (1, torch.float32), (10, torch.float16))
               for p in ("q_proj", "down_proj")}
    h = hashlib.blake2b(digest_size=16)
    for (layer, p), pair in sorted(tensors.items()):
        h.update(f"{layer}.{p}".encode())
        for t in pair:
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    assert _digest(tensors) == _digest(tensors, chunk=1) == _digest(tensors, chunk=1 << 30) == h.hexdigest()
