"""Kill-and-restart with real processes: a Hugging Face Llama, and the program-change table.

Workers are forked from this interpreter (torch and transformers already imported) and
SIGKILLed; every restart is compared, bit for bit, with a run without gpu-anchor.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import scope_program_changes as pc  # noqa: E402

transformers = pytest.importorskip("transformers")
# resolve transformers' lazy imports here, once: the workers forked below build a Llama, and a
# scope's hooks reach transformers.PreTrainedModel (modeling_utils, ~0.9 s in every worker else)
transformers.LlamaForCausalLM  # noqa: B018

IDS = torch.tensor([[1, 5, 9, 3, 7, 2]])


def _config():
    return transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def _llama_worker(namespace, q, hold):
    torch.set_num_threads(1)   # the parent's thread pool does not survive fork
    torch.manual_seed(0)
    if namespace is None:
        model = transformers.LlamaForCausalLM(_config())
        report = None
    else:
        from gpu_anchor.scope import managed_scope
        with managed_scope(namespace) as scope:
            model = transformers.LlamaForCausalLM(_config())
        report = scope.report
        del scope
    after = torch.rand(4)                       # later code (dropout, sampling) sees this generator
    with torch.no_grad():
        logits = model(IDS).logits
    # numpy arrays travel by value (torch tensors would need the sender alive to fetch them)
    q.put({"logits": logits.numpy(), "after": after.numpy(), "n": sum(1 for _ in model.parameters()),
           "report": None if report is None else {k: getattr(report, k) for k in
                                                  ("matched", "created", "conflicts", "native", "rng", "replayed_ops")}})
    if hold:
        signal.pause()


def _spawn(*args):
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_llama_worker, args=(*args[:1], q, *args[1:]))
    p.start()
    out = q.get(timeout=240)
    out["logits"], out["after"] = torch.from_numpy(out["logits"]), torch.from_numpy(out["after"])
    return p, out


def test_hf_llama_bit_identical_and_restart_matches(host_daemon):
    p0, native = _spawn(None, False)
    p0.join(60)
    p1, first = _spawn("llama", True)
    os.kill(p1.pid, signal.SIGKILL)
    p1.join(60)
    p2, second = _spawn("llama", True)
    os.kill(p2.pid, signal.SIGKILL)
    p2.join(60)
    r1, r2 = first["report"], second["report"]
    assert r1["created"] and not r1["matched"] and not r1["native"]
    assert torch.equal(first["logits"], native["logits"]), "built in the scope != built without gpu-anchor"
    assert torch.equal(first["after"], native["after"]), "RNG after the scope differs (create)"
    assert sorted(r2["matched"]) == sorted(r1["created"]) and not r2["created"]    # 100 % matched
    assert r2["replayed_ops"] == 0 and r2["rng"] == "journal"
    assert torch.equal(second["logits"], native["logits"])
    assert torch.equal(second["after"], native["after"]), "RNG after the scope differs (match)"


EXPECTED = {
    "access_path":      dict(a="correct", b="correct", c="correct", d="correct", e="correct", f="correct",
                             g="refused", h="WRONG"),
    "allocation_order": dict(a="correct", b="refused", c="refused", d="correct", e="refused", f="refused",
                             g="refused", h="WRONG"),
}


@pytest.mark.parametrize("naming", ["access_path", "allocation_order"])
def test_program_change_table(host_daemon, naming, capsys):
    results = [pc.run_case(case, naming, f"pc-{case}-{naming}") for case in pc.CASES]
    with capsys.disabled():
        print(f"\n{naming}: " + ", ".join(f"({r['case']}) {r['outcome']}" for r in results))
    got = {r["case"]: r["outcome"] for r in results}
    assert got == EXPECTED[naming], results
    if naming == "access_path":
        # the table means something only if restarts really reused anchored state
        resumed = {r["case"] for r in results if r.get("resumed")}
        assert {"b", "e", "h"} <= resumed, results


def _die_before_fill(q):
    torch.set_num_threads(1)
    from gpu_anchor.scope import scope as scope_mod
    scope_mod.ManagedScope._settle = lambda self, *a: os.kill(os.getpid(), signal.SIGKILL)
    torch.manual_seed(0)
    with scope_mod.ManagedScope("unfilled"):
        model = torch.nn.Linear(16, 16)   # noqa: F841 — bound (created), then the worker dies unfilled


def test_worker_killed_between_bind_and_fill_is_refilled(host_daemon):
    ctx = mp.get_context("fork")
    p = ctx.Process(target=_die_before_fill, args=(None,))
    p.start()
    p.join(60)
    assert p.exitcode == -signal.SIGKILL
    import gpu_anchor
    assert sorted(gpu_anchor.connect("cpu", namespace="unfilled").names()) == ["model.bias", "model.weight"]
    torch.manual_seed(0)
    ref = torch.nn.Linear(16, 16)
    from gpu_anchor.scope import managed_scope
    torch.manual_seed(0)
    with managed_scope("unfilled") as scope:
        model = torch.nn.Linear(16, 16)
    assert sorted(scope.report.created) == ["model.bias", "model.weight"]   # matched, but known unfilled
    assert torch.equal(model.weight, ref.weight) and torch.equal(model.bias, ref.bias)
    assert gpu_anchor.connect("cpu", namespace="unfilled").journal.get("scope/unfilled") is None


def test_unfilled_marker_is_per_object(host_daemon):
    """A second scope that fills its own objects must not clear the marker of the first's."""
    import gpu_anchor
    from gpu_anchor.scope import managed_scope
    c = gpu_anchor.connect("cpu", namespace="marker")
    held = c.tensor("a", (4,), torch.float32)                  # left unfilled by a dead worker
    c.journal.put("scope/unfilled", b'["a"]')
    with managed_scope("marker"):
        b = torch.ones(2)                                      # noqa: F841 — another scope's object
    assert c.journal.get("scope/unfilled") == b'["a"]'
    del held
    torch.manual_seed(1)
    ref = torch.randn(4)
    torch.manual_seed(1)
    with managed_scope("marker") as s:
        a = torch.randn(4)
    assert s.report.created == ["a"] and torch.equal(a, ref)
    assert c.journal.get("scope/unfilled") is None
