"""managed_scope against a real host daemon, in one process: naming, binding, conflicts,
views and aliases, lifetime, optimizer state, and the no-work fully-matching bind."""
from __future__ import annotations

import os
import sys

import pytest
import torch
from torch import nn

import gpu_anchor
import preloaded
from gpu_anchor.scope import init_optimizer_state, managed_scope, suspended
from gpu_anchor.scope.placeholders import Placeholder


def _client(ns):
    return gpu_anchor.connect("cpu", namespace=ns)


class Engine:
    def __init__(self, layers=2, tokens=4):
        self.model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
        self.model[1].weight = self.model[0].weight                      # tied
        self.kv = torch.zeros(layers, 2, tokens, 4)
        self.views = [self.kv[i] for i in range(layers)]                 # per-layer views of one tensor
        self.kv_cache = {f"layer_{i}": torch.zeros(2, tokens) for i in range(layers)}


def test_names_aliases_views_and_lifetime(host_daemon):
    torch.manual_seed(0)
    with managed_scope("t1") as scope:
        engine = Engine()
        tmp = torch.randn(100)          # freed inside the scope: no name, no memory
        del tmp
    names = set(_client("t1").names())
    assert names == {"engine.kv", "engine.kv_cache['layer_0']", "engine.kv_cache['layer_1']",
                     "engine.model[0].weight"}, names
    assert sorted(scope.report.created) == sorted(names) and not scope.report.matched
    w0, w1 = engine.model[0].weight, engine.model[1].weight
    assert w0 is w1 and isinstance(w0, nn.Parameter) and not isinstance(w0, Placeholder)
    assert type(engine.kv) is torch.Tensor
    engine.views[1][0, 2].fill_(7.0)                                     # views still alias the base
    assert engine.kv[1, 0, 2].eq(7).all() and engine.kv[0].eq(0).all()
    seen = _client("t1").lookup("engine.kv", (2, 2, 4, 4), torch.float32)
    assert seen[1, 0, 2].eq(7).all()                                     # and the base is the anchored memory
    del seen
    scope.objects.clear()
    del engine, w0, w1
    assert _client("t1").names() == []                                   # deleted by the program: freed


def test_full_match_does_no_work_and_restores_rng(host_daemon):
    def build():
        torch.manual_seed(5)
        m = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 3))
        return m
    def worker():
        with managed_scope("t2") as scope:
            model = build()
        return scope, model, torch.rand(4)
    ref = build()
    ref_after = torch.rand(4)
    s1, first, after1 = worker()
    with torch.no_grad():
        first[0].weight.add_(1.0)                                        # "training" changed the state
    s2, second, after2 = worker()                                        # the restart: everything matches
    assert s1.report.rng == "replayed" and len(s1.report.created) == 6
    assert len(s2.report.matched) == 6 and not s2.report.created
    assert s2.report.replayed_ops == 0 and s2.report.rng == "journal"
    assert torch.equal(after1, ref_after) and torch.equal(after2, ref_after)
    assert second[0].weight.data_ptr() == first[0].weight.data_ptr()    # same memory, kept data
    assert torch.equal(second[0].weight, ref[0].weight + 1)
    for a, b in zip(list(second.parameters())[1:], list(ref.parameters())[1:]):
        assert torch.equal(a, b)


def test_conflict_refuses_and_leaves_data(host_daemon):
    def worker(rows):
        with managed_scope("t3"):
            kv = torch.full((rows, 8), 3.0)
        return kv
    kv = worker(4)
    with pytest.raises(gpu_anchor.ConflictError) as e:
        worker(2)                                                        # a shrunk cache
    msg = str(e.value)
    assert "kv: anchored as float32[4, 8], this program wants float32[2, 8]" in msg
    assert torch.equal(kv, torch.full((4, 8), 3.0))
    assert torch.equal(_client("t3").lookup("kv", (4, 8), torch.float32), torch.full((4, 8), 3.0))


def test_conflict_named_by_path_and_replace(host_daemon):
    c = _client("t4")
    keep = c.tensor("cache['k']", (3,), torch.float32)                   # left by a previous worker
    with pytest.raises(gpu_anchor.ConflictError, match=r"cache\['k'\]"):
        with managed_scope("t4"):
            cache = {"k": torch.ones(5)}
    del keep
    keep = c.tensor("cache['k']", (3,), torch.float32)
    with managed_scope("t4", on_conflict="replace") as s:
        cache = {"k": torch.full((5,), 2.0)}
    assert s.report.conflicts == ["cache['k']"] and s.report.created == ["cache['k']"]
    assert torch.equal(cache["k"], torch.full((5,), 2.0))


def test_bad_arguments():
    with pytest.raises(ValueError, match="on_conflict"):
        managed_scope(on_conflict="ignore")
    with pytest.raises(ValueError, match="namespace"):
        managed_scope(namespace="")


def test_namespace_default_from_env(host_daemon, monkeypatch):
    monkeypatch.setenv("GPU_ANCHOR_NAMESPACE", "from-env")
    with managed_scope() as s:
        x = torch.zeros(2)
    assert s.namespace == "from-env" and _client("from-env").names() == ["x"]
    del x


