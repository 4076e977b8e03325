"""The LoRA terms of a group of projections (``lora_slots.Adapters.add``) against a per-token reference:
the torch path (CPU, unpacked outputs, widths no kernel block divides) and ``lora_kernels``'
launch (interpreted by Triton on the CPU when it is installed; natively on a GPU)."""
import os
import subprocess
import sys

import pytest

from test_serve_attention import INTERP

CASE = '''
import torch
from gpu_anchor.serve import lora as L
from gpu_anchor.serve import lora_slots as LS


def case(device, dtype, seed, tokens=9, capacity=3, rank=4, K=48, widths=(("q_proj", 32), ("k_proj", 16),
         ("v_proj", 16)), group="qkv", targeted=("q_proj", "v_proj"), loaded=(0, 2), packed=True):
    """The largest error of ``add`` against per-token float64 maths, relative to the terms' size;
    asserts which path ran (kernels: packed outputs, widths a block divides, decode-sized)."""
    g = torch.Generator().manual_seed(seed)
    model = {(0, p): (K, o) for p, o in widths}
    ads = {}
    for i, slot in enumerate(loaded):
        r = rank - i % 2                     # one adapter below the slots' rank (padded)
        ads[slot] = L.Adapter(f"a{slot}", "/x", r, {(0, p): (torch.randn(r, K, generator=g),
                                                            torch.randn(o, r, generator=g) / 4)
                                                   for p, o in widths if p in targeted})
    ad = LS.Adapters({k: v for k, v in model.items() if k[1] in targeted}, capacity, rank, dtype, device, None, model)
    for slot, a in ads.items():
        ad.put(a, slot)
    x = torch.randn(tokens, K, generator=g).to(dtype)
    slots = torch.randint(-1, capacity, (tokens,), generator=g)
    slots[0], slots[-1] = -1, loaded[0]
    ys = torch.randn(tokens, sum(o for _, o in widths), generator=g).to(dtype)
    want = ys.double().clone()
    col = 0
    for p, o in widths:
        for t in range(tokens):
            a = ads.get(int(slots[t]))
            if a is not None and (0, p) in a.tensors:
                A, B = (m.to(dtype).double() for m in a.tensors[(0, p)])
                want[t, col:col + o] += (x[t].double() @ A.T).to(dtype).double() @ B.T
        col += o
    y = ys.clone().to(device)
    outs = list(y.split([o for _, o in widths], dim=1)) if packed else [t.contiguous() for t in y.split([o for _, o in widths], dim=1)]
    ad.add(outs, x.to(device), 0, group, ad.masks(slots.to(device), dtype))
    got = torch.cat([o.double().cpu() for o in outs], dim=1)
    terms = (want - ys.double()).abs().max().item()
    assert terms > 0
    untouched = slots < 0
    assert torch.equal(got[untouched], ys.double()[untouched])       # no adapter: not one bit changes
    return (got - want).abs().max().item() / terms
'''


def test_torch_path_equals_per_token_maths():
    import torch
    ns = {}
    exec(CASE, ns)
    for seed in range(3):
        assert ns["case"]("cpu", torch.float32, seed) < 1e-5
        assert ns["case"]("cpu", torch.float32, seed, packed=False) < 1e-5
    # one member, every slot loaded, a width no kernel block divides
    assert ns["case"]("cpu", torch.float32, 3, widths=(("down_proj", 24),), group="down", targeted=("down_proj",),
                      loaded=(0, 1, 2)) < 1e-5
    assert ns["case"]("cpu", torch.float64, 4, widths=(("gate_proj", 32), ("up_proj", 32)), group="gate_up",
                      targeted=("gate_proj", "up_proj")) < 1e-12


def test_kernels_equal_per_token_maths_interpreted():
    pytest.importorskip("triton", reason="triton is not installed on this CPU machine; the GPU test runs the kernels")
    code = INTERP + CASE + '''
from gpu_anchor.serve import lora_kernels as LK
LK.available = lambda device, dtype: True
calls, real = [], LK.expand_
LK.expand_ = lambda *a: (calls.append(1), real(*a))[1]
errs = [case("cpu", torch.float32, s) for s in range(2)]
errs.append(case("cpu", torch.float32, 2, widths=(("gate_proj", 32), ("up_proj", 32)), group="gate_up",
                 targeted=("gate_proj", "up_proj"), loaded=(1,)))
errs.append(case("cpu", torch.float32, 3, tokens=1, widths=(("o_proj", 16),), group="o", targeted=("o_proj",)))
assert len(calls) == 4, calls
print(max(errs))
'''
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, TRITON_INTERPRET="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert float(r.stdout.strip().splitlines()[-1]) < 1e-5


@pytest.mark.gpu
def test_kernels_equal_per_token_maths_on_gpu():
    import torch
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from gpu_anchor.serve import lora_kernels as LK
    ns = {}
    exec(CASE, ns)
    calls = []
    real = LK.expand_
    LK.expand_ = lambda *a: (calls.append(1), real(*a))[1]
    try:
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
            for seed in range(3):
                assert ns["case"]("cuda", dtype, seed, tokens=64, capacity=4, rank=16, K=256,
                                  widths=(("q_proj", 256), ("k_proj", 64), ("v_proj", 64))) < tol
            assert ns["case"]("cuda", dtype, 5, tokens=200, capacity=2, rank=8, K=128,
                              widths=(("gate_proj", 96), ("up_proj", 96)), group="gate_up",
                              targeted=("gate_proj", "up_proj"), loaded=(1,)) < tol
        kernel_calls = len(calls)
        assert kernel_calls == 8
        # unpacked outputs and a width no block divides take the cuBLAS path
        assert ns["case"]("cuda", torch.float32, 7, packed=False) < 1e-5
        assert ns["case"]("cuda", torch.float32, 8, widths=(("down_proj", 24),), group="down",
                          targeted=("down_proj",), loaded=(0, 1, 2)) < 1e-5
        assert len(calls) == kernel_calls
    finally:
        LK.expand_ = real
