"""The CUDA backend on a real GPU: VMM memory outlives SIGKILLed workers and comes back mapped."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.gpu

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUMEL = 1 << 24  # 64 MiB of int32 per tensor

WRITER = f"""
import sys, torch, gpu_anchor
c = gpu_anchor.connect("cuda:0", namespace="gpukill")
ts = [b.tensor for b in c.bind([(f"state[{{k}}]", ({NUMEL},), torch.int32) for k in range(4)])]
i = int(c.journal.get("written", b"0")) + 1
print("ready", flush=True)
pause = sys.argv[1] == "pause"
while True:
    for t in ts:
        for j in range(0, {NUMEL}, 1 << 20):
            t[j:j + (1 << 20)].fill_(i)
    torch.cuda.synchronize()
    c.journal.put("written", str(i).encode())
    if pause:
        print("written", i, flush=True)
        sys.stdin.readline()
    i += 1
"""


def _worker(mode: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=REPO)
    p = subprocess.Popen([sys.executable, "-c", WRITER, mode], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True, env=env)
    assert p.stdout.readline().strip() == "ready"
    return p


def _observe():
    import torch

    import gpu_anchor
    c = gpu_anchor.connect("cuda:0", namespace="gpukill")
    ts = [b.tensor for b in c.bind([(f"state[{k}]", (NUMEL,), torch.int32) for k in range(4)], "lookup")]
    return c, ts


def test_cuda_memory_survives_sigkill_between_and_mid_write(cuda_daemon):
    import torch
    p = _worker("pause")
    line = p.stdout.readline().split()
    assert line[0] == "written"
    p.send_signal(signal.SIGKILL)
    p.wait()
    c, ts = _observe()
    w = int(c.journal.get("written"))
    assert w == int(line[1]) and all(bool((t == w).all()) for t in ts)
    del ts

    rng = random.Random(3)
    for _ in range(5):
        p = _worker("run")
        time.sleep(rng.uniform(0.05, 0.4))
        p.kill()
        p.wait()
        c, ts = _observe()
        w = int(c.journal.get("written"))
        vals = set(torch.cat(ts).unique().tolist())
        assert vals <= {w, w + 1}, (w, vals)
        del ts
    assert c.status()["object_bytes"] == 4 * NUMEL * 4


def test_daemon_holds_no_cuda_context(cuda_daemon):
    pynvml = pytest.importorskip("pynvml")
    _, proc = cuda_daemon
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    assert proc.pid not in [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)]


def test_mapped_tensor_computes_like_native(cuda_daemon):
    import torch

    import gpu_anchor
    c = gpu_anchor.connect("cuda:0", namespace="gpumath")
    a = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    m = c.tensor("a", (1024, 1024), torch.bfloat16)
    m.copy_(a)
    assert torch.equal(m @ m, a @ a)
    with pytest.raises(gpu_anchor.ConflictError):
        c.tensor("a", (1024, 512), torch.bfloat16)
