"""The managed_scope "what works" matrix: the ways real programs build and load models.

Run as a script (``python tests/scope_matrix.py --device cpu|cuda:0 --out result.json``)
it starts the daemons it needs in a private directory, writes the checkpoints the cases
load (``save_pretrained`` one file and sharded, ``torch.save``, safetensors), then for
every case forks, from this interpreter (torch + transformers imported, CUDA untouched):

1. a *plain* worker: the case without gpu-anchor;
2. a *first* worker: the case inside ``managed_scope`` in a fresh namespace; its state
   must equal the plain one bit for bit (and the RNG after the block too); it then
   "trains" (adds 1 to every floating tensor of the state) and is SIGKILLed;
3. a *restart* worker: the case again, same namespace: everything must be *matched*,
   nothing created, no recorded op replayed, the trained bytes kept (never the file's),
   and the model must compute with them.

Checks are made here; ``tests/test_scope_matrix.py`` (CPU) and
``tests/test_scope_gpu.py`` (H200) assert on the result of each case.  Cases:
``CASES`` below; ``peft`` is staged (base trained first, LoRA added on the restart).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import uuid

import torch
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IDS = [[1, 5, 9, 3, 7, 2, 11, 4]]


# ---------------------------------------------------------------------------- models
def qwen_config(**kw):
    from transformers import Qwen3Config
    base = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=False)
    base.update(kw)
    return Qwen3Config(**base)


def qwen(**kw):
    from transformers import Qwen3ForCausalLM
    return Qwen3ForCausalLM(qwen_config(**kw))


def mlp(**factory):
    return nn.Sequential(nn.Linear(16, 32, **factory), nn.GELU(), nn.LayerNorm(32, **factory),
                         nn.Linear(32, 8, **factory))


def lm_dev(dev):
    """The device a model built on the host is moved to: the case's device."""
    return dev


# ---------------------------------------------------------------------------- cases
# Each case builds inside the block (the worker's ``model = build(dev, files)`` line) and
# names what it returns; ``kind`` says how to run it forward after binding.
def _pretrained(files, **kw):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(files["hf"], **kw)


def _reset(m):
    for sub in m.modules():
        if hasattr(sub, "reset_parameters"):
            sub.reset_parameters()
    return m


def _accelerate(dev, files):
    from accelerate import init_empty_weights, load_checkpoint_and_dispatch
    with init_empty_weights():
        m = qwen()
    return load_checkpoint_and_dispatch(m, files["hf"], device_map={"": dev})


def _gpu_host_build(dev, files):
    return qwen().cuda() if dev.startswith("cuda") else qwen().to(dev)


def _compiled(dev, files):
    with torch.device(dev):
        return qwen()


