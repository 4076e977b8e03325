"""LoRA adapters served beside the base model (``gpu_anchor/serve/lora.py``): adapters made and
saved by peft, served with vLLM's options, checked token for token against transformers + peft's
own ``generate``, through the engine and through the server and the ``openai`` client, with the
engine SIGKILLed mid-stream; adapters that cannot be served are refused with the reason."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import preloaded
from gpu_anchor.serve import lora as L
from gpu_anchor.serve import lora_slots
from gpu_anchor.testing.tiny import make_tiny_model

pytest.importorskip("peft", reason="peft makes the adapters (test extra)")

PROMPTS = [[5, 17, 42, 99, 7], [3, 3, 8], [120, 64, 9, 11, 250, 31, 2 + 5], [77]]


def _adapter(base: str, path: str, seed: int, **lora_kw) -> str:
    """A peft LoRA adapter of ``base`` with random A and B (peft's default B is zeros, which
    would change nothing), saved as peft saves it."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float64)
    kw = dict(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False)
    peft_model = get_peft_model(model, LoraConfig(**{**kw, **lora_kw}))
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_" in n:
                p.mul_(3.0)              # terms large enough to change greedy tokens
    peft_model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_models(tmp_path_factory.mktemp("lora"))


def make_models(d):
    """A tiny Qwen3 and two peft adapters of it: ``all`` (every projection) and ``qv`` (rank 2,
    rsLoRA, q and v of layer 1)."""
    base = make_tiny_model(str(d / "base"), "qwen3", seed=3)
    a = _adapter(base, str(d / "all-linear"), seed=1)
    b = _adapter(base, str(d / "qv-rank2"), seed=2, r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"],
                 use_rslora=True, layers_to_transform=[1])
    return base, {"all": a, "qv": b}