def test_client_tensors_pass_through_and_suspended(host_daemon):
    c = _client("t6")
    with managed_scope("t6") as s:
        w = torch.randn(3)
        with suspended():
            direct = c.tensor("optimizer.direct", (3,), torch.float32)   # anchored by a Client
            plain = torch.zeros(2)                                       # not intercepted
        direct.zero_()
        view = direct[:2]
    assert not isinstance(direct, Placeholder) and not isinstance(plain, Placeholder)
    assert sorted(c.names()) == ["optimizer.direct", "w"]
    assert s.report.created == ["w"]
    assert view.data_ptr() == direct.data_ptr()


def test_optimizer_state_is_anchored_and_exact(host_daemon):
    def build():
        torch.manual_seed(3)
        model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return model, opt
    x = torch.randn(5, 4)

    def train(model, opt):
        for _ in range(3):
            opt.zero_grad()
            model(x).square().sum().backward()
            opt.step()
    ref_model, ref_opt = build()
    train(ref_model, ref_opt)
    with managed_scope("t7") as s:
        model, opt = build()
        init_optimizer_state(opt)
    assert "opt.state[model[0].weight]['exp_avg']" in s.report.created
    assert "opt.state[model[1].bias]['step']" in s.report.created
    train(model, opt)
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(a, b)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][k], ref_opt.state[q][k])
    anchored = _client("t7").lookup("opt.state[model[0].weight]['exp_avg']", (6, 4), torch.float32)
    assert torch.equal(anchored, opt.state[model[0].weight]["exp_avg"])


def test_module_level_scope_skips_modules(host_daemon, tmp_path):
    script = tmp_path / "prog.py"
    script.write_text(
        "import torch, gpu_anchor, os\n"
        "from torch import nn\n"
        "from gpu_anchor.scope import managed_scope\n"
        "with managed_scope('t8') as scope:\n"
        "    net = nn.Linear(2, 2)\n"
        "print(sorted(scope.report.created))\n")
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    out = preloaded.run([sys.executable, str(script)], env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['net.bias', 'net.weight']"


@pytest.mark.parametrize("swap_on_conversion", [False, True])
def test_dtype_conversion_inside_scope(host_daemon, swap_on_conversion, monkeypatch):
    """``model.to(bfloat16)`` inside the scope: ``param.data = new`` (or swap_tensors) moves the
    parameter to the converted object; the fp32 originals are temporaries and get no memory."""
    monkeypatch.setattr(torch.__future__, "get_swap_module_params_on_conversion", lambda: swap_on_conversion)

    def build():
        torch.manual_seed(11)
        m = nn.Sequential(nn.Embedding(7, 6), nn.Linear(6, 7))
        m[1].weight = m[0].weight
        return m.to(torch.bfloat16)
    ref = build()
    ref_after = torch.rand(3)

    def worker():
        with managed_scope("t9") as scope:
            model = build()
        return scope, model
    s, model = worker()
    assert torch.equal(torch.rand(3), ref_after)
    assert sorted(s.report.created) == ["model[0].weight", "model[1].bias"]
    assert model[1].weight is model[0].weight and model[0].weight.dtype == torch.bfloat16
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)
    objs = _client("t9").objects()
    assert objs["model[0].weight"].dtype == "bfloat16" and objs["model[0].weight"].shape == (7, 6)


def test_nested_scope_is_refused(host_daemon):
    with managed_scope("t10"):
        with pytest.raises(RuntimeError, match="nested"):
            with managed_scope("t10"):
                pass


def test_hooks_registered_inside_scope_survive_binding(host_daemon):
    seen = []
    with managed_scope("t11"):
        lin = nn.Linear(3, 2)
        lin.weight.register_post_accumulate_grad_hook(lambda p: seen.append(("post", tuple(p.grad.shape))))
        lin.bias.register_hook(lambda g: seen.append(("pre", tuple(g.shape))) or g * 2)
        flat = lin.weight.detach().view(-1)          # a live view of a parameter (held by a wrapper)
    lin(torch.ones(1, 3)).sum().backward()
    assert ("post", (2, 3)) in seen and ("pre", (2,)) in seen
    assert torch.equal(lin.bias.grad, torch.full((2,), 2.0))
    assert flat.data_ptr() == lin.weight.data_ptr() and not isinstance(flat, Placeholder)


def test_anchored_optimizer_built_inside_scope(host_daemon):
    train_mod = pytest.importorskip("gpu_anchor.train.optimizer")
    x = torch.randn(8, 4)

    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))

    def train(m, o):
        for _ in range(3):
            m(x).square().sum().backward()
            o.step()
            o.zero_grad()
    ref = build()
    train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2))
    with managed_scope("t12") as s:
        model = build()
        opt = train_mod.AnchoredOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model=model)
    assert len(s.report.created) == 4
    train(model, opt)
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)


def test_on_bound_runs_with_real_tensors(host_daemon):
    from gpu_anchor.scope import current
    seen = []

    class Component:
        def __init__(self):
            self.state = torch.zeros(3)
            sc = current()
            # start-up work that needs data must wait for the bind
            sc.on_bound(lambda: seen.append((type(self.state), float(self.state.sum()))))
    assert current() is None
    with managed_scope("t13") as s:
        comp = Component()
        assert current() is s
    assert current() is None
    assert seen == [(torch.Tensor, 0.0)] and comp.state.data_ptr() == s.objects["comp.state"].data_ptr()
