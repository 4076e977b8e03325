"""Gradient lending (``gpu_anchor.train.grad_lending``): the anchored gradient buffers hold the
forward's last saved activations between ``zero_grad()`` and the next backward.

    PYTHONPATH=. python -m pytest -q tests/test_train_grad_lending.py        # the CUDA cases: -m gpu

A user's transformers Llama (tied embeddings) trained with lending must equal plain PyTorch bit
for bit — losses, gradient norms, weights, Adam states — with micro-batches and
``clip_grad_norm_``, with a budget so large that gradients land on lent tensors still alive
(they are moved out first), with a retained graph, and with a gradient penalty
(``create_graph``).  Then the step protocol: SIGKILLs at every protocol point and at random
instants while tensors are lent, compared with a run that lends nothing.  On a CPU each
gradient buffer is its own mapping and the model is small, so the tests lower ``MIN_BYTES``.
"""
import random
import re
import warnings

import pytest
import torch

import gpu_anchor
from gpu_anchor.testing import campaign as C
from gpu_anchor.train import grad_lending
from gpu_anchor.train.config import StepProtocolConfig

from test_train_grads import CASES, checkpointing, llama, same_state, train_side_by_side

DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)]


def _setup(request, device, monkeypatch, namespace, budget, attn="sdpa"):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    fixture, vocab, hidden, layers, shape = CASES[device]
    request.getfixturevalue(fixture)
    if device == "cpu":
        monkeypatch.setattr(grad_lending, "MIN_BYTES", 4096)
    from gpu_anchor.train import AnchoredOptimizer, anchor_module
    client = gpu_anchor.connect("cuda:0" if device == "cuda" else "cpu", namespace=namespace)
    ref, model = (llama(0, vocab, hidden, layers, device, attn) for _ in range(2))
    anchor_module(model, client)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt = AnchoredOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model=model, client=client,
                            config=StepProtocolConfig(lend_grad_bytes=budget))
    assert opt.lender is not None
    return ref, ropt, model, opt, vocab, shape


def _cpu_client(monkeypatch, namespace):
    """A client of the host daemon, with ``MIN_BYTES`` lowered to the toy models' tensors."""
    monkeypatch.setattr(grad_lending, "MIN_BYTES", 4096)
    return gpu_anchor.connect("cpu", namespace=namespace)


def _twins(make, client, budget):
    """``make()`` twice: a plain model with torch's AdamW and an anchored one lending ``budget``."""
    from gpu_anchor.train import AnchoredOptimizer, anchor_module
    ref, model = make(), make()
    anchor_module(model, client)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt = AnchoredOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model=model, client=client,
                            config=StepProtocolConfig(lend_grad_bytes=budget))
    return ref, ropt, model, opt


def _grad_bytes(opt) -> int:
    return sum(q.grad.numel() * q.grad.element_size() for q in opt._params)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("budget", ["half", "all"])
def test_lent_llama_equals_plain_torch_bit_for_bit(request, monkeypatch, device, budget):
    """Three micro-batches a step and ``clip_grad_norm_``; "all" lends every gradient byte, so
    gradients arrive on lent tensors still alive (moved out first) and the budget shrinks."""
    ref, ropt, model, opt, vocab, shape = _setup(request, device, monkeypatch, f"lend-{budget}", 1 << 40)
    opt.lender.budget = _grad_bytes(opt) // 2 if budget == "half" else _grad_bytes(opt)
    train_side_by_side(ref, ropt, model, opt, vocab, shape, device, steps=5)
    same_state(ref, ropt, model, opt)
    st = opt.lender.stats
    assert st["windows"] >= 3 and st["lent_tensors"] > 0, st