CASES = {
    # construction
    "torch_device": ("lm", lambda dev, f: _within(dev, qwen)),
    "factory_kwargs": ("mlp", lambda dev, f: mlp(device=dev, dtype=torch.float64)),
    "to_device": ("lm", lambda dev, f: qwen().to(dev)),
    "cuda": ("lm", _gpu_host_build),
    "to_dtype": ("lm", lambda dev, f: _within(dev, qwen).to(torch.float64)),
    "native_then_to_dtype": ("lm", lambda dev, f: _native(lambda: _within(dev, qwen)).to(torch.float64)),
    "half": ("lm", lambda dev, f: _within(dev, qwen).half()),
    "bfloat16": ("lm", lambda dev, f: _within(dev, qwen).bfloat16()),
    "meta_to_empty": ("mlp", lambda dev, f: _reset(_within("meta", mlp).to_empty(device=dev))),
    "accelerate": ("lm", _accelerate),
    # loading
    "torch_load": ("lm", lambda dev, f: _load(_within(dev, qwen), torch.load(f["pt"], map_location=dev,
                                                                              weights_only=True))),
    "torch_load_mmap": ("lm", lambda dev, f: _load(_within(dev, qwen), torch.load(f["pt"], map_location=dev,
                                                                                   weights_only=True, mmap=True))),
    "load_assign": ("mlp", lambda dev, f: _load(_within("meta", mlp), torch.load(f["mlp_pt"], map_location=dev,
                                                                                  weights_only=True), assign=True)),
    "safetensors_load_file": ("lm", lambda dev, f: _load(_within(dev, qwen), _st_file(f["st"], dev))),
    "safetensors_load_model": ("lm", lambda dev, f: _st_model(_within(dev, qwen), f["st"], dev)),
    "from_pretrained": ("lm", lambda dev, f: _pretrained(f).to(dev)),
    "from_pretrained_device_map": ("lm", lambda dev, f: _pretrained(f, device_map=dev)),
    "from_pretrained_auto": ("lm", lambda dev, f: _pretrained(f, device_map="auto")),
    "from_pretrained_dtype": ("lm", lambda dev, f: _pretrained(f, device_map=dev, dtype=torch.float64)),
    "from_pretrained_sharded": ("lm", lambda dev, f: _pretrained({"hf": f["hf_sharded"]}, device_map=dev)),
    # modules
    "gru": ("rnn", lambda dev, f: nn.GRU(8, 16, 2, device=dev)),
    "lstm": ("rnn", lambda dev, f: nn.LSTM(8, 16, 2, device=dev)),
    "rnn": ("rnn", lambda dev, f: nn.RNN(8, 16, 2, device=dev)),
    "multihead_attention": ("mha", lambda dev, f: nn.MultiheadAttention(16, 4, device=dev)),
    "tied_embeddings": ("lm", lambda dev, f: _within(dev, lambda: qwen(tie_word_embeddings=True))),
    "resize_token_embeddings": ("lm", lambda dev, f: _resized(_within(dev, qwen))),
    "gradient_checkpointing": ("lm_train", lambda dev, f: _ckpt(_within(dev, qwen))),
    "torch_compile_after": ("lm_compiled", _compiled),
    # third-party rewrapping (staged: see ``peft`` in run_case)
    "peft": ("peft", None),
}
GPU_ONLY = {"cuda"}
IDIOM = {  # what the user wrote inside ``with managed_scope():`` (docs/scope.md's table)
    "torch_device": "`with torch.device(dev): model = Qwen3ForCausalLM(cfg)`",
    "factory_kwargs": "`nn.Linear(..., device=dev, dtype=torch.float64)`",
    "to_device": "`Qwen3ForCausalLM(cfg).to(dev)`",
    "cuda": "`Qwen3ForCausalLM(cfg).cuda()` (no host daemon)",
    "to_dtype": "`.to(torch.float64)`",
    "native_then_to_dtype": "native parameters, then `.to(torch.float64)` (`param.data = ...`)",
    "half": "`.half()`",
    "bfloat16": "`.bfloat16()`",
    "meta_to_empty": "meta build, `to_empty(device=dev)`, `reset_parameters()`",
    "accelerate": "`init_empty_weights()` + `load_checkpoint_and_dispatch`",
    "torch_load": "`load_state_dict(torch.load(p, map_location=dev, weights_only=True))`",
    "torch_load_mmap": "the same with `mmap=True`",
    "load_assign": "meta build + `load_state_dict(torch.load(...), assign=True)`",
    "safetensors_load_file": "`load_state_dict(safetensors.torch.load_file(p, device=dev))`",
    "safetensors_load_model": "`safetensors.torch.load_model(model, p, device=dev)`",
    "from_pretrained": "`AutoModelForCausalLM.from_pretrained(d).to(dev)`",
    "from_pretrained_device_map": "`from_pretrained(d, device_map=dev)`",
    "from_pretrained_auto": "`from_pretrained(d, device_map=\"auto\")`",
    "from_pretrained_dtype": "`from_pretrained(d, device_map=dev, dtype=torch.float64)`",
    "from_pretrained_sharded": "`from_pretrained(sharded d, device_map=dev)`",
    "gru": "`nn.GRU(8, 16, 2, device=dev)`",
    "lstm": "`nn.LSTM(...)`",
    "rnn": "`nn.RNN(...)`",
    "multihead_attention": "`nn.MultiheadAttention(16, 4, device=dev)`",
    "tied_embeddings": "tied embeddings (`tie_word_embeddings=True`)",
    "resize_token_embeddings": "`resize_token_embeddings(160, mean_resizing=False)`",
    "gradient_checkpointing": "`gradient_checkpointing_enable()` (then forward + backward)",
    "torch_compile_after": "`torch.compile(model)` after the block",
    "peft": "`get_peft_model(model, LoraConfig(...))` on a base an earlier run trained",
}


