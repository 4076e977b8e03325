"""The fused anchored Adam/AdamW update (``gpu_anchor.train.fused_adam``) against torch's own.

    PYTHONPATH=. python -m pytest -q -m gpu tests/test_train_fused_adam.py

GPU (skips without CUDA or Triton): the kernel must reproduce torch's AdamW / Adam step bit for
bit (bf16 and fp32, weight decay both ways, amsgrad, maximize, odd sizes, several steps) and
finish every block it was given (tags done).  GPU and, where Triton is installed, on the CPU
under Triton's interpreter: stopped at any block — each program's block there saved in its ring
slot, tagged started and half written, the rest untouched — ``restore`` gives back the pre-step
state of every block not done, the redo writes only those, and the result equals an
uninterrupted launch bit for bit, also when the redo itself is stopped and recovered.
"""
import os
import subprocess
import sys

import pytest
import torch



def _need():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("triton", reason="the fused Adam kernel is Triton; a CUDA machine without Triton cannot run it")


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


def _slices(params, grads, states):
    keys = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if "max_exp_avg_sq" in states[0] else [])
    return [[p, g] + [s[k] for k in keys] for p, g, s in zip(params, grads, states)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_is_torch_bit_for_bit_and_tags_every_block(dtype, case):
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
    ring = torch.full((6 * fa.RING_STRIDE,), 255, dtype=torch.uint8, device=dev)    # 3 programs' slots
    nblocks = sum(fa.blocks(n) for n in SIZES)
    tags = torch.full((nblocks,), -1, dtype=torch.int64, device=dev)
    bases = [sum(fa.blocks(n) for n in SIZES[:k]) for k in range(len(SIZES))]
    for step in range(5):
        grads = [(torch.randn(n, generator=gen) * 1e-2).to(dtype).to(dev) for n in SIZES]
        for r, g in zip(ref, grads):
            r.grad = g.clone()
        topt.step()
        rows, blks, nb = fa.table(_slices(mine, grads, states), bases, dev)
        fa.launch(rows, blks, nb, tags, ring, 1000 + step, key, fma, fa.scalars(hp, step), 3)
        for k, (r, x, s) in enumerate(zip(ref, mine, states)):
            assert fa._same_bits(r.detach(), x), (step, k, "param")
            for name in names:
                assert fa._same_bits(topt.state[r][name], s[name]), (step, k, name)
        seen = [fa.decode_tag(t) for t in tags.tolist()]
        assert {d[0] for d in seen} == {1000 + step}
        assert sum(d[2] == fa.FINISHED for d in seen) == 3      # each program's last block


RING_CASE = """
import torch
from gpu_anchor.train import fused_adam as fa

def ring_case(dev, dtype, amsgrad, stops):
    hp = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, amsgrad=amsgrad, maximize=False,
              foreach=None, capturable=False, differentiable=False, fused=None, decoupled_weight_decay=True)
    key, sc = fa.structure(hp, dtype), fa.scalars(hp, 3)
    sizes = [3 * fa.BLOCK + 40, 1000, fa.BLOCK, 1, 5 * fa.BLOCK + 7]
    nb = sum(fa.blocks(n) for n in sizes)

    def chunk():
        gen = torch.Generator().manual_seed(2)
        out = []
        for n in sizes:
            t = [torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-2,
                 torch.randn(n, generator=gen) * 1e-3, torch.randn(n, generator=gen).abs() * 1e-6]
            if amsgrad:
                t.append(t[3] * 1.5)
            out.append([x.to(dtype).to(dev) for x in t])
        return out

    def fused(slices, stale):
        # six ring slots (three programs, fewer than a launch may run), stale bytes in them and
        # another chunk's tags: nothing of either may leak into the result
        undo = [torch.randint(0, 255, (6 * fa.RING_STRIDE + 5,), dtype=torch.uint8).to(dev) for _ in range(2)]
        f = fa.FusedAdam([slices], torch.full((2, nb), stale, dtype=torch.int64, device=dev), undo)
        f._variant[key] = True
        return f

    groups = [(key, sc, list(range(len(sizes))))]
    ref = chunk()
    f = fused(ref, -1)
    f.apply(0, groups, 77)
    assert {fa.decode_tag(t)[0] for t in f.tags[0].tolist()} == {77}
    for stop in stops:
        mine = chunk()
        pre = [[x.clone() for x in t] for t in mine]
        g = fused(mine, 5)
        g.apply(0, groups, 77, stop=stop)                 # a kill inside the kernel
        seen = [fa.decode_tag(t) for t in g.tags[0].tolist()]
        assert all(d is not None and d[0] == 77 for d in seen[:stop + 3]), (stop, seen)
        assert g.restore(0, 77) == min(3, nb - stop)      # each program's block at or after stop
        after = g.tags[0].tolist()
        done = {j for j, t in enumerate(after) if t == 77}
        assert done == set(range(stop)), (stop, after)
        assert after[stop:stop + 3] == [-1] * min(3, nb - stop) and set(after[stop + 3:]) <= {5}
        for k, (t, p) in enumerate(zip(mine, pre)):       # every block not done: its pre-step bytes
            j0 = sum(fa.blocks(n) for n in sizes[:k])
            for j in range(fa.blocks(sizes[k])):
                if j0 + j not in done:
                    lo, hi = j * fa.BLOCK, (j + 1) * fa.BLOCK
                    for x, y in zip([t[0]] + t[2:], [p[0]] + p[2:]):
                        assert fa._same_bits(x[lo:hi], y[lo:hi]), (stop, k, j)
        g.apply(0, groups, 77, stop=stop + (nb - stop) // 2)   # the redo, killed in turn
        g.restore(0, 77)
        g.apply(0, groups, 77)
        assert {fa.decode_tag(t)[0] for t in g.tags[0].tolist()} == {77}
        for t, r in zip(mine, ref):
            for x, y in zip(t, r):
                assert fa._same_bits(x, y), stop
    return "ok"
"""
STOPS = [0, 1, 3, 8, 12, 13]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_stopped_at_any_block_restore_and_redo_give_the_uninterrupted_result(dtype, amsgrad):
    """A kill inside the kernel leaves each program's current block saved, tagged started and
    maybe half written, and the blocks after it untouched: ``restore`` + the redo of the blocks
    not done equal an uninterrupted launch."""
    _need()
    ns = {}
    exec(RING_CASE, ns)
    assert ns["ring_case"](torch.device("cuda"), dtype, amsgrad, STOPS) == "ok"


def test_stopped_at_any_block_under_the_interpreter():
    """The same on this CPU machine, the kernel run by Triton's interpreter."""
    pytest.importorskip("triton", reason="triton is not installed on this CPU machine; the kernel is "
                                         "tested natively by the GPU tests")
    from tests.test_serve_attention import INTERP
    code = INTERP + RING_CASE + "".join(
        f"\nprint(ring_case(torch.device('cpu'), {d}, {a}, {STOPS}))"
        for d in ("torch.bfloat16", "torch.float32") for a in (False, True))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900,
                       env=dict(os.environ, TRITON_INTERPRET="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["ok"] * 4


@pytest.mark.gpu
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