def test_sequence_lengths_that_change_every_step(request, monkeypatch):
    """Batches of another length each step (as variable-length data makes them): every window's
    candidates have other sizes than the plan learnt, the tail the hooks see updates it, and
    the results equal plain torch bit for bit."""
    ref, ropt, model, opt, vocab, _ = _setup(request, "cpu", monkeypatch, "lend-lengths", 1 << 40)
    opt.lender.budget = _grad_bytes(opt)
    gen = torch.Generator().manual_seed(4)
    for step, seq in enumerate([32, 48, 16, 64, 24, 40, 32]):
        ids = torch.randint(0, vocab, (2, seq), generator=gen)
        seen = []
        for m, o in ((ref, ropt), (model, opt)):
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            seen.append(loss.detach())
            o.step()
            o.zero_grad()
        assert torch.equal(seen[0], seen[1]), step
    same_state(ref, ropt, model, opt)
    assert opt.lender.stats["lent_tensors"] > 0 and opt.lender.stats["windows"] >= 5


@pytest.mark.parametrize("reentrant", [False, True])
def test_with_transformers_gradient_checkpointing(request, monkeypatch, reentrant):
    """transformers' activation (gradient) checkpointing: torch.utils.checkpoint's own saved-tensor hooks win
    inside each layer (non-reentrant), the recomputation runs inside backward (reentrant);
    either way the same bits as plain torch with the same checkpointing."""
    ref, ropt, model, opt, vocab, shape = _setup(request, "cpu", monkeypatch, f"lend-ckpt-{reentrant}", 1 << 40)
    for m in (ref, model):
        checkpointing(m, reentrant)
    train_side_by_side(ref, ropt, model, opt, vocab, shape, "cpu", steps=4)
    same_state(ref, ropt, model, opt)


