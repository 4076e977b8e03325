"""Weight gradients written in place (``gpu_anchor.train.grads_in_place``): ``nn.Linear`` layers
over anchored parameters write their weight's gradient with the GEMM that makes it into the
anchored buffer, so nothing copies it home.

    PYTHONPATH=. python -m pytest -q tests/test_train_grads_in_place.py       # the CUDA cases: -m gpu

A user's transformers Llama (tied embeddings), with and without gradient lending, must equal
plain PyTorch bit for bit with the gradients written in place; so must a biased MLP, and the
calls and backwards that do not qualify (autocast, non-contiguous inputs, ``autograd.grad``,
``backward(inputs=...)``, ``create_graph``) must leave the buffers alone.  A copy or a pickle
of the model holds no buffers.  Then the step protocol: SIGKILLs at every protocol point and
at random instants, compared with a fault-free run that copies its gradients home.
"""
import copy
import io
import random
import warnings

import pytest
import torch
from torch import nn

import gpu_anchor
from gpu_anchor.testing import campaign as C
from gpu_anchor.train import grad_lending
from gpu_anchor.train.config import StepProtocolConfig

from test_train_grads import CASES, checkpointing, llama, same_state, train_side_by_side

DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)]


def _anchored(model, client, **config):
    from gpu_anchor.train import AnchoredOptimizer, anchor_module
    anchor_module(model, client)
    return AnchoredOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model=model, client=client,
                             config=StepProtocolConfig(grads_in_place=True, **config))


def _client(request, device, namespace):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    request.getfixturevalue(CASES[device][0])
    return gpu_anchor.connect("cuda:0" if device == "cuda" else "cpu", namespace=namespace)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lend", [False, True])
def test_a_llama_writes_its_linear_gradients_in_place_bit_for_bit(request, monkeypatch, device, lend):
    """Three micro-batches a step and ``clip_grad_norm_``: the first micro-batch's Linear
    gradients are written in place, the later ones accumulate as torch does; ``lm_head``, whose
    weight is the embedding's, is not taken: that gradient is summed by autograd and copied home."""
    _, vocab, hidden, layers, shape = CASES[device]
    client = _client(request, device, f"inplace-{lend}")
    if lend:
        monkeypatch.setattr(grad_lending, "MIN_BYTES", 4096)
    ref, model = (llama(0, vocab, hidden, layers, device) for _ in range(2))
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt = _anchored(model, client, lend_grad_bytes=(1 << 40) if lend else 0)
    st = opt._grads.stats
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    assert len(linears) == 7 * layers + 1
    train_side_by_side(ref, ropt, model, opt, vocab, shape, device, steps=1)
    assert "forward" not in model.lm_head.__dict__
    assert st["modules"] == len(linears) - 1 and all("forward" in m.__dict__ for m in linears[:-1])
    before = dict(st)
    train_side_by_side(ref, ropt, model, opt, vocab, shape, device, steps=4)
    same_state(ref, ropt, model, opt)
    # a step: every other Linear weight written in place; copied: the norms and the tied weight
    assert st["in_place"] - before["in_place"] == 4 * (len(linears) - 1), st
    assert st["copied"] - before["copied"] == 4 * (2 * layers + 1 + 1), st
    if lend:
        assert opt.lender.stats["lent_tensors"] > 0


@pytest.mark.parametrize("reentrant", [False, True])
def test_with_transformers_gradient_checkpointing(request, monkeypatch, reentrant):
    """``gradient_checkpointing_enable()``, as Trainer users turn it on, with lending: the
    layers' forward runs again inside backward (reentrant: as a backward of its own, whose
    engine accumulates into ``p.grad``; non-reentrant: checkpoint's saved-tensor hooks), and
    the weights are written in place all the same; plain torch's bits with the same setting."""
    _, vocab, hidden, layers, shape = CASES["cpu"]
    client = _client(request, "cpu", f"inplace-ckpt-{reentrant}")
    monkeypatch.setattr(grad_lending, "MIN_BYTES", 4096)
    ref, model = (llama(0, vocab, hidden, layers, "cpu") for _ in range(2))
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt = _anchored(model, client, lend_grad_bytes=1 << 40)
    for m in (ref, model):
        checkpointing(m, reentrant)
    train_side_by_side(ref, ropt, model, opt, vocab, shape, "cpu", steps=4)
    same_state(ref, ropt, model, opt)
    st = opt._grads.stats
    # every Linear but the tied lm_head, from the second step on; in the first they are only found
    # (patched there, non-reentrant checkpointing raised CheckpointError: the forward it computed
    # again saved other tensors than the first run's)
    assert st["modules"] == 7 * layers and st["in_place"] == 3 * 7 * layers, st