def _within(dev, fn):
    with torch.device(dev):
        return fn()


def _native(fn):
    """Build with interception off, as a device without a daemon would (``param.data =
    placeholder`` then runs on native parameters, as ``Model(cfg).cuda()`` does)."""
    from gpu_anchor.scope import current, suspended
    if current() is None:
        return fn()
    with suspended():
        return fn()


def _load(model, sd, assign=False):
    model.load_state_dict(sd, assign=assign)
    return model


def _st_file(path, dev):
    import safetensors.torch as st
    return st.load_file(path, device=dev)


def _st_model(model, path, dev):
    import safetensors.torch as st
    st.load_model(model, path, device=dev)
    return model


def _resized(model):
    model.resize_token_embeddings(160, mean_resizing=False)   # True reads the old rows: see docs/scope.md
    return model


def _ckpt(model):
    model.gradient_checkpointing_enable()
    return model


def _peft(model):
    from peft import LoraConfig, get_peft_model
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))


# ---------------------------------------------------------------------------- worker side
def _state(model) -> dict:
    from gpu_anchor.scope import access_paths
    out = {}
    for name, t in access_paths({"model": model}).items():
        if t.device.type == "meta":
            continue
        out[name] = (str(t.dtype), tuple(t.shape),
                     t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return out


def _forward(kind, model, dev):
    torch.manual_seed(123)
    if kind in ("lm", "lm_compiled", "peft", "lm_train"):
        ids = torch.tensor(IDS, device=dev)
        m = torch.compile(model, backend="aot_eager") if kind == "lm_compiled" else model
        if kind == "lm_train":
            model.train()
            out = m(ids, labels=ids)
            out.loss.backward()
            g = [p.grad for p in model.parameters() if p.grad is not None]
            res = torch.cat([x.reshape(-1).float() for x in g])
            model.zero_grad(set_to_none=True)
            model.eval()
            return res.cpu().numpy().tobytes()
        with torch.no_grad():
            return m(ids).logits.float().cpu().numpy().tobytes()
    dtype = next(model.parameters()).dtype
    with torch.no_grad():
        if kind == "rnn":
            out = model(torch.randn(5, 3, 8, device=dev, dtype=dtype))[0]
        elif kind == "mha":
            x = torch.randn(5, 3, 16, device=dev, dtype=dtype)
            out = model(x, x, x)[0]
        else:
            out = model(torch.randn(4, 16, device=dev, dtype=dtype))
    return out.float().cpu().numpy().tobytes()


def _worker(case, dev, files, ns, stage, train, q):
    import warnings
    try:
        torch.set_num_threads(1)            # the parent's thread pool does not survive fork
        kind, build = CASES[case]
        torch.manual_seed(0)
        if dev.startswith("cuda"):
            torch.cuda.manual_seed_all(0)
        report = None
        from gpu_anchor.testing.weight_files import count_opens
        opens = count_opens()
        import transformers  # noqa: F401  (model classes resolved before the timed block, as a warm restart has them)
        transformers.Qwen3ForCausalLM
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if ns is None:
                model = _build(case, build, dev, files, stage)
            else:
                import gpu_anchor
                t0 = time.perf_counter()
                with gpu_anchor.managed_scope(ns) as scope:
                    model = _build(case, build, dev, files, stage)
                block_s = time.perf_counter() - t0
                rep = scope.report
                report = {k: getattr(rep, k) for k in ("matched", "created", "conflicts", "adopted", "not_anchored",
                                                       "rng", "replayed_ops", "resident_loads")}
                report["block_s"] = block_s
                report["weight_file_opens"] = opens[0]
                del scope
        after = torch.rand(4).numpy().tobytes()
        if dev.startswith("cuda"):
            after += torch.rand(4, device=dev).cpu().numpy().tobytes()
        out = {"state": _state(model), "forward": _forward(kind, model, dev), "after": after, "report": report,
               "warnings": [str(w.message) for w in caught if "gpu-anchor" in str(w.message)
                            or "managed_scope" in str(w.message)]}
        if train:
            with torch.no_grad():
                for t in _float_state(model):
                    t.add_(1)
            if dev.startswith("cuda"):
                torch.cuda.synchronize()
            out["trained_state"] = _state(model)
            out["trained_forward"] = _forward(kind, model, dev)
        q.put(out)
    except BaseException:
        q.put({"error": traceback.format_exc()})
    if os.environ.get("MATRIX_NO_PAUSE"): return
    signal.pause()


def _build(case, build, dev, files, stage):
    if case == "peft":
        model = _within(dev, qwen)
        return _peft(model) if stage != "base" else model
    return build(dev, files)


def _float_state(model):
    from gpu_anchor.scope import access_paths
    return [t for t in access_paths({"model": model}).values()
            if t.is_floating_point() and t.device.type != "meta"]


def _run(case, dev, files, ns, stage="full", train=False) -> dict:
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_worker, args=(case, dev, files, ns, stage, train, q))
    p.start()
    try:
        out = q.get(timeout=300)
    except Exception:
        out = {"error": "worker gave no answer within 300 s"}
    os.kill(p.pid, signal.SIGKILL)
    p.join(30)
    return out