def test_gradients_arriving_on_lent_tensors_move_them_out_first(host_daemon, monkeypatch):
    """A backward whose gradients arrive in another order than the last one (control flow that
    changed): lent tensors sit where gradients now arrive first.  They are moved to torch
    memory before each gradient lands, the results equal plain torch bit for bit, and the next
    budget shrinks by what was moved."""
    from gpu_anchor.train import AnchoredOptimizer, anchor_module
    monkeypatch.setattr(grad_lending, "MIN_BYTES", 4096)
    client = gpu_anchor.connect("cpu", namespace="lend-order")

    def mlp():
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    ref, model = mlp(), mlp()
    anchor_module(model, client)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt = AnchoredOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model=model, client=client,
                            config=StepProtocolConfig(lend_grad_bytes=1 << 30))
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(3))
    for step in range(4):
        if step == 2:        # as if the last backward had made its gradients in the reverse order
            opt.lender.plan.order.reverse()
            opt.lender.plan._areas = None
        for m, o in ((ref, ropt), (model, opt)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
    same_state(ref, ropt, model, opt)
    st = opt.lender.stats
    assert st["lent_tensors"] > 0 and st["evicted_bytes"] > 0, st
    assert opt.lender.budget < 1 << 30
    # a parameter seen through a view (what linear saves: weight.t()) is never copied
    opt.zero_grad()
    opt.lender.plan.chosen, opt.lender.budget = {opt.lender._k, opt.lender._k + 1}, 1 << 30
    w = model[0].weight
    assert isinstance(opt.lender._pack(w.t()), grad_lending._Kept)
    assert isinstance(opt.lender._pack(torch.randn(256, 256).requires_grad_(True) * 2), grad_lending._Lent)


def test_a_tail_tensor_larger_than_the_budget_is_passed_over(host_daemon, monkeypatch):
    """The forward's last saved tensor (the wide output's tanh, 512 KiB) does not fit a budget
    of 200 KiB: it stays in torch memory and the 64 KiB tensors saved before it are lent
    instead.  The same bits as plain torch."""
    from gpu_anchor.train import AnchoredOptimizer, anchor_module
    monkeypatch.setattr(grad_lending, "MIN_BYTES", 4096)
    client = gpu_anchor.connect("cpu", namespace="lend-pass-over")

    def mlp():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256),
                                   torch.nn.Linear(256, 2048), torch.nn.Tanh())
    ref, model = mlp(), mlp()
    anchor_module(model, client)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt = AnchoredOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model=model, client=client,
                            config=StepProtocolConfig(lend_grad_bytes=200 << 10))
    x, lent = torch.randn(64, 256), []
    for step in range(4):
        for m, o in ((ref, ropt), (model, opt)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
        lent.append(opt.lender.stats["last_lent_bytes"])
    # the first window only learns; the second lends x too, the caller's, which outlives the
    # forward (copying it freed nothing), so the later ones lend the two hidden layers' outputs
    assert lent == [0, 3 * 64 * 256 * 4, 2 * 64 * 256 * 4, 2 * 64 * 256 * 4]
    same_state(ref, ropt, model, opt)
    assert opt.lender.stats["evicted_bytes"] == 0


def test_a_tensor_saved_several_times_is_one_candidate(host_daemon, monkeypatch):
    """The q, k and v projections each save the same input ``h``: the plan counts its bytes once,
    and ``h`` is lent at every save or at none (a copy made at the third save while the first
    kept the original would free nothing).  A budget of the five distinct tensors after the
    caller's ``x`` lends all five; the same bits as plain torch.  The input is a batch of
    sequences, as a transformer's is: each projection then saves a 2-D view that torch makes
    in C++, whose Python object dies when the hook returns, so only the storage can tell that
    the three saves are one tensor (a lending window counted them as three before)."""
    client = _cpu_client(monkeypatch, "lend-saved-twice")

    class QKV(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.inp, self.q, self.k, self.v = (torch.nn.Linear(256, 256) for _ in range(4))

        def forward(self, x):
            h = self.inp(x)
            return self.q(h) * self.k(h) * self.v(h)
    one = 64 * 256 * 4
    ref, ropt, model, opt = _twins(QKV, client, 5 * one)
    packs, pack = [], opt.lender._pack

    def spy(t):
        out = pack(t)
        packs.append((t.untyped_storage().data_ptr(), type(out)))
        return out
    monkeypatch.setattr(opt.lender, "_pack", spy)
    x, lent = torch.randn(4, 16, 256, generator=torch.Generator().manual_seed(5)), []
    for step in range(4):
        packs.clear()
        for m, o in ((ref, ropt), (model, opt)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
        lent.append(opt.lender.stats["last_lent_bytes"])
        kinds: dict[int, set] = {}
        for ptr, kind in packs:
            kinds.setdefault(ptr, set()).add(kind)
        assert all(len(k) == 1 for k in kinds.values()), (step, kinds)
    assert lent == [0, 5 * one, 5 * one, 5 * one]
    same_state(ref, ropt, model, opt)


def _global_hooks() -> int:
    from torch.nn.modules import module as nn_module
    return len(nn_module._global_forward_pre_hooks) + len(nn_module._global_forward_hooks)


def _hooked(model) -> list[str]:
    return [n for n, m in model.named_modules() if m._forward_pre_hooks or m._forward_hooks]


def test_hooks_go_on_where_the_lent_tail_begins(host_daemon, monkeypatch):
    """Lending the last four of eight layers' activations, the saved-tensor hooks see every save
    of the learning window, then only those from the module call where the chosen tail began:
    the saves before it stay torch's own (no Python object each, which fed the garbage
    collector).  Another model's forward in one window (a teacher's, here) moves nothing: the
    calls are counted in our forwards.  Global module hooks put every module call of the process
    on torch's slow path: they are on while the lender learns only; lending, the root (the model)
    and the mark (the module whose call begins the lent tail) carry its hooks, and no other
    module.  The same bytes lent each window, the same bits as plain torch."""
    client = _cpu_client(monkeypatch, "lend-late-push")

    def mlp():
        torch.manual_seed(0)
        return torch.nn.Sequential(*[m for _ in range(8) for m in (torch.nn.Linear(256, 256), torch.nn.Tanh())])
    # a linear saves its input and weight.t() (the first one, whose input needs no gradient, its
    # input only), a tanh its output, which the next linear saves again: one candidate a layer
    one = 64 * 256 * 4
    ref, ropt, model, opt = _twins(mlp, client, 4 * one)
    calls, pack = [], opt.lender._pack

    def spy(t):
        calls[-1] += 1
        return pack(t)
    monkeypatch.setattr(opt.lender, "_pack", spy)
    teacher = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)])
    x, lent = torch.randn(64, 256, generator=torch.Generator().manual_seed(6)), []
    hooks = []
    for step in range(5):
        calls.append(0)
        hooks.append((_global_hooks(), _hooked(model)))
        if step == 2:
            with torch.no_grad():
                teacher(x)
        for m, o in ((model, opt), (ref, ropt)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
        lent.append(opt.lender.stats["last_lent_bytes"])
    assert lent == [0, 4 * one, 4 * one, 4 * one, 4 * one]
    # learning: 8 x 3 - 1 saves; lending the last four tanh outputs: from the fifth tanh's call on
    assert calls[0] == 23 and calls[1:] == [10, 10, 10, 10], calls
    # learning: the global pair; then the model and its tail's first module (the fifth tanh,
    # whose output is the first of the four lent), and no global hook
    assert hooks[0] == (2, []) and hooks[1:] == [(0, ["", "9"])] * 4, hooks
    same_state(ref, ropt, model, opt)


class _TanhStack(torch.nn.Module):
    """``layers`` linear layers, each followed by a tanh; a forward runs the first ``depth`` of
    them, then ``extra`` more tanhs (saves with no parameter)."""

    def __init__(self, layers: int):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(256, 256) for _ in range(layers))
        self.depth, self.extra = layers, 0

    def forward(self, x):
        for layer in self.layers[:self.depth]:
            x = torch.tanh(layer(x))
        for _ in range(self.extra):
            x = torch.tanh(x)
        return x