def test_lending_lends_as_much_with_gradients_written_in_place(host_daemon, monkeypatch):
    """Every gradient byte lendable: the gradients written in place move no lent tensor out
    and the lender keeps its whole budget, as when they are copied.  (With the tied ``lm_head``
    taken, its GEMM wrote into the embedding's buffer at backward's start, where copying puts
    that gradient at its end: the lent tensors there were moved out, and the budget shrank.)"""
    monkeypatch.setattr(grad_lending, "MIN_BYTES", 4096)
    seen = {}
    for in_place in (False, True):
        client = gpu_anchor.connect("cpu", namespace=f"inplace-lend-{in_place}")
        model = llama(0, 4000, 256, 4, "cpu").float()      # bf16 GEMMs are slow on CPUs without bf16 units
        budget = sum(p.numel() * p.element_size() for p in model.parameters())
        from gpu_anchor.train import AnchoredOptimizer, anchor_module
        anchor_module(model, client)
        opt = AnchoredOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model=model, client=client,
                                config=StepProtocolConfig(lend_grad_bytes=budget, grads_in_place=in_place))
        gen = torch.Generator().manual_seed(1)
        for _ in range(5):
            ids = torch.randint(0, 4000, (4, 128), generator=gen)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        st = opt.lender.stats
        seen[in_place] = (st["lent_bytes"], st["evicted_bytes"], opt.lender.budget)
        assert opt._grads.stats["in_place"] == (4 * 7 * 4 if in_place else 0)
    assert seen[True] == seen[False] and seen[True][1] == 0 and seen[True][0] > 0, seen


def _twins_step_alike(ref, ropt, model, opt, inputs):
    """A step of each twin per input, loss ``mean(model(x)^2)``: the same loss every step, the
    same weights and Adam states at the end, bit for bit."""
    for step, x in enumerate(inputs):
        losses = []
        for m, o in ((ref, ropt), (model, opt)):
            loss = m(x).square().mean()
            loss.backward()
            losses.append(loss.detach())
            o.step()
            o.zero_grad()
        assert torch.equal(*losses), step
    same_state(ref, ropt, model, opt)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dims", [2, 3])
def test_a_biased_mlp_bit_for_bit(request, device, dims):
    """Linear layers with a bias, 2-D and 3-D inputs: weights, biases and Adam states equal
    plain torch's; every weight gradient after the first step written in place."""
    client = _client(request, device, f"inplace-mlp-{dims}")

    def make():
        torch.manual_seed(3)
        return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.Tanh(),
                             nn.Linear(64, 8)).to(device)
    ref, model = make(), make()
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt = _anchored(model, client)
    gen = torch.Generator(device=device).manual_seed(4)
    _twins_step_alike(ref, ropt, model, opt, [torch.randn((6, 32) if dims == 2 else (2, 3, 32), device=device,
                                                          generator=gen) for _ in range(5)])
    assert opt._grads.stats["in_place"] == 4 * 3


