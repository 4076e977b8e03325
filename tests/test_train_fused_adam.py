"""GPU: the fused anchored Adam/AdamW update (``gpu_anchor.train.fused_adam``) against torch's own.

    PYTHONPATH=. python -m pytest -q -m gpu tests/test_train_fused_adam.py

Skips without CUDA or Triton.  The kernel must reproduce torch's AdamW / Adam step bit for
bit (bf16 and fp32, weight decay both ways, amsgrad, maximize, odd sizes, several steps),
leave the pre-step bytes in the undo places, and — stopped after any number of blocks —
be undone exactly by ``restore`` from its tags.
"""
import pytest
import torch

pytestmark = pytest.mark.gpu


def _need():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("triton")


HP = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, amsgrad=False, maximize=False, foreach=None,
          capturable=False, differentiable=False, fused=None, decoupled_weight_decay=True)
CASES = {"adamw": {}, "adamw-nowd": {"weight_decay": 0.0}, "adam-l2": {"decoupled_weight_decay": False},
         "amsgrad": {"amsgrad": True}, "maximize": {"maximize": True},
         "beta1-small": {"betas": (0.3, 0.99)}, "adam-l2-amsgrad-maximize":
         {"decoupled_weight_decay": False, "amsgrad": True, "maximize": True}}
SIZES = [3 * 2048 + 40, 1000, 2048, 1, 70001]