def _lend_steps(twins, seed: int, settings: list[dict]):
    """One step of each twin per entry of ``settings`` (attributes set on both models first), on
    one batch; the bytes lent in each step, and whether the lender learns in the next."""
    ref, ropt, model, opt = twins
    x, lent, learning = torch.randn(64, 256, generator=torch.Generator().manual_seed(seed)), [], []
    for attrs in settings:
        for name, value in attrs.items():
            setattr(ref, name, value)
            setattr(model, name, value)
        before = opt.lender.stats["lent_bytes"]
        for m, o in ((model, opt), (ref, ropt)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
        lent.append(opt.lender.stats["lent_bytes"] - before)
        learning.append(opt.lender.plan.chosen is None)
    return lent, learning


def test_a_forward_that_no_longer_reaches_the_lent_tail_learns_again(host_daemon, monkeypatch):
    """The plan was learnt on eight layers; a step that runs four never reaches the module call
    where the hooks went on: it lends nothing, the next window learns the whole forward again,
    and the one after lends the four layers' tail.  The same bits as plain torch."""
    client = _cpu_client(monkeypatch, "lend-shorter")
    one = 64 * 256 * 4
    ref, ropt, model, opt = _twins(lambda: _TanhStack(8), client, 2 * one)
    lent, learning = _lend_steps((ref, ropt, model, opt), 7, [{"depth": d} for d in [8, 8, 8, 4, 4, 4, 4]])
    # step 0 learns (the window the optimizer's construction opened), 1 and 2 lend; step 3 (four
    # layers) never reaches the eight-layer tail: it lends nothing and the next window learns
    # again (step 4); steps 5 and 6 lend the new tail
    assert lent == [0, 2 * one, 2 * one, 0, 0, 2 * one, 2 * one], lent
    assert learning[3] and not learning[4]
    same_state(ref, ropt, model, opt)


def test_a_forward_whose_candidates_change_every_step_keeps_the_global_hooks(host_daemon, monkeypatch):
    """A forward whose saved tensors after the mark differ from the ones learnt (one more every
    other step): the lender learns again; when the next lending window differs too, it
    lends with the global hooks from then on, which record the calls each window sees.  It
    lends in every window after that, with plain torch's bits."""
    client = _cpu_client(monkeypatch, "lend-drift")
    one = 64 * 256 * 4
    ref, ropt, model, opt = _twins(lambda: _TanhStack(6), client, 2 * one)
    lent, learning = _lend_steps((ref, ropt, model, opt), 9, [{"extra": step % 2} for step in range(9)])
    # 0 learns; 1 has one more tanh after the mark: learn again (2); 3 differs again: the
    # global hooks from then on, which lend from 4 on (3's own saves stand until it ended)
    assert learning[:3] == [False, True, False] and not any(learning[3:]), learning
    assert _global_hooks() == 2 and _hooked(model) == []
    assert all(b > 0 for b in lent[4:]), lent
    same_state(ref, ropt, model, opt)


def test_a_forward_with_two_outermost_modules_keeps_the_global_hooks(host_daemon, monkeypatch):
    """A training step that calls two modules of the model itself (an encoder, then a head): no
    one module begins its forwards, so the lender lends with the global hooks, as it learnt."""
    client = _cpu_client(monkeypatch, "lend-two-roots")

    def parts():
        torch.manual_seed(0)
        return torch.nn.ModuleDict({"body": torch.nn.Sequential(*[m for _ in range(4) for m in (
            torch.nn.Linear(256, 256), torch.nn.Tanh())]), "head": torch.nn.Linear(256, 256)})
    one = 64 * 256 * 4
    ref, ropt, model, opt = _twins(parts, client, 3 * one)
    x, lent = torch.randn(64, 256, generator=torch.Generator().manual_seed(10)), []
    for step in range(4):
        for m, o in ((model, opt), (ref, ropt)):
            m["head"](m["body"](x)).square().mean().backward()
            o.step()
            o.zero_grad()
        lent.append(opt.lender.stats["last_lent_bytes"])
    assert lent[0] == 0 and all(b > 0 for b in lent[1:]), lent
    assert _global_hooks() == 2 and _hooked(model) == []
    same_state(ref, ropt, model, opt)


@pytest.mark.parametrize("device,backend", [("cpu", "aot_eager"),
                                            pytest.param("cuda", "inductor", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("how", ["model", "blocks"])
def test_under_torch_compile(request, monkeypatch, how, device, backend):
    """``torch.compile`` of the whole model (its wrapper is the root) or of each decoder layer in
    place (``Module.compile``, as torchtitan does); on the CPU backend ``aot_eager`` (no C++
    compiler), on a GPU inductor's Triton kernels: module hooks do nothing inside a traced frame,
    and the global hooks' going off after the learning window recompiles once.  Under
    ``aot_eager`` that changes the saves of the next window, which learns again: lending begins
    at the fourth step; under inductor (on an H100, and on this CPU with a C++ compiler) the
    saves stay the same and it begins at the second.  Every step has the bits of the plain twin
    compiled alike."""
    # compiled code another test left for the same forward would change when lending starts
    torch._dynamo.reset()
    ref, ropt, model, opt, vocab, shape = _setup(request, device, monkeypatch, f"lend-compile-{how}-{device}",
                                                 1 << 40)
    if how == "model":
        run_ref, run_model = torch.compile(ref, backend=backend), torch.compile(model, backend=backend)
    else:
        for m in (ref, model):
            for layer in m.model.layers:
                layer.compile(backend=backend)
        run_ref, run_model = ref, model
    gen = torch.Generator(device=device).manual_seed(11)
    ids = torch.randint(0, vocab, shape, generator=gen, device=device)
    lent = []
    for step in range(5):
        before = opt.lender.stats["lent_tensors"]
        seen = []
        for m, o in ((run_ref, ropt), (run_model, opt)):
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            o.step()
            o.zero_grad()
            seen.append(loss.detach())
        assert torch.equal(*seen), step
        lent.append(opt.lender.stats["lent_tensors"] - before)
    assert lent[0] == 0 and all(n > 0 for n in lent[3:]), lent
    if backend == "aot_eager":
        assert lent[:3] == [0, 0, 0], lent
    same_state(ref, ropt, model, opt)


@pytest.mark.gpu
def test_a_forward_on_another_stream_lends_nothing(request, monkeypatch):
    """Lent copies run on the stream current at ``zero_grad()``: a forward on another stream
    lends nothing (its saves stay torch's own), the next one on the window's stream lends again,
    and every step has plain torch's bits."""
    ref, ropt, model, opt, vocab, shape = _setup(request, "cuda", monkeypatch, "lend-stream", 1 << 40)
    gen = torch.Generator(device="cuda").manual_seed(3)
    side = torch.cuda.Stream()
    lent = []
    for step in range(5):
        ids = torch.randint(0, vocab, shape, device="cuda", generator=gen)
        seen = []
        for m, o in ((ref, ropt), (model, opt)):
            before = opt.lender.stats["lent_tensors"]
            if step == 3:
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    loss = m(input_ids=ids, labels=ids).loss
                    loss.backward()
                torch.cuda.current_stream().wait_stream(side)
            else:
                loss = m(input_ids=ids, labels=ids).loss
                loss.backward()
            o.step()
            o.zero_grad()
            seen.append(loss.detach())
        lent.append(opt.lender.stats["lent_tensors"] - before)
        assert torch.equal(seen[0], seen[1]), step
    same_state(ref, ropt, model, opt)
    assert lent[0] == 0 and lent[1] > 0 and lent[2] > 0 and lent[3] == 0 and lent[4] > 0, lent


@pytest.mark.parametrize("device", DEVICES)
def test_retained_graph_and_gradient_penalty(request, monkeypatch, device):
    """``backward(retain_graph=True)`` twice (lent tensors outlive the first backward) and a
    ``create_graph`` gradient penalty (eager attention: SDPA has no double backward): the same
    bits as plain torch."""
    ref, ropt, model, opt, vocab, shape = _setup(request, device, monkeypatch, "lend-retain", 1 << 40, "eager")
    gen = torch.Generator(device=device).manual_seed(2)
    for step in range(4):
        ids = torch.randint(0, vocab, shape, device=device, generator=gen)
        seen = []
        for m, o in ((ref, ropt), (model, opt)):
            emb = m.model.embed_tokens(ids).detach().requires_grad_(True)
            out = m(inputs_embeds=emb, labels=ids)
            if step % 2:
                out.loss.backward(retain_graph=True)
                out.loss.backward()
            else:
                (g,) = torch.autograd.grad(out.loss, emb, create_graph=True)
                (out.loss + g.float().pow(2).sum()).backward()
            seen.append(out.loss.detach())
            o.step()
            o.zero_grad()
        assert torch.equal(seen[0], seen[1]), step
    same_state(ref, ropt, model, opt)
    assert opt.lender.stats["lent_tensors"] > 0


def test_a_kept_tensor_changed_in_place_still_raises(request, monkeypatch):
    """torch skips its in-place check for hooked saved tensors; the lender keeps it for the ones
    it does not copy."""
    ref, ropt, model, opt, vocab, shape = _setup(request, "cpu", monkeypatch, "lend-inplace", 1 << 40)
    x = torch.randn(8, requires_grad=True)
    y = x.exp()          # saves its result, too small to lend: kept
    y.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_hooks_only_in_forwards_of_the_window(request, monkeypatch):
    """The saved-tensor hooks are pushed around the outermost module call between zero_grad()
    and the first gradient only; a user's hooks in force win; unbalanced ones stop lending,
    said once."""
    ref, ropt, model, opt, vocab, shape = _setup(request, "cpu", monkeypatch, "lend-hooks", 1 << 40)
    top = torch._C._autograd._top_saved_tensors_default_hooks
    ours = lambda: top(True) is not None and getattr(top(True)[0], "__self__", None) is opt.lender  # noqa: E731
    seen = []
    model.model.layers[0].register_forward_hook(lambda m, a, o: seen.append(ours()))
    ids = torch.randint(0, vocab, shape)

    def iteration(micro=2):
        for _ in range(micro):
            model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    iteration()
    iteration()
    assert seen == [True, False] * 2 and top(True) is None
    assert opt.lender.stats["lent_tensors"] > 0
    # another model's forward in the window (the plain twin here) lends nothing
    other = []
    ref.model.layers[0].register_forward_hook(lambda m, a, o: other.append(top(True) is not None))
    ref(input_ids=ids, labels=ids).loss.backward()
    assert other == [False]
    seen.clear()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):    # the user's, around it
        iteration(1)
    assert seen == [False] and top(True) is None
    # hooks pushed inside the forward and never popped: lending stops, with a warning
    user = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    h = model.model.layers[0].register_forward_pre_hook(lambda m, a: user.__enter__())
    try:
        with pytest.warns(RuntimeWarning, match="gradient lending stops"):
            iteration(1)
    finally:
        h.remove()
        while top(True) is not None:      # theirs, and ours if they went on before theirs
            torch._C._autograd._pop_saved_tensors_default_hooks()
    assert opt.lender.disabled is not None and top(True) is None
    seen.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        iteration(1)
    assert seen == [False]


def test_a_budget_nothing_fits_says_so_once_and_hooks_nothing(host_daemon, monkeypatch):
    """A budget smaller than every candidate: after the learning window the lender warns once,
    naming the smallest candidate and the budget, and hooks nothing from then on (no global
    hook, no module hook); the steps are plain torch's."""
    client = _cpu_client(monkeypatch, "lend-idle")
    one = 64 * 256 * 4
    ref, ropt, model, opt = _twins(lambda: _TanhStack(4), client, one - 1)
    with pytest.warns(RuntimeWarning, match=f"lends nothing from now on: none of its 5 candidates fits: the smallest is {one} bytes, the budget {one - 1}"):
        lent, learning = _lend_steps((ref, ropt, model, opt), 12, [{}])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lent, learning = _lend_steps((ref, ropt, model, opt), 12, [{}] * 3)
    assert lent == [0, 0, 0] and not any(learning)
    assert _global_hooks() == 0 and _hooked(model) == []
    same_state(ref, ropt, model, opt)


def test_config_refuses_a_bad_budget():
    for bad in (-1, True, 1.5, "1G"):
        with pytest.raises(ValueError, match="lend_grad_bytes"):
            StepProtocolConfig(lend_grad_bytes=bad)


# ---------------------------------------------------------------------- the step protocol, killed
PROTOCOL_POINTS = ["between_steps@2", "before_boundary@3", "after_boundary@4", "before_update@5:0",
                   "mid_chunk@5:1", "after_update@6:0", "after_commit@6:1"]


@pytest.mark.usefixtures("host_daemon")
@pytest.mark.parametrize("progress", ["journal", "device"])
def test_kills_while_lent_end_where_a_run_that_lends_nothing_ends(monkeypatch, tmp_path, progress):
    """Workers killed at each protocol point and at 20 random instants, some of them inside a
    forward with tensors lent: every loss and every anchored object equals a fault-free run
    without lending, bit for bit."""
    monkeypatch.setattr(grad_lending, "MIN_BYTES", 256)
    base = C.CampaignConfig(steps=10, progress=progress)
    ref = C.run(f"lend-ref-{progress}", base, str(tmp_path / "ref.log"))
    cfg = C.CampaignConfig(steps=10, progress=progress, lend_grad_bytes=1 << 20)
    res = C.run(f"lend-pts-{progress}", cfg, str(tmp_path / "pts.log"), faults_seq=PROTOCOL_POINTS)
    assert res.kills == len(PROTOCOL_POINTS)
    for ns, r in ((f"lend-pts-{progress}", res),):
        assert C.trajectory(r.log) == C.trajectory(ref.log)
        assert C.compare(gpu_anchor.connect("cpu", namespace=f"lend-ref-{progress}"),
                         gpu_anchor.connect("cpu", namespace=ns)) == []
    C.random_kill_runs(f"lend-rand-{progress}", cfg, str(tmp_path), ref, f"lend-ref-{progress}", 20,
                       random.Random(20261204))
    lent = re.search(r"lending lent_total=(\d+)", res.log)
    assert lent and int(lent.group(1)) > 0, res.log[-300:]