def test_a_layer_under_accelerate_hooks_is_left_to_them(host_daemon):
    """accelerate's ``add_hook_to_module`` (what ``device_map`` / ``cpu_offload`` put on each
    layer) gives the layer an instance ``forward`` of its own: that layer is not taken, its
    hook still runs at every call, and its gradient is copied home; the other layers are
    taken; the values are torch's."""
    hooks = pytest.importorskip("accelerate.hooks")
    client = gpu_anchor.connect("cpu", namespace="inplace-accelerate")
    calls = []

    class Counting(hooks.ModelHook):
        def pre_forward(self, module, *args, **kwargs):
            calls.append(module)
            return args, kwargs

    def make():
        torch.manual_seed(6)
        return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))
    ref, model = make(), make()
    hooks.add_hook_to_module(model[2], Counting())
    hooked = model[2].forward
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt = _anchored(model, client)
    gen = torch.Generator().manual_seed(2)
    _twins_step_alike(ref, ropt, model, opt, [torch.randn(6, 16, generator=gen) for _ in range(4)])
    st = opt._grads.stats
    assert model[2].forward == hooked and calls == [model[2]] * 4
    assert st["modules"] == 2 and st["in_place"] == 3 * 2, st
    assert st["copied"] == 6 * 4 - st["in_place"], st     # six parameters, four steps: the rest copied


def test_a_layer_called_twice_in_a_forward_bit_for_bit(host_daemon):
    """One ``nn.Linear`` applied twice (and one weight tied to an embedding): autograd sums the
    gradients of both calls before accumulating, so only the first may lie in the buffer; the
    tied weight, summed with the embedding's, is not taken at all."""
    client = gpu_anchor.connect("cpu", namespace="inplace-twice")

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.mix, self.head = nn.Embedding(50, 16), nn.Linear(16, 16), nn.Linear(16, 50, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, ids):
            return self.head(self.mix(torch.tanh(self.mix(self.embed(ids)))))

    def make():
        torch.manual_seed(8)
        return Twice()
    ref, model = make(), make()
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt = _anchored(model, client)
    _twins_step_alike(ref, ropt, model, opt, [torch.randint(0, 50, (3, 5), generator=torch.Generator().manual_seed(i))
                                              for i in range(4)])
    st = opt._grads.stats
    assert st["modules"] == 1 and "forward" not in model.head.__dict__, st
    # from the second step on, the first of mix's two gradients in each
    assert st["in_place"] == 3, st


def _pair(host_daemon, namespace, **config):
    client = gpu_anchor.connect("cpu", namespace=namespace)

    def make():
        torch.manual_seed(5)
        return nn.Sequential(nn.Linear(16, 32, bias=False), nn.GELU(), nn.Linear(32, 4, bias=False))
    ref, model = make(), make()
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt = _anchored(model, client, **config)
    x = torch.randn(8, 16)
    for m, o in ((ref, ropt), (model, opt)):       # the first step finds the layers
        m(x).sum().backward()
        o.step()
        o.zero_grad()
    return ref, ropt, model, opt