# ---------------------------------------------------------------------------- checks
def _diff(a: dict, b: dict) -> list[str]:
    bad = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    return bad[:8]


def _reachable(not_anchored: dict) -> dict:
    """Unanchored tensors the block's variables reach (temporaries that a library keeps alive
    out of the block's reach, e.g. the embedding ``resize_token_embeddings`` replaced, are
    reported but are not the block's state)."""
    return {k: v for k, v in list(not_anchored.items()) if not v.startswith("made in the block but not reachable")}


def run_case(case: str, dev: str, files: dict) -> dict:
    ns = f"matrix-{case}-{uuid.uuid4().hex[:8]}"
    res: dict = {"case": case, "device": dev, "problems": []}
    p = res["problems"]
    if case == "peft":
        plain = _run(case, dev, files, None, stage="peft")
        first = _run(case, dev, files, ns, stage="base", train=True)      # the base, trained, killed
        second = _run(case, dev, files, ns, stage="peft", train=True)     # LoRA added: base matched
        third = _run(case, dev, files, ns, stage="peft")                  # restart with LoRA
        runs = {"plain": plain, "base": first, "lora": second, "restart": third}
        if any("error" in r for r in runs.values()):
            return {**res, "problems": [f"{k}: {r['error']}" for k, r in runs.items() if "error" in r]}
        r1, r2, r3 = first["report"], second["report"], third["report"]
        base_names = set(r1["created"])
        if set(r2["matched"]) != base_names:
            p.append(f"LoRA run did not match the trained base: matched {len(r2['matched'])} of {len(base_names)}")
        adapters = [n for n in r2["created"] if "lora_" in n]
        if not adapters or set(r2["created"]) != set(adapters):
            p.append(f"LoRA run created {r2['created'][:4]}")
        trained = first["trained_state"]
        for name, v in second["state"].items():
            if "lora_" in name:
                if v != plain["state"].get(name):
                    p.append(f"adapter {name} differs from a plain peft run")
            elif trained.get(name) != v:
                p.append(f"base weight {name} lost its trained bytes")
        if r3["created"] or set(r3["matched"]) != set(r2["matched"]) | set(r2["created"]):
            p.append(f"LoRA restart: {len(r3['matched'])} matched, {len(r3['created'])} created")
        if third["state"] != second["trained_state"] or third["forward"] != second["trained_forward"]:
            p.append("LoRA restart lost the trained bytes")
        if r3["replayed_ops"]:
            p.append(f"LoRA restart replayed {r3['replayed_ops']} ops")
        res.update(reports={k: r.get("report") for k, r in runs.items()})
        return res
    plain = _run(case, dev, files, None)
    first = _run(case, dev, files, ns, train=True)
    restart = _run(case, dev, files, ns)
    runs = {"plain": plain, "first": first, "restart": restart}
    if any("error" in r for r in runs.values()):
        return {**res, "problems": [f"{k}: {r['error']}" for k, r in runs.items() if "error" in r]}
    r1, r2 = first["report"], restart["report"]
    res["reports"] = {"first": r1, "restart": r2}
    res["block_s"] = {"first": r1["block_s"], "restart": r2["block_s"]}
    if first["state"] != plain["state"]:
        p.append(f"first run's state differs from the plain run: {_diff(first['state'], plain['state'])}")
    if first["forward"] != plain["forward"]:
        p.append("first run's forward differs from the plain run")
    if first["after"] != plain["after"]:
        p.append("RNG after the block differs from the plain run (first run)")
    if _reachable(r1["not_anchored"]):
        p.append(f"first run left tensors unanchored: {_reachable(r1['not_anchored'])}")
    if not r1["created"]:
        p.append("first run created nothing")
    if set(r2["matched"]) != set(r1["created"]) | set(r1["matched"]) or r2["created"]:
        p.append(f"restart: {len(r2['matched'])} matched, {len(r2['created'])} created ({r2['created'][:3]}); "
                 f"first created {len(r1['created'])}")
    if r2["replayed_ops"]:
        p.append(f"restart replayed {r2['replayed_ops']} recorded ops")
    # ``from_pretrained(dir).to(dev)``: the call itself returns a host model, so on a GPU its restart
    # loads the files into host memory as asked (the move to the GPU then matches, replaying nothing).
    no_read = case.startswith("from_pretrained") and not (case == "from_pretrained" and dev != "cpu")
    if no_read and (r2["resident_loads"] != 1 or r2["weight_file_opens"]):
        p.append(f"from_pretrained restart: {r2['resident_loads']} loads served from anchored memory, "
                 f"{r2['weight_file_opens']} weight files opened")
    if restart["state"] != first["trained_state"]:
        p.append(f"restart lost the trained bytes: {_diff(restart['state'], first['trained_state'])}")
    if restart["forward"] != first["trained_forward"]:
        p.append("restart's forward differs from the trained model's")
    if restart["after"] != plain["after"]:
        p.append("RNG after the block differs from the plain run (restart)")
    if _reachable(r2["not_anchored"]):
        p.append(f"restart left tensors unanchored: {_reachable(r2['not_anchored'])}")
    return res