def _torch_optimizer(params, hp):
    kw = {k: hp[k] for k in ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach")}
    cls = torch.optim.AdamW if hp["decoupled_weight_decay"] else torch.optim.Adam
    return cls(params, **kw)


def _slices(params, grads, states, undo):
    keys = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if "max_exp_avg_sq" in states[0] else [])
    return [([p, g] + [s[k] for k in keys], u) for p, g, s, u in zip(params, grads, states, undo)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_is_torch_bit_for_bit_and_saves_the_pre_step_bytes(dtype, case):
    _need()
    from gpu_anchor.train import fused_adam as fa
    dev = torch.device("cuda")
    hp = dict(HP, **CASES[case])
    key = fa.structure(hp, dtype)
    fma = fa.verify(key, hp, dev)
    print(f"{case} {dtype}: fma contraction {'on' if fma else 'off' if fma is False else 'no variant matched'}")
    assert fma is not None, "no kernel variant reproduces torch's update here"
    gen = torch.Generator().manual_seed(1)
    init = [(torch.randn(n, generator=gen) * 0.05).to(dtype).to(dev) for n in SIZES]
    ref = [x.clone().requires_grad_() for x in init]
    mine = [x.clone() for x in init]
    topt = _torch_optimizer(ref, hp)
    names = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if hp["amsgrad"] else [])
    states = [{k: torch.zeros_like(x) for k in names} for x in mine]
    nt = 1 + len(names)
    undo = [[torch.full_like(x, float("nan")) for _ in range(nt)] for x in mine]
    nblocks = sum(fa.blocks(n) for n in SIZES)
    tags = torch.full((nblocks,), -1, dtype=torch.int64, device=dev)
    bases = [sum(fa.blocks(n) for n in SIZES[:k]) for k in range(len(SIZES))]
    for step in range(5):
        grads = [(torch.randn(n, generator=gen) * 1e-2).to(dtype).to(dev) for n in SIZES]
        for r, g in zip(ref, grads):
            r.grad = g.clone()
        topt.step()
        before = [[x.clone()] + [s[k].clone() for k in names] for x, s in zip(mine, states)]
        rows, blks, nb = fa.table(_slices(mine, grads, states, undo), bases, dev)
        fa.launch(rows, blks, nb, tags, 1000 + step, key, fma, fa.scalars(hp, step))
        for k, (r, x, s) in enumerate(zip(ref, mine, states)):
            assert fa._same_bits(r.detach(), x), (step, k, "param")
            for name in names:
                assert fa._same_bits(topt.state[r][name], s[name]), (step, k, name)
            for b, u in zip(before[k], undo[k]):
                assert fa._same_bits(b, u), (step, k, "undo")
        assert bool((tags == 1000 + step).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("stop_after", [0, 1, 3, 40])
def test_stopped_after_some_blocks_restore_gives_the_pre_step_state(dtype, stop_after):
    """A kill inside the kernel leaves some blocks saved + tagged (maybe written) and the
    rest untouched: ``restore`` must give back exactly the pre-step chunk."""
    _need()
    from gpu_anchor.train import fused_adam as fa
    dev = torch.device("cuda")
    hp = dict(HP, amsgrad=True)
    key = fa.structure(hp, dtype)
    fma = fa.verify(key, hp, dev)
    assert fma is not None
    gen = torch.Generator().manual_seed(2)
    params = [(torch.randn(n, generator=gen)).to(dtype).to(dev) for n in SIZES]
    grads = [(torch.randn(n, generator=gen)).to(dtype).to(dev) for n in SIZES]
    states = [{k: (torch.randn(x.numel(), generator=gen).abs()).to(dtype).to(dev)
               for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")} for x in params]
    slot = [[torch.randn(x.numel(), generator=gen).to(dtype).to(dev) for _ in range(4)] for x in params]  # stale
    slices = _slices(params, grads, states, slot)
    pre = [[t.clone() for t in [x] + list(s.values())] for x, s in zip(params, states)]
    tags = torch.full((2, sum(fa.blocks(n) for n in SIZES)), 7, dtype=torch.int64, device=dev)   # other chunk's
    f = fa.FusedAdam([slices], tags)
    rows, blks, nb = f._table(0, tuple(range(len(SIZES))))
    fa.launch(rows, blks, min(stop_after, nb), tags[0], 99, key, fma, fa.scalars(hp, 3))
    if stop_after:                       # the blocks it reached: garbage over what they wrote
        for r, j, _ in blks[:stop_after].tolist():
            tensors = slices[r][0]
            for t in [tensors[0]] + tensors[2:]:
                t[j * fa.BLOCK:(j + 1) * fa.BLOCK].fill_(float("nan"))
    assert f.restore(0, 99) == min(stop_after, nb)
    for k, (x, s) in enumerate(zip(params, states)):
        for b, t in zip(pre[k], [x] + list(s.values())):
            assert fa._same_bits(b, t), k


def test_anchored_adamw_uses_the_fused_update_and_equals_plain_torch(cuda_daemon):
    _need()
    import gpu_anchor
    from gpu_anchor.train import AnchoredOptimizer, StepProtocolConfig, anchor_module
    from gpu_anchor.testing import campaign as C
    results = {}
    for fused in (True, False):
        client = gpu_anchor.connect("cuda:0", namespace=f"fused-{fused}")
        torch.manual_seed(0)
        ref = C.build_model(0, hidden=300).cuda().to(torch.bfloat16)
        model = C.build_model(0, hidden=300).cuda().to(torch.bfloat16)
        anchor_module(model, client)
        ropt = C.build_optimizer(ref, C.CampaignConfig(optimizer="adamw"))
        opt = AnchoredOptimizer(C.build_optimizer(model, C.CampaignConfig(optimizer="adamw")), model=model,
                                client=client, config=StepProtocolConfig(chunk_bytes=1 << 18, fused_update=fused))
        assert opt.num_chunks >= 3
        for step in range(6):
            x, y = (t.cuda().to(torch.bfloat16) for t in C.batch(step, 0))
            for m, o in ((ref, ropt), (model, opt)):
                torch.manual_seed(step)
                torch.nn.functional.mse_loss(m(x), y).backward()
                o.step()
                o.zero_grad()
        opt.flush()
        for (n, a), b in zip(ref.named_parameters(), model.parameters()):
            assert torch.equal(a, b), (fused, n)
            for k in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(ropt.state[a][k], opt.optimizer.state[b][k]), (fused, n, k)
        results[fused] = (opt.fused_reason, dict(opt.stats))
        client.drop_namespace()
    reason, stats = results[True]
    assert reason is None and stats["fused_steps"] == 6 and stats["copy_steps"] == 0, results
    assert results[False][0].startswith("off") and results[False][1]["fused_steps"] == 0