def test_autograd_grad_and_a_partial_backward_leave_the_buffers_alone(host_daemon):
    """``autograd.grad`` returns gradients and ``backward(inputs=...)`` skips the weights: the
    buffers are not written, ``p.grad`` stays None, the values are torch's; a full backward
    after them writes in place."""
    ref, ropt, model, opt = _pair(host_daemon, "inplace-grad")
    st = opt._grads.stats
    n = st["in_place"]
    x = torch.randn(8, 16, requires_grad=True)
    xr = x.detach().clone().requires_grad_(True)
    got = torch.autograd.grad(model(x).square().sum(), list(model.parameters()))
    want = torch.autograd.grad(ref(xr).square().sum(), list(ref.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert st["in_place"] == n and all(p.grad is None for p in model.parameters())
    bufs = [q.grad for q in opt._params]
    assert all(g.data_ptr() != b.data_ptr() for g, b in zip(got, bufs))
    model(x).square().sum().backward(inputs=[x])
    ref(xr).square().sum().backward(inputs=[xr])
    assert torch.equal(x.grad, xr.grad) and st["in_place"] == n
    assert all(p.grad is None for p in model.parameters())
    for m, o in ((ref, ropt), (model, opt)):
        m(torch.ones(8, 16)).sum().backward()
        o.step()
        o.zero_grad()
    assert st["in_place"] == n + 2
    same_state(ref, ropt, model, opt)


def test_calls_and_backwards_that_do_not_qualify_run_as_torch(host_daemon):
    """Autocast, a non-contiguous input (the next layer's is contiguous: that one qualifies), a
    4-D input and a ``create_graph`` backward write nothing in place and give torch's bits."""
    ref, ropt, model, opt = _pair(host_daemon, "inplace-not")
    st = opt._grads.stats
    cases = [lambda m, x: m(x),
             lambda m, x: m(x.t().contiguous().t()),
             lambda m, x: m(x.view(2, 2, 2, 16))]
    for i, run in enumerate(cases):
        n = st["in_place"]
        x = torch.randn(16, 8).t() if i == 1 else torch.randn(8, 16)
        for m, o in ((ref, ropt), (model, opt)):
            ctx = torch.autocast("cpu", dtype=torch.bfloat16) if i == 0 else torch.enable_grad()
            with ctx:
                out = run(m, x)
            out.float().square().sum().backward()
            o.step()
            o.zero_grad()
        assert st["in_place"] == n + (i == 1), i
        same_state(ref, ropt, model, opt)
    n = st["in_place"]
    for m, o in ((ref, ropt), (model, opt)):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(9)).requires_grad_(True)
        loss = m(x).square().sum()
        (g,) = torch.autograd.grad(loss, x, create_graph=True)
        assert st["in_place"] == n        # that backward builds a graph: nothing in place
        (loss + g.square().sum()).backward()
        o.step()
        o.zero_grad()
    same_state(ref, ropt, model, opt)


def test_a_copy_or_a_pickle_of_the_model_holds_no_buffers(host_daemon):
    ref, ropt, model, opt = _pair(host_daemon, "inplace-copy")
    st = opt._grads.stats
    n = st["in_place"]
    twin = copy.deepcopy(model)
    twin(torch.randn(8, 16)).sum().backward()
    assert st["in_place"] == n and all(p.grad is None for p in model.parameters())
    assert all(p.grad is not None for p in twin.parameters())
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert all(m.forward.__func__ is nn.Linear.forward for m in loaded.modules() if type(m) is nn.Linear)
    loaded(torch.randn(8, 16)).sum().backward()
    assert st["in_place"] == n
    layers = [m for m in model.modules() if type(m) is nn.Linear]
    assert all("forward" in m.__dict__ for m in layers)
    del opt, st
    import gc
    gc.collect()
    assert not any("forward" in m.__dict__ for m in layers)      # the optimizer gone: torch's forward again


def test_a_later_optimizer_over_the_same_model_takes_its_layers(host_daemon):
    """The first optimizer still alive (a reference cycle, say) when the second is built: the
    second takes the layers, and the first one's end leaves them to it."""
    from gpu_anchor.train import AnchoredOptimizer
    ref, ropt, model, old = _pair(host_daemon, "inplace-first")
    layers = [m for m in model.modules() if type(m) is nn.Linear]
    new = AnchoredOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3), model=model, client=old.client,
                            config=StepProtocolConfig(prefix="second", grads_in_place=True))
    x = torch.randn(8, 16)
    for _ in range(2):
        model(x).sum().backward()
        new.step()
        new.zero_grad()
    # taken in its first step, in place from the second
    assert new._grads.stats["modules"] == 2 and new._grads.stats["in_place"] == 2
    assert old._grads.stats["in_place"] == 0      # its one step found the layers, and wrote nothing
    del old
    import gc
    gc.collect()
    assert all("forward" in m.__dict__ for m in layers)
    model(x).sum().backward()
    new.step()
    assert new._grads.stats["in_place"] == 4


