"""Two AnchoredOptimizers in one namespace (a GAN's generator and discriminator): the errors
say what is really wrong (another optimizer's state, pass ``prefix=``), the fix works
across a SIGKILL, and the real "state is gone" case still says so."""
from __future__ import annotations

import multiprocessing as mp
import os
import signal

import pytest
import torch

import gpu_anchor
from gpu_anchor.train import AnchoredOptimizer, anchor_module

FORK = mp.get_context("fork")
STEPS = 3


def _model() -> torch.nn.ModuleDict:
    torch.manual_seed(0)
    return torch.nn.ModuleDict({"G": torch.nn.Linear(3, 4), "D": torch.nn.Linear(4, 1)})


def _optimizers(model, client=None, g_prefix="train.g", with_g=True):
    opt_d = AnchoredOptimizer(torch.optim.SGD(model["D"].parameters(), lr=0.1, momentum=0.9),
                              model=model, client=client)
    if not with_g:
        return opt_d, None
    opt_g = AnchoredOptimizer(torch.optim.AdamW(model["G"].parameters(), lr=0.01),
                              model=model, client=client, prefix=g_prefix)
    return opt_d, opt_g


def _train(model, opt_d, opt_g, start: int) -> None:
    for step in range(start, STEPS):
        x = torch.randn(8, 3, generator=torch.Generator().manual_seed(step))
        for opt in (opt_d, opt_g):
            if opt is None:
                continue
            model["D"](model["G"](x)).square().mean().backward()
            opt.step()
            opt.zero_grad()


def _train_then_die(ns: str, with_g: bool) -> None:
    client = gpu_anchor.connect("cpu", namespace=ns)
    model = _model()
    anchor_module(model, client)
    opt_d, opt_g = _optimizers(model, client, with_g=with_g)
    _train(model, opt_d, opt_g, 0)
    os.kill(os.getpid(), signal.SIGKILL)


def _run_and_kill(ns: str, with_g: bool = True) -> None:
    p = FORK.Process(target=_train_then_die, args=(ns, with_g))
    p.start()
    p.join(120)
    assert p.exitcode == -signal.SIGKILL


def test_second_optimizer_in_this_process_is_told_to_pass_prefix(host_daemon):
    client = gpu_anchor.connect("cpu", namespace="gan-live")
    model = _model()
    anchor_module(model, client)
    opt_d, _ = _optimizers(model, client, with_g=False)
    with pytest.raises(RuntimeError) as e:
        AnchoredOptimizer(torch.optim.AdamW(model["G"].parameters(), lr=0.01), model=model, client=client)
    msg = str(e.value)
    assert "another AnchoredOptimizer in this process" in msg and "prefix=" in msg, msg
    assert "SGD over 2 parameter(s) (D.weight float32[1, 4], D.bias float32[1])" in msg, msg
    assert "AdamW over 2 parameter(s) (G.weight float32[4, 3], G.bias float32[4])" in msg, msg
    assert "gone" not in msg and "checkpoint" not in msg, msg
    # nothing of the refused optimizer was anchored, and the first one still trains
    assert not [n for n in client.names() if n.startswith("train.") and ".G." in n]
    _train(model, opt_d, None, 0)
    assert opt_d.completed_steps == STEPS


def test_prefixed_pair_survives_sigkill_bit_identically(host_daemon):
    _run_and_kill("gan-pair")
    client = gpu_anchor.connect("cpu", namespace="gan-pair")
    model = _model()
    assert set(anchor_module(model, client).values()) == {"matched"}
    opt_d, opt_g = _optimizers(model, client)
    assert (opt_d.completed_steps, opt_g.completed_steps) == (STEPS, STEPS)
    ref = _model()   # the same job without gpu-anchor
    ref_d = torch.optim.SGD(ref["D"].parameters(), lr=0.1, momentum=0.9)
    ref_g = torch.optim.AdamW(ref["G"].parameters(), lr=0.01)
    for step in range(STEPS):
        x = torch.randn(8, 3, generator=torch.Generator().manual_seed(step))
        for opt in (ref_d, ref_g):
            ref["D"](ref["G"](x)).square().mean().backward()
            opt.step()
            opt.zero_grad()
    for (n, a), b in zip(ref.named_parameters(), model.parameters()):
        assert torch.equal(a, b), n


def test_second_optimizer_added_after_a_restart_names_the_journals_owner(host_daemon):
    _run_and_kill("gan-later", with_g=False)      # the first program had one optimizer
    client = gpu_anchor.connect("cpu", namespace="gan-later")
    model = _model()
    anchor_module(model, client)
    before = {n: client.lookup(n, i.shape, getattr(torch, i.dtype)).clone()
              for n, i in client.objects().items() if n.startswith("train.")}
    with pytest.raises(RuntimeError) as e:   # the new program builds the generator's optimizer first
        AnchoredOptimizer(torch.optim.AdamW(model["G"].parameters(), lr=0.01), model=model, client=client)
    msg = str(e.value)
    assert "namespace 'gan-later' holds another optimizer's state under prefix 'train'" in msg, msg
    assert "SGD over 2 parameter(s) (D.weight float32[1, 4], D.bias float32[1]), 3 step(s) committed" in msg, msg
    assert "prefix='train2'" in msg and "is gone" not in msg, msg
    after = {n: client.lookup(n, t.shape, t.dtype) for n, t in before.items()}
    assert all(torch.equal(before[n], after[n]) for n in before), "the refused optimizer touched the state"
    opt_d, opt_g = _optimizers(model, client)    # with prefix= both work, the first one resumes
    assert (opt_d.completed_steps, opt_g.completed_steps) == (STEPS, 0)


def test_state_really_gone_still_says_restore_from_a_checkpoint(host_daemon):
    _run_and_kill("gan-lost")
    client = gpu_anchor.connect("cpu", namespace="gan-lost")
    client.free(*[n for n in client.names() if n.startswith("train.state.")])
    model = _model()
    anchor_module(model, client)
    with pytest.raises(RuntimeError) as e:
        _optimizers(model, client, with_g=False)
    msg = str(e.value)
    assert "anchored optimizer state is gone" in msg and "restore from a checkpoint" in msg, msg
    assert "another" not in msg, msg