# ---------------------------------------------------------------------------- files, daemons
def _prepare(d: str, q) -> None:
    try:
        torch.set_num_threads(1)
        torch.manual_seed(42)
        m = qwen()
        m.save_pretrained(os.path.join(d, "hf"))
        m.save_pretrained(os.path.join(d, "hf_sharded"), max_shard_size="20KB")
        torch.save(m.state_dict(), os.path.join(d, "qwen.pt"))
        import safetensors.torch as st
        st.save_model(m, os.path.join(d, "qwen.safetensors"))
        torch.save(mlp().state_dict(), os.path.join(d, "mlp.pt"))
        q.put("ok")
    except BaseException:
        q.put(traceback.format_exc())


def prepare_files(d: str) -> dict:
    ctx = mp.get_context("fork")                   # keep this interpreter free of thread pools
    q = ctx.Queue()
    p = ctx.Process(target=_prepare, args=(d, q))
    p.start()
    msg = q.get(timeout=300)
    p.join(60)
    if msg != "ok":
        raise RuntimeError(msg)
    return {"hf": os.path.join(d, "hf"), "hf_sharded": os.path.join(d, "hf_sharded"),
            "pt": os.path.join(d, "qwen.pt"), "st": os.path.join(d, "qwen.safetensors"),
            "mlp_pt": os.path.join(d, "mlp.pt")}


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "gpu_anchor.cli", *args], check=True, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")})