def test_no_linear_layer_says_so(host_daemon):
    from gpu_anchor.train import AnchoredOptimizer, anchor_module
    client = gpu_anchor.connect("cpu", namespace="inplace-none")
    model = nn.Sequential(nn.Conv1d(4, 4, 3))
    anchor_module(model, client)
    opt = AnchoredOptimizer(torch.optim.AdamW(model.parameters()), model=model, client=client,
                            config=StepProtocolConfig(grads_in_place=True))
    model(torch.randn(2, 4, 8)).sum().backward()
    with pytest.warns(RuntimeWarning, match="grads_in_place writes no gradient in place"):
        opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.zero_grad()
        model(torch.randn(2, 4, 8)).sum().backward()
        opt.step()


def _ddp_one_rank_worker(store, bucket_view):
    """``torchrun --nproc-per-node 1`` with the model in DDP: one rank, so the gradients are this
    process's, and DDP's reducer handles them after they are accumulated (copying them into its
    buckets and back, or making ``p.grad`` a view of a bucket).  Plain DDP's bits at every step."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    grad_lending.MIN_BYTES = 4096          # a forked child of its own: the test's small tensors lent
    client = gpu_anchor.connect("cpu", namespace=f"inplace-ddp-{int(bucket_view)}")
    _, vocab, hidden, layers, shape = CASES["cpu"]
    ref, model = (llama(0, vocab, hidden, layers, "cpu") for _ in range(2))
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt = _anchored(model, client, lend_grad_bytes=1 << 40)
    wrapped = [(DDP(m, gradient_as_bucket_view=bucket_view), o) for m, o in ((ref, ropt), (model, opt))]
    gen = torch.Generator().manual_seed(1)
    for step in range(4):
        ids = torch.randint(0, vocab, shape, generator=gen)
        seen = []
        for m, o in wrapped:
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            seen.append((loss.detach(), torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)))
            o.step()
            o.zero_grad()
        assert all(torch.equal(a, b) for a, b in zip(*seen)), step
    same_state(ref, ropt, model, opt)
    st = opt._grads.stats
    # the first step finds the layers; every Linear but the tied lm_head, in place from the second
    assert st["modules"] == 7 * layers and st["in_place"] == 3 * 7 * layers, st
    assert opt.lender.stats["lent_tensors"] > 0
    dist.destroy_process_group()


@pytest.mark.parametrize("bucket_view", [False, True])
def test_ddp_on_one_rank_bit_for_bit(host_daemon, tmp_path, bucket_view):
    C.prewarm(C.CampaignConfig())
    assert C._wait(C._child(_ddp_one_rank_worker, str(tmp_path / "store"), bucket_view)) == 0


@pytest.mark.parametrize("bad", [1, "yes", 0.5])
def test_config_refuses_a_non_boolean(bad):
    with pytest.raises(ValueError, match="grads_in_place must be True, False or None"):
        StepProtocolConfig(grads_in_place=bad)


def test_the_automatic_choice_resolves_both_settings():
    """None (the default) is decided by the optimizer: both on where they apply (a CUDA device,
    one process, fresh gradients), every gradient byte lendable; both off elsewhere; a value
    named is kept as named."""
    auto = StepProtocolConfig()
    assert (auto.lend_grad_bytes, auto.grads_in_place) == (None, None)
    on, off = auto.resolve(True, 12345), auto.resolve(False, 12345)
    assert (on.lend_grad_bytes, on.grads_in_place) == (12345, True)
    assert (off.lend_grad_bytes, off.grads_in_place) == (0, False)
    named = StepProtocolConfig(lend_grad_bytes=7, grads_in_place=False)
    assert named.resolve(True, 12345) == named and named.resolve(False, 1) == named
    assert StepProtocolConfig(grads_in_place=True).resolve(False, 1).grads_in_place is True


@pytest.mark.parametrize("device", DEVICES)
def test_defaults_lend_and_write_in_place_on_a_gpu_only_and_quietly(request, monkeypatch, device):
    """An optimizer built with no setting named: on a GPU its gradients are lent and written in
    place, and training equals plain PyTorch bit for bit; on the CPU neither, and ``opt.config``
    says so.  Either way nothing warns (the first step taking a layer or not is no news)."""
    from gpu_anchor.train import AnchoredOptimizer, anchor_module
    _, vocab, hidden, layers, shape = CASES[device]
    client = _client(request, device, "inplace-defaults")
    monkeypatch.setattr(grad_lending, "MIN_BYTES", 4096)
    ref, model = (llama(0, vocab, hidden, layers, device) for _ in range(2))
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    anchor_module(model, client)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        opt = AnchoredOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model=model, client=client)
        train_side_by_side(ref, ropt, model, opt, vocab, shape, device, steps=3)
    same_state(ref, ropt, model, opt)
    gpu = device == "cuda"
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert opt.config.lend_grad_bytes == (grad_bytes if gpu else 0)
    assert opt.config.grads_in_place is gpu and (opt.lender is not None) is gpu
    assert (opt._grads.stats["in_place"] > 0) is gpu, opt._grads.stats
    if gpu:
        assert opt.lender.stats["lent_tensors"] > 0


# ---------------------------------------------------------------------- the step protocol, killed
PROTOCOL_POINTS = ["between_steps@2", "before_boundary@3", "after_boundary@4", "before_update@5:0",
                   "mid_chunk@5:1", "after_update@6:0", "after_commit@6:1"]


@pytest.mark.usefixtures("host_daemon")
def test_kills_end_where_a_run_that_copies_its_gradients_ends(tmp_path):
    """Workers killed at each protocol point and at 20 random instants (inside backwards among
    them, with gradients half written in place): every loss and every anchored object equals a
    fault-free run whose gradients are copied home, bit for bit."""
    ref = C.run("inplace-ref", C.CampaignConfig(steps=10), str(tmp_path / "ref.log"))
    cfg = C.CampaignConfig(steps=10, grads_in_place=True)
    res = C.run("inplace-pts", cfg, str(tmp_path / "pts.log"), faults_seq=PROTOCOL_POINTS)
    assert res.kills == len(PROTOCOL_POINTS)
    assert C.trajectory(res.log) == C.trajectory(ref.log)
    assert C.compare(gpu_anchor.connect("cpu", namespace="inplace-ref"),
                     gpu_anchor.connect("cpu", namespace="inplace-pts")) == []
    assert "grads in_place=" in res.log and "in_place=0 " not in res.log, res.log[-300:]
    C.random_kill_runs("inplace-rand", cfg, str(tmp_path), ref, "inplace-ref", 20, random.Random(20261206))


@pytest.mark.parametrize("how", ["model", "attention"])
def test_under_torch_compile(request, how):
    """A layer called inside a compiled frame is not taken (the graph makes its gradients):
    the whole model compiled takes none and ``step()`` says so; with each layer's attention
    compiled in place (``Module.compile``, torchtitan's way, at a finer grain) the MLPs' layers
    are taken.  Every step has the bits of the plain twin compiled alike (``aot_eager``: no C++
    compiler here)."""
    torch._dynamo.reset()       # a fresh cache, as for every compiled test: no other test's code reused
    _, vocab, hidden, layers, shape = CASES["cpu"]
    client = _client(request, "cpu", f"inplace-compile-{how}")
    ref, model = (llama(0, vocab, hidden, layers, "cpu") for _ in range(2))
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt = _anchored(model, client)
    if how == "model":
        run_ref, run_model = torch.compile(ref, backend="aot_eager"), torch.compile(model, backend="aot_eager")
    else:
        for m in (ref, model):
            for layer in m.model.layers:
                layer.self_attn.compile(backend="aot_eager")
        run_ref, run_model = ref, model
    ids = torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(11))
    for step in range(3):
        seen = []
        for m, o in ((run_ref, ropt), (run_model, opt)):
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                o.step()
            o.zero_grad()
            seen.append(loss.detach())
        assert torch.equal(*seen), step
        said = [w for w in caught if "grads_in_place writes no gradient" in str(w.message)]
        assert len(said) == (how == "model" and step == 0), said
    assert opt._grads.stats["modules"] == (0 if how == "model" else 3 * layers)
    assert opt._grads.stats["in_place"] == (0 if how == "model" else 2 * 3 * layers)
    same_state(ref, ropt, model, opt)