def _peft_greedy(base: str, adapter: str | None, prompts, max_tokens: int, device: str = "cpu",
                 dtype: str = "float64") -> list[list[int]]:
    """transformers + peft's own greedy ``generate`` of each prompt alone (``adapter`` None: the base)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(base, dtype=getattr(torch, dtype)).to(device)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).to(device)
    out = []
    for p in prompts:
        ids = model.generate(torch.tensor([p], device=device), max_new_tokens=max_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0,
                             attention_mask=torch.ones(1, len(p), dtype=torch.long, device=device))
        out.append(ids[0, len(p):].tolist())
    return out


@pytest.mark.parametrize("slots,seats,swaps", [(0, 64, 0), (1, 64, 1), (1, 2, 4)],
                         ids=["a-slot-each", "one-slot", "one-slot-two-seats"])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-path"])
def test_a_batch_mixing_adapters_and_the_base_decodes_as_peft_does(models, graphs, slots, seats, swaps):
    """Four prompts, each run with the first adapter, the second, and none, all twelve in one
    engine (so steps mix them): each equals transformers + peft's greedy ``generate``.
    ``one-slot`` (``--max-loras 1``): the second adapter waits on the host; its first request is
    held until no running request uses the first adapter, and the younger requests on the first
    adapter or the base model pass it (one swap).  ``one-slot-two-seats`` (``--max-num-seqs 2``):
    only the next two arrivals may pass a held request, so the adapters take the slot in turns."""
    from gpu_anchor.serve.engine import Engine, EngineConfig
    from gpu_anchor.serve.sequence import SamplingParams
    base, ads = models
    eng = Engine(EngineConfig(model=base, anchor=False, dtype="float64", block_size=4, num_blocks=200,
                              max_num_seqs=seats, cuda_graphs=graphs, graph_after_steps=0, lora=tuple(ads.items()),
                              max_loras=slots))
    names = ["all", "qv", None]
    jobs = [(p, n) for p in PROMPTS for n in names]
    got = eng.generate([p for p, _ in jobs], [SamplingParams(max_tokens=12, ignore_eos=True, lora=n) for _, n in jobs])
    if graphs:
        assert eng.step_counts["graph"] > 0
    assert eng.model.lora.capacity == (slots or 2) and eng.model.lora.stats["swaps"] == swaps
    for n in names:
        want = _peft_greedy(base, ads.get(n), PROMPTS, 12)
        assert [g for g, (_, m) in zip(got, jobs) if m == n] == want, n
    assert len({tuple(g) for g, (p, _) in zip(got, jobs) if p == PROMPTS[0]}) == 3   # the adapters changed tokens


def test_an_unknown_adapter_is_refused_by_name(models):
    from gpu_anchor.serve.engine import Engine, EngineConfig
    from gpu_anchor.serve.sequence import SamplingParams
    base, ads = models
    eng = Engine(EngineConfig(model=base, anchor=False, dtype="float64", block_size=4, num_blocks=64,
                              lora=(("all", ads["all"]),)))
    with pytest.raises(ValueError, match="'nope' is not served here \\(served: all\\)"):
        eng.add_request("r", [1, 2], SamplingParams(lora="nope"))


def _edit(src: str, dst, config=None, tensors=None) -> str:
    import shutil

    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    if config:
        cfg = json.load(open(os.path.join(dst, "adapter_config.json")))
        cfg.update(config)
        json.dump(cfg, open(os.path.join(dst, "adapter_config.json"), "w"))
    if tensors:
        f = os.path.join(dst, "adapter_model.safetensors")
        save_file(tensors(load_file(f)), f)
    return str(dst)


def test_what_cannot_be_served_is_refused_with_the_reason(models, tmp_path):
    import torch
    base, ads = models
    from safetensors.torch import load_file
    weights = load_file(os.path.join(base, "model.safetensors"))

    def refused(path, match, max_rank=16):
        with pytest.raises(L.AdapterError, match=match):
            L.read("x", path, weights, max_rank)
    refused(_edit(ads["all"], tmp_path / "dora", {"use_dora": True}), "use_dora = True is not served")
    refused(_edit(ads["all"], tmp_path / "bias", {"bias": "lora_only"}), "bias = 'lora_only' is not served")
    refused(_edit(ads["all"], tmp_path / "save", {"modules_to_save": ["lm_head"]}), "modules_to_save")
    refused(_edit(ads["all"], tmp_path / "head", tensors=lambda t: {
        **t, "base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64)}), "lm_head.lora_A.weight' is not served")
    refused(_edit(ads["all"], tmp_path / "shape", tensors=lambda t: {
        k: (v[:, :10].contiguous() if "layers.0.mlp.up_proj.lora_A" in k else v) for k, v in t.items()}),
        "model.layers.0.mlp.up_proj: lora_A \\(4, 10\\).*do not fit the base weight \\(128, 64\\)")
    refused(ads["all"], "rank 4 at model.layers.0.mlp.down_proj is above --max-lora-rank 2", max_rank=2)
    refused(str(tmp_path), "no adapter_config.json")
    assert L.parse_modules(["a=/x", '{"name": "b", "path": "/y", "base_model_name": "m"}']) == [("a", "/x"), ("b", "/y")]
    for bad, why in ((["a"], "give NAME=PATH"), (["a=/x", "a=/y"], "given twice"), (['{"name": "b"}'], "string name")):
        with pytest.raises(L.AdapterError, match=why):
            L.parse_modules(bad)


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_the_server_serves_adapters_by_model_name_across_an_engine_kill(models, tmp_path, host_daemon, tp):
    """``gpu-anchor serve --enable-lora --lora-modules``: ``/v1/models`` lists each adapter with
    its base as parent; the ``openai`` client asks for an adapter by name and gets peft's tokens,
    also on a stream whose engine is SIGKILLed in the middle (the adapter is in the request's
    journal record); an unknown name is a 404 naming it.  ``tp2``: two ranks, each serving its
    cut of the adapters; the kill takes the group down and both ranks load them again."""
    import openai

    from tests.test_serve_http import SERVE, _wait_up, stop_server, stream_across_engine_kill
    base, ads = models
    port = tmp_path / "port"
    proc = preloaded.Popen([sys.executable, "-m", "gpu_anchor.serve", base, "--port", "0", "--port-file", str(port),
                            "--socket", host_daemon[0], *SERVE, "--tensor-parallel-size", str(tp),
                            "--served-model-name", "tiny", "--enable-lora",
                            "--lora-modules", f"all={ads['all']}", json.dumps({"name": "qv", "path": ads["qv"]})],
                           stdout=subprocess.DEVNULL, stderr=open(tmp_path / "serve.log", "ab"), preload=preloaded.HF)
    try:
        import time
        deadline = time.time() + 120
        while not port.exists():
            assert proc.poll() is None and time.time() < deadline, (tmp_path / "serve.log").read_text()[-3000:]
            time.sleep(0.1)
        url = f"http://127.0.0.1:{port.read_text()}"
        _wait_up(url)
        c = openai.OpenAI(base_url=url + "/v1", api_key="-")
        cards = {m.id: m for m in c.models.list().data}
        assert set(cards) == {"tiny", "all", "qv"}
        assert cards["all"].parent == "tiny" and cards["all"].root == ads["all"]
        want = {n: _peft_greedy(base, ads.get(n), [PROMPTS[0]], 24)[0] for n in ("all", "qv", None)}
        for n in ("all", "qv", None):
            r = c.completions.create(model=n or "tiny", prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
                                     logprobs=0)
            assert [int(t.split(":")[1]) for t in r.choices[0].logprobs.tokens] == want[n], n
        items = stream_across_engine_kill(url, lambda: c.completions.create(
            model="all", prompt=PROMPTS[0], max_tokens=24, temperature=0, stream=True, logprobs=0,
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True}))
        ids = [int(t.split(":")[1]) for x in items for t in (x.choices[0].logprobs.tokens if x.choices else [])]
        assert ids == want["all"]
        with pytest.raises(openai.NotFoundError, match="The model `nope` does not exist"):
            c.completions.create(model="nope", prompt="hi", max_tokens=2)
    finally:
        stop_server(proc)


def serve_refuses(capsys, *argv) -> tuple[int, str]:
    """``gpu-anchor serve ARGV`` run by the function the command runs, in this process (an
    interpreter start saved per refusal): its exit status and what it wrote to stderr."""
    from gpu_anchor.launch.serve import cli
    code = cli(list(argv))
    return code, capsys.readouterr().err


def test_adapter_options_are_checked_before_anything_starts(models, capsys):
    base, ads = models
    r = preloaded.run([sys.executable, "-m", "gpu_anchor.serve", base, "--device", "cpu", "--lora-modules",
                       f"a={ads['all']}"], timeout=120, preload=preloaded.HF)
    assert r.returncode == 2 and "--lora-modules needs --enable-lora" in r.stderr
    run = lambda *extra: serve_refuses(capsys, base, "--device", "cpu", *extra)
    code, err = run("--enable-lora", "--lora-modules", f"a={ads['all']}", "--max-lora-rank", "2")
    assert code == 2 and "rank 4 at model.layers.0.mlp.down_proj is above --max-lora-rank 2" in err
    code, err = run("--enable-lora", "--lora-modules", f"{os.path.basename(base)}={ads['all']}")
    assert code == 2 and "is the base model's served name" in err
    code, err = run("--enable-lora", "--max-loras", "1", "--lora-modules", f"a={ads['all']}", f"b={ads['qv']}",
                    "--tensor-parallel-size", "2")
    assert code == 2 and "--lora-modules gives 2 adapters and --max-loras is 1: with --tensor-parallel-size" \
        in err, err[-2000:]
    code, err = run("--enable-lora", "--max-loras", "1", "--lora-modules", f"a={ads['all']}", f"b={ads['qv']}",
                    "--deterministic")
    assert code == 2 and "--max-loras is 1: with --deterministic every adapter keeps a slot" in err, err[-2000:]
    code, err = run("--enable-lora")
    assert code == 2 and "--enable-lora serves the adapters of --lora-modules, and none is given" in err


@pytest.mark.gpu
def test_on_cuda_adapters_go_through_the_fused_kernels_and_the_graphs_as_peft(models, cuda_daemon):
    """On CUDA in float32 (the fused decoder kernels, packed projections, CUDA graphs replayed,
    asynchronous scheduling; anchored): the mixed batch's greedy tokens equal transformers +
    peft's own on the same GPU; then base requests alone replay the graphs captured without the
    adapters' terms, and their tokens are the base model's too."""
    import torch

    from gpu_anchor.serve.engine import Engine, EngineConfig
    from gpu_anchor.serve.sequence import SamplingParams
    base, ads = models
    torch.backends.cuda.matmul.allow_tf32 = False
    eng = Engine(EngineConfig(model=base, device="cuda:0", dtype="float32", block_size=16, num_blocks=256,
                              namespace="lora-gpu", socket=cuda_daemon[0], lora=tuple(ads.items())))
    names = ["all", "qv", None]
    jobs = [(p, n) for p in PROMPTS for n in names]
    got = eng.generate([p for p, _ in jobs], [SamplingParams(max_tokens=12, ignore_eos=True, lora=n) for _, n in jobs])
    assert eng.step_counts["graph"] > 0 and eng.model.fused
    base_want = {}
    for n in names:
        mine = [(p, g) for (p, m), g in zip(jobs, got) if m == n]
        want = _peft_greedy(base, ads.get(n), [p for p, _ in mine], 12, "cuda:0", "float32")
        for (p, g), w in zip(mine, want):
            assert g == w, (n, p)
            if n is None:
                base_want[tuple(p)] = g
    assert {k for k in eng.graphs._graphs if k[1]} and not {k for k in eng.graphs._graphs if not k[1]}
    alone = eng.generate(PROMPTS, [SamplingParams(max_tokens=12, ignore_eos=True) for _ in PROMPTS])
    assert {k for k in eng.graphs._graphs if not k[1]}
    assert alone == [base_want[tuple(p)] for p in PROMPTS]


def _restore_with(cfg, q):
    from gpu_anchor.serve.engine import Engine
    eng = Engine(cfg)
    q.put(({s.rid: s.params.lora for s in eng.restored}, eng.recovery_notes))


def test_a_restored_request_keeps_its_adapter_or_is_dropped_by_name_where_it_is_not_served(models, host_daemon):
    """The adapter's name is in the request's journal record: the next engine resumes the request
    with it.  An engine that does not serve that adapter (a journal of a server started with other
    adapters) drops the request and says why, rather than go on through the base weights."""
    from forkserver_context import forkserver_context

    from gpu_anchor.serve.engine import Engine, EngineConfig
    from gpu_anchor.serve.sequence import SamplingParams
    base, ads = models
    cfg = EngineConfig(model=base, socket=host_daemon[0], namespace="lora-restore", dtype="float64", block_size=4,
                       num_blocks=64, lora=(("all", ads["all"]),))
    e1 = Engine(cfg)
    for rid, name in (("on-adapter", "all"), ("on-base", None)):
        e1.add_request(rid, PROMPTS[0], SamplingParams(max_tokens=20, ignore_eos=True, lora=name))
    for _ in range(4):
        e1.step()
    e1.flush()
    ctx = forkserver_context(["gpu_anchor.serve.preload"])
    for c, want in ((cfg, {"on-adapter": "all", "on-base": None}), (EngineConfig(**dict(cfg.__dict__, lora=())),
                                                                     {"on-base": None})):
        q = ctx.Queue()
        p = ctx.Process(target=_restore_with, args=(c, q))
        p.start()
        restored, notes = q.get(timeout=120)
        p.join()
        assert restored == want
        assert bool(c.lora) != any("request on-adapter: LoRA adapter 'all' is not served by this engine" in n
                                   for n in notes), notes


def test_the_kv_cache_sizing_counts_the_adapters_stacked_tensors(models):
    """``--gpu-memory-utilization`` leaves the KV cache what the weights, the activations and the
    adapters' stacked tensors (S·R·(in + out) a targeted projection) do not take."""
    import argparse

    from safetensors.torch import load_file

    from gpu_anchor.serve import options
    from gpu_anchor.serve.model_runner import load_config
    base, ads = models
    weights = load_file(os.path.join(base, "model.safetensors"))
    args = argparse.Namespace(enable_lora=True, lora_modules=[f"{n}={p}" for n, p in ads.items()],
                              tensor_parallel_size=1, max_lora_rank=16, max_loras=None)
    mc = load_config(base)
    modules, capacity, runtime, numel = L.from_options(args, mc, "tiny")
    stacked = lora_slots.load(modules, weights, weights["model.norm.weight"].dtype, "cpu", None, 16, capacity, runtime)
    assert numel * 4 == stacked.bytes and not runtime
    mc = load_config(base)
    args = argparse.Namespace(tensor_parallel_size=1, block_size=4, num_blocks=None, kv_cache_gib=None,
                              gpu_memory_utilization=0.01, max_num_batched_tokens=64, max_num_seqs=4,
                              max_model_len=64, prewarm=False)
    per_block = 2 * mc.num_hidden_layers * 4 * mc.num_key_value_heads * mc.head_dim * 4
    plain = options.kv_cache_blocks(args, mc, "cpu", "float32")
    lora = options.kv_cache_blocks(args, mc, "cpu", "float32", numel * 100)
    assert abs((plain - lora) - numel * 100 * 4 / per_block) <= 1