def preload() -> None:
    """Import what the cases use once, here, so that forked workers do not each pay it (~3 s)."""
    import accelerate  # noqa: F401
    import peft  # noqa: F401
    import safetensors.torch  # noqa: F401
    import torch._dynamo  # noqa: F401
    import transformers
    import transformers.modeling_utils  # noqa: F401
    transformers.Qwen3ForCausalLM, transformers.AutoModelForCausalLM, transformers.GenerationConfig
    import gpu_anchor.scope  # noqa: F401
    import gpu_anchor.train  # noqa: F401


def markdown(paths: list[str]) -> str:
    """The "what works" table of docs/scope.md from result files (one column pair per device)."""
    runs = []
    for path in paths:
        with open(path) as f:
            rows = json.load(f)
        runs.append((rows[0]["device"] if rows else "?", {r["case"]: r for r in rows}))
    head = "| what the block does | " + " | ".join(f"{d}: result | {d}: restart block" for d, _ in runs) + " |"
    out = [head, "|" + " --- |" * (1 + 2 * len(runs))]
    for case, idiom in IDIOM.items():
        cells = []
        for _, by in runs:
            r = by.get(case)
            if r is None:
                cells += ["—", "—"]
                continue
            ok = "✓" if not r["problems"] else "✗ " + r["problems"][0].splitlines()[-1][:80]
            rs = (r.get("reports") or {}).get("restart") or {}
            if case == "peft":
                rs = (r.get("reports") or {}).get("restart") or {}
            block = rs.get("block_s")
            extra = " (no weight file opened)" if rs.get("resident_loads") else ""
            cells += [ok + extra, f"{block * 1e3:.0f} ms" if block is not None else "—"]
        out.append(f"| {idiom} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--markdown":
        print(markdown(sys.argv[2:]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--cases", default=None, help="comma-separated (default: all for the device)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    dev = args.device
    cases = args.cases.split(",") if args.cases else [c for c in CASES if dev != "cpu" or c not in GPU_ONLY]
    work = tempfile.mkdtemp(prefix="ga-matrix-")
    sock = os.path.join(work, "sock")
    os.makedirs(sock, mode=0o700)
    os.environ["GPU_ANCHOR_SOCKET_DIR"] = sock
    os.environ.pop("GPU_ANCHOR_SOCKET", None)
    results = []
    preload()
    try:
        _cli("daemon", "--device", dev, "--detach")   # CUDA runs have no host daemon: host tensors stay native
        files = prepare_files(work)
        for case in cases:
            t0 = time.perf_counter()
            try:
                r = run_case(case, dev, files)
            except BaseException:
                r = {"case": case, "device": dev, "problems": [traceback.format_exc()]}
            r["seconds"] = round(time.perf_counter() - t0, 2)
            results.append(r)
            print(f"{case:28s} {'ok' if not r['problems'] else 'FAILED'} ({r['seconds']} s)", flush=True)
    finally:
        try:
            _cli("stop")
        except Exception:
            pass
        shutil.rmtree(work, ignore_errors=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    from gpu_anchor import runtime
    runtime.exit_path(lambda: sys.exit(main()))    # skips the ~1 s teardown of torch and transformers
