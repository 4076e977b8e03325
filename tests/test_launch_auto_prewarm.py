"""The automatic pre-warm (``runtime.auto_prewarm``): a worker under ``gpu-anchor run`` records
what its first step trained (a transformers Llama + AdamW under ``AnchoredOptimizer``); the
standby replays one step of a 1-layer copy of it, or says why it did not."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from gpu_anchor.runtime.auto_prewarm import Recorder, decide, estimate_peak_bytes, run_auto_prewarm
from test_launch_supervisor import job

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A user's script: a tiny transformers Llama (2 layers, hidden 32) built locally, anchored, trained
# with AdamW under AnchoredOptimizer; it trains until the file "stop" appears.
TRAIN = '''
import os, time, torch, gpu_anchor
from transformers import LlamaConfig, LlamaForCausalLM
from gpu_anchor.train import AnchoredOptimizer, anchor_module
client = gpu_anchor.connect("cpu")
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2))
anchor_module(model, client)
opt = AnchoredOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False), model=model, client=client)
for step in range(opt.completed_steps, 100000):
    if os.path.exists("stop"):
        break
    ids = torch.randint(0, 64, (3, 12), generator=torch.Generator().manual_seed(step))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    time.sleep(0.02)
'''


def _tiny_llama(layers=2):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                        num_attention_heads=4, num_key_value_heads=2))


def _record(model, opt, forward) -> list:
    got = []
    rec = Recorder(got.append).install()
    try:
        for _ in range(2):
            forward(model).backward()
            if opt is not None:
                opt.step()
                opt.zero_grad()
            else:                         # a loop with its own update: the committed steps end recording
                rec.step_committed(0, ())
    finally:
        rec.remove()
    return got


def test_recipe_replayed_as_one_layer_step_leaves_rng_and_dtype_as_found():
    model = _tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    ids = torch.randint(0, 64, (3, 12))
    # another test's live optimizer may hold global module hooks (gradient lending): compare, not assume none
    hooks_before = dict(torch.nn.modules.module._global_forward_pre_hooks)
    got = _record(model, opt, lambda m: m(input_ids=ids, labels=ids).loss)
    assert len(got) == 1 and "recipe" in got[0], got           # once, after the first step
    m, o = got[0]["recipe"]["model"], got[0]["recipe"]["optimizer"]
    assert m["class"].endswith(":LlamaForCausalLM") and m["batch"] == [3, 12] and m["loss"] is True
    assert m["dtype"] == "float32" and m["device"] == "cpu" and m["config"]["num_hidden_layers"] == 2
    assert o["class"] == "torch.optim.adamw:AdamW" and o["options"]["foreach"] is False
    assert dict(torch.nn.modules.module._global_forward_pre_hooks) == hooks_before   # its own removed
    assert not model._forward_hooks

    rng, dtype = torch.random.get_rng_state(), torch.get_default_dtype()
    info = run_auto_prewarm(json.loads(json.dumps(got[0]["recipe"])), "cpu")
    assert info["auto_prewarm_s"] > 0 and info["auto_prewarm_peak_estimate"] > 0, info
    assert torch.equal(rng, torch.random.get_rng_state()) and torch.get_default_dtype() == dtype

    # bfloat16, gradient checkpointing, a loss computed outside the model
    r = json.loads(json.dumps(got[0]["recipe"]))
    r["model"].update(dtype="bfloat16", gradient_checkpointing=True, loss=False)
    assert "auto_prewarm_s" in run_auto_prewarm(r, "cpu")


def test_what_cannot_be_replayed_is_said_never_raised():
    lin = torch.nn.Linear(4, 4)
    got = _record(lin, torch.optim.SGD(lin.parameters(), lr=0.1), lambda m: m(torch.randn(2, 4)).sum())
    assert got == [{"skip": "no transformers model (PreTrainedModel) ran a forward before the first step"}]

    model = _tiny_llama()
    ids = torch.randint(0, 64, (2, 5))
    got = _record(model, None, lambda m: torch.nn.functional.cross_entropy(m(ids).logits.flatten(0, 1),
                                                                              ids.flatten()))
    r = got[0]["recipe"]
    assert r["optimizer"] is None and r["model"]["loss"] is False and r["model"]["batch"] == [2, 5]
    assert "auto_prewarm_s" in run_auto_prewarm(r, "cpu")      # forward and backward only

    bad = json.loads(json.dumps(r))
    bad["model"]["class"] = "mypkg.model:MyModel"
    assert "is not a transformers class" in run_auto_prewarm(bad, "cpu")["auto_prewarm_skipped"]
    bad = json.loads(json.dumps(r))
    bad["model"]["config"]["vocab_size"] = -1             # construction fails
    assert run_auto_prewarm(bad, "cpu").get("auto_prewarm_failed"), "a failure is reported, not raised"


def _recipe_1b(batch=(4, 1024)) -> dict:
    cfg = {"hidden_size": 2048, "intermediate_size": 8192, "vocab_size": 128256, "num_hidden_layers": 16}
    return {"model": {"config": cfg, "dtype": "bfloat16", "batch": list(batch), "autocast": None}}


def test_memory_decision_runs_only_with_twice_the_estimate_free():
    r = _recipe_1b()
    n = 2048 * 128256 + 60_000_000            # 1 layer + tied embeddings, roughly
    est = estimate_peak_bytes(r, n)
    assert est > 4 * 1024 * 128256 * 4        # the float32 logits alone
    ok, why = decide(int(2 * est), r, n)
    assert ok and "estimated peak" in why
    ok, why = decide(int(2 * est) - 1, r, n)
    assert not ok and "under 2 x the estimated peak" in why and "GiB free" in why
    assert decide(None, r, n) == (False, "free memory on the device unknown")
    assert estimate_peak_bytes(_recipe_1b((8, 2048)), n) > est    # grows with the batch


def test_status_shows_the_automatic_prewarm_and_why_it_was_skipped():
    from gpu_anchor.launch.jobstate import format_jobs
    model = {"class": "transformers.models.llama.modeling_llama:LlamaForCausalLM", "config": {"num_hidden_layers": 16},
             "batch": [4, 1024], "dtype": "bfloat16"}
    job = {"namespace": "j", "state": "running", "supervisor_alive": True, "nproc": 3, "devices": ["cuda:0"],
           "warm": True, "restarts": [], "command": ["python", "t.py"], "ranks": {},
           "standbys": {"0": {"pid": 7, "auto_prewarm_s": 0.5},
                        "1": {"pid": 8, "auto_prewarm_skipped": "1.00 GiB free on the device, under 2 x ..."},
                        "2": {"pid": 9, "auto_prewarm_failed": "RuntimeError: x"}},
           "warm_recipes": {"0": {"recipe": {"model": model}}, "1": {"skip": "no transformers model"}}}
    text = format_jobs([job])
    assert "standby for rank 0: pid 7, ready (automatically pre-warmed in 0.50 s)" in text
    assert "standby for rank 1: pid 8, ready (automatic pre-warm skipped: 1.00 GiB free" in text
    assert "standby for rank 2: pid 9, ready (automatic pre-warm failed: RuntimeError: x; a plain warm standby)" in text
    assert "automatic pre-warm for rank 0: LlamaForCausalLM, 1 of 16 layers, batch 4x1024, bfloat16" in text
    assert "automatic pre-warm for rank 1: off (no transformers model)" in text


def _wait(pred, proc, timeout=120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        if proc.poll() is not None:
            raise AssertionError(f"supervisor exited {proc.returncode}: {proc.stderr.read()[-4000:]}")
        time.sleep(0.05)
    raise AssertionError("timed out")


def _try_job(socket_dir, ns):
    try:
        return job(socket_dir, ns)
    except (OSError, ValueError):
        return None


def test_run_records_the_recipe_and_the_next_standby_replays_it(clean_daemons, tmp_path):
    """``gpu-anchor run --warm-pool`` (on by default for GPU jobs) of a transformers Llama under
    AnchoredOptimizer: the first step's recipe reaches the job record, the rank's standby is made
    again and pre-warms one step of a 1-layer copy, and it takes over after a SIGKILL."""
    (tmp_path / "train_llama.py").write_text(TRAIN)
    ns = "auto-prewarm"
    cmd = [sys.executable, "-m", "gpu_anchor.launch.cli", "run", "--device-type", "cpu", "--warm-pool",
           "--namespace", ns, "--preload", "torch,gpu_anchor.scope,gpu_anchor.train.optimizer,transformers",
           "--", sys.executable, "train_llama.py"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env={**os.environ, "PYTHONPATH": ROOT}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        def prewarmed():
            j = _try_job(clean_daemons, ns) or {}
            sb = (j.get("standbys") or {}).get("0") or {}
            return (j, sb) if "auto_prewarm_s" in sb or "auto_prewarm_failed" in sb or "auto_prewarm_skipped" in sb \
                else None
        j, sb = _wait(prewarmed, proc)
        assert "auto_prewarm_s" in sb, sb
        assert sb.get("anchored_warm") == "foreach_zero", sb     # on CUDA also the fused Adam's verification
        recipe = j["warm_recipes"]["0"]["recipe"]
        assert recipe["model"]["batch"] == [3, 12] and recipe["model"]["config"]["num_hidden_layers"] == 2
        assert recipe["optimizer"]["class"] == "torch.optim.adamw:AdamW"   # through AnchoredOptimizer
        os.kill(int(j["ranks"]["0"]["pid"]), signal.SIGKILL)
        restarted = _wait(lambda: (_try_job(clean_daemons, ns) or {}).get("restarts"), proc)
        assert _wait(lambda: _try_job(clean_daemons, ns)["restarts"][0].get("recovery_s"), proc)
        (tmp_path / "stop").write_text("")
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-4000:]
    assert restarted[0]["action"] == "restart"
    assert job(clean_daemons, ns)["restarts"][0]["how"] == "warm standby"
    assert "its standby is made again to pre-warm one step of a 1-layer copy" in err
    status = subprocess.run([sys.executable, "-m", "gpu_anchor.launch.cli", "jobs"], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": ROOT}).stdout
    assert "automatic pre-warm for rank 0: LlamaForCausalLM, 1 of 2 layers, batch 3x12, float32" in status


@pytest.mark.gpu
def test_auto_prewarm_on_gpu_frees_its_memory():
    """On a GPU: the replay runs in bf16 with fused AdamW and gives its blocks back."""
    model = _tiny_llama().to("cuda:0", torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    ids = torch.randint(0, 64, (4, 128), device="cuda:0")
    got = _record(model, opt, lambda m: m(input_ids=ids, labels=ids).loss)
    r = got[0]["recipe"]
    assert r["model"]["device"] == "cuda:0" and r["optimizer"]["options"]["fused"] is True
    before = torch.cuda.memory_reserved(0)
    info = run_auto_prewarm(r, "cuda:0")
    assert "auto_prewarm_s" in info, info
    assert torch.cuda.memory_reserved(0) <= before


def test_anchored_warm_on_the_cpu_zeroes_scratch_and_says_what_it_skipped():
    from gpu_anchor.train.standby_warm import warm_anchored_update
    r = {"model": {"dtype": "float32"}, "optimizer": {"class": "torch.optim.adamw:AdamW",
                                                      "options": {"lr": 1e-3, "weight_decay": 0.01}}}
    assert warm_anchored_update(r, "cpu")["anchored_warm"] == "foreach_zero"
    assert "no optimizer" in warm_anchored_update({"model": {"dtype": "float32"}}, "cpu")["anchored_warm_skipped"]
    bad = dict(r, optimizer={"class": "mypkg.opt:Lion", "options": {}})
    assert "not a torch optimizer" in warm_anchored_update(bad, "cpu")["anchored_warm_skipped"]
    assert "anchored_warm_failed" in warm_anchored_update(dict(r, model={"dtype": "float77"}), "cpu")


def test_status_names_what_the_standby_warmed_of_the_anchored_update():
    from gpu_anchor.launch.jobstate import prewarm_text
    assert prewarm_text({"auto_prewarm_s": 0.5, "anchored_warm": "foreach_zero, fused adam verified"}) == \
        " (automatically pre-warmed in 0.50 s; anchored update: foreach_zero, fused adam verified)"
    assert "anchored update not warmed: TypeError: x" in prewarm_text({"auto_prewarm_s": 0.5,
                                                                        "anchored_warm_failed": "TypeError: x"})


@pytest.mark.gpu
def test_a_standby_verifies_the_fused_adam_once_for_the_worker_it_becomes(monkeypatch):
    """The standby's warm-up verifies the fused AdamW variant for the job's dtype and options;
    the AnchoredOptimizer made afterwards in the same process uses that answer (no second
    verification) and still updates as torch does."""
    from gpu_anchor.train import fused_adam
    from gpu_anchor.train.standby_warm import warm_anchored_update
    monkeypatch.setattr(fused_adam, "_VERIFIED", {})
    r = {"model": {"dtype": "bfloat16"}, "optimizer": {"class": "torch.optim.adamw:AdamW",
                                                       "options": {"lr": 1e-4, "weight_decay": 0.01}}}
    info = warm_anchored_update(r, "cuda:0")
    assert info.get("anchored_warm") == "foreach_zero, fused adam verified", info
    calls = []
    real = fused_adam.verify
    monkeypatch.setattr(fused_adam, "verify", lambda *a, **k: calls.append(a) or real(*a, **k))
    key = fused_adam.structure(torch.optim.AdamW([torch.zeros(1)], lr=1e-4, weight_decay=0.01).param_groups[0],
                               torch.bfloat16)
    assert fused_adam.verified(key, {}, torch.device("cuda:0")) is not None and calls == []


_COMPILE_PROBE = r"""
import json, sys, torch
from torch._dynamo.utils import counters
from transformers import LlamaConfig, LlamaForCausalLM
from gpu_anchor.runtime.auto_prewarm import Recorder
out = {}
# module.compile last: a recorder traced into a graph leaves its (no-op) hooks installed
for mode in ("wrapper", "layers", "module"):
    for recording in (False, True):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        m = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2))
        opt = torch.optim.AdamW(m.parameters())
        got = []
        rec = Recorder(got.append).install() if recording else None
        if mode == "wrapper":
            m = torch.compile(m, backend="eager")
        elif mode == "layers":
            for layer in m.model.layers:
                layer.compile(backend="eager")
        else:
            m.compile(backend="eager")
        ids = torch.randint(0, 64, (2, 8))
        for _ in range(3):
            m(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        out[f"{mode}/{recording}"] = [counters["stats"]["unique_graphs"], got]
print(json.dumps(out))
"""


def test_recording_never_makes_torch_compile_recompile():
    """A global hook seen by a graph torch.compile traced is in that graph's guards: removing it
    after the first step would recompile the model (seconds to minutes for a real one).  Whatever
    the way the model is compiled, recording adds no graph; where it cannot see the model, it
    says why."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", _COMPILE_PROBE], capture_output=True, text=True, timeout=240,
                          env=dict(os.environ, PYTHONPATH=root))
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    for mode in ("wrapper", "layers", "module"):
        plain, recorded = res[f"{mode}/False"], res[f"{mode}/True"]
        assert recorded[0] == plain[0], (mode, res)
    assert "recipe" in res["wrapper/True"][1][0] and "recipe" in res["layers/True"][1][0]
    assert "torch.compile" in res["module/True"][1][0]["skip"]
