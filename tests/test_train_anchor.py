"""anchor_module: match-or-create for a module's parameters and buffers; the example resumes."""
import os
import sys

import pytest
import torch

import gpu_anchor
import preloaded
from gpu_anchor.train import anchor_module

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight
        self.norm = torch.nn.BatchNorm1d(4)


def test_created_then_matched_keeps_the_daemon_data(host_daemon):
    client = gpu_anchor.connect("cpu", namespace="am")
    torch.manual_seed(0)
    m1 = Tied()
    st = anchor_module(m1, client)
    assert set(st.values()) == {"created"} and "head.weight" not in st      # tied: anchored once
    assert m1.head.weight is m1.emb.weight
    with torch.no_grad():
        m1.emb.weight.add_(1.0)
        m1.norm.running_mean.fill_(3.0)
    torch.manual_seed(1)                        # a different init must not win over the daemon's data
    m2 = Tied()
    st2 = anchor_module(m2, client)
    assert set(st2.values()) == {"matched"}
    assert torch.equal(m2.emb.weight, m1.emb.weight) and m2.head.weight is m2.emb.weight
    assert torch.equal(m2.norm.running_mean, torch.full((4,), 3.0))


def test_unfinished_first_init_is_redone(host_daemon):
    client = gpu_anchor.connect("cpu", namespace="am2")
    torch.manual_seed(0)
    ref = Tied()
    # a worker that bound the objects but died before copying its init in
    client.bind([(f"model.{n}", tuple(p.shape), p.dtype) for n, p in ref.named_parameters()])
    torch.manual_seed(0)
    m = Tied()
    st = anchor_module(m, client)
    assert set(st.values()) == {"created"}
    assert torch.equal(m.emb.weight, ref.emb.weight)
    assert client.journal.get("anchor/model/ready") == b"1"


def test_conflict_and_device_errors(host_daemon):
    client = gpu_anchor.connect("cpu", namespace="am3")
    keep = torch.nn.Linear(3, 4)          # alive: its anchored objects stay
    anchor_module(keep, client, prefix="net")
    with pytest.raises(gpu_anchor.ConflictError):
        anchor_module(torch.nn.Linear(3, 5), client, prefix="net")
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="lives on"):
            anchor_module(torch.nn.Linear(3, 4).cuda(), client, prefix="other")


def test_example_resumes_where_it_stopped(host_daemon):
    env = dict(os.environ, PYTHONPATH=ROOT)
    cmd = [sys.executable, os.path.join(ROOT, "examples", "train_tiny.py"), "--namespace", "ex"]
    first = preloaded.run(cmd + ["--steps", "30"], env=env, timeout=120)
    assert first.returncode == 0, first.stderr
    assert "resuming at step 0" in first.stdout and "done: 30 steps" in first.stdout
    second = preloaded.run(cmd + ["--steps", "45"], env=env, timeout=120)
    assert second.returncode == 0, second.stderr
    assert "parameters {'matched'}; resuming at step 30" in second.stdout and "done: 45 steps" in second.stdout
