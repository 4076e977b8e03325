"""An anchored job's checkpoints in torch's formats (``gpu_anchor/train/state_dict.py``): through
``torch.distributed.checkpoint``'s helpers as PyTorch's DCP tutorial writes it (``get_state_dict``
/ ``set_state_dict`` inside a ``Stateful``), flattened as torchtitan saves or not; through the
wrapped optimizer's own ``state_dict`` / ``load_state_dict``; into a plain PyTorch job leaving
gpu-anchor, and from one moving in.  Two FSDP2 ranks: ``test_train_fsdp``; ``torch.save`` into a
fresh daemon and kills around a load: ``test_train_optimizer``, ``test_train_accelerate``."""
from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict, get_state_dict,
                                                     set_optimizer_state_dict, set_state_dict)
from torch.distributed.checkpoint.stateful import Stateful

import gpu_anchor
from gpu_anchor.testing import campaign as C
from gpu_anchor.train import AnchoredOptimizer, anchor_module

CFG = C.CampaignConfig(optimizer="adamw", flavour="single")


class AppState(Stateful):
    """The DCP tutorial's wrapper: what ``dcp.save`` / ``dcp.load`` call."""

    def __init__(self, model, optimizer, flatten: bool) -> None:
        self.model, self.optimizer = model, optimizer
        self.options = StateDictOptions(flatten_optimizer_state_dict=flatten)

    def state_dict(self):
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self.options)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict):
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"], options=self.options)


def _anchored(ns):
    client = gpu_anchor.connect("cpu", namespace=ns)
    model = C.build_model(CFG.seed)
    anchor_module(model, client)
    inner = C.build_optimizer(model, CFG)
    sched = torch.optim.lr_scheduler.LambdaLR(inner, C.warmup)
    return model, AnchoredOptimizer(inner, model=model, client=client, chunk_bytes=4096, schedulers=[sched])


def _plain():
    model = C.build_model(CFG.seed)
    opt = C.build_optimizer(model, CFG)
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, C.warmup)


def _train(model, opt, steps, sched=None):
    for step in steps:
        x, y = C.batch(step, CFG.seed)
        torch.manual_seed(step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad()


def _same(model, opt, ref, ropt):
    refs = dict(ref.named_parameters())
    assert all(torch.equal(a, refs[name]) for name, a in model.named_parameters())
    for q in opt._params:
        assert all(torch.equal(t, ropt.state[refs[q.name]][k]) for k, t in q.states.items()), q.name


@pytest.mark.parametrize("flatten", [False, True], ids=["nested", "flattened"])
def test_dcp_tutorial_state_dict_helpers_restore_the_job_in_a_fresh_daemon(host_daemon, tmp_path, flatten):
    """``dcp.save({"app": AppState(model, opt)})`` after 3 steps; the daemon's state lost (a fresh
    namespace), ``dcp.load`` into a new model and optimizer: the step count, the schedule, every
    tensor come back, and steps 4-5 are plain PyTorch's, bit for bit.  Before, ``get_state_dict``
    failed (``'AnchoredOptimizer' object is not iterable``), and its result would have lost the
    step count and the schedule (DCP keeps ``state`` and ``param_groups`` only)."""
    ref, ropt, rsched = _plain()
    model, opt = _anchored(f"dcp-a-{flatten}")
    _train(ref, ropt, range(3), rsched)
    _train(model, opt, range(3))
    dcp.save({"app": AppState(model, opt, flatten)}, checkpoint_id=str(tmp_path / "ckpt"))

    model2, opt2 = _anchored(f"dcp-b-{flatten}")
    assert opt2.completed_steps == 0
    dcp.load({"app": AppState(model2, opt2, flatten)}, checkpoint_id=str(tmp_path / "ckpt"))
    assert opt2.completed_steps == 3 and opt2.schedulers.items[0].last_epoch == 3
    assert opt2.param_groups[0]["lr"] == ropt.param_groups[0]["lr"]
    _train(ref, ropt, range(3, 5), rsched)
    _train(model2, opt2, range(3, 5))
    _same(model2, opt2, ref, ropt)
    assert opt2.completed_steps == 5


def test_the_wrapped_optimizers_own_state_dict_and_load_are_ours(host_daemon):
    """Code holding ``opt.optimizer`` (DCP's helpers handed it, a framework's reference) saves and
    loads the anchored state: before, its ``load_state_dict`` replaced torch's state with fresh
    tensors beside the anchored ones and the next step used the old ones, silently.  ``opt.state``
    reads like a torch optimizer's (``step`` included)."""
    ref, ropt, rsched = _plain()
    model, opt = _anchored("inner-a")
    _train(ref, ropt, range(3), rsched)
    _train(model, opt, range(3))
    saved = opt.optimizer.state_dict()
    assert saved["param_groups"][0]["gpu_anchor"]["completed_steps"] == 3
    mine = opt.state_dict()
    for pid, st in mine["state"].items():
        assert st.keys() == saved["state"][pid].keys() and all(torch.equal(v, saved["state"][pid][k]) for k, v in st.items())
    p0 = next(iter(opt.state))
    assert float(opt.state[p0]["step"]) == 3 and opt.state[p0]["exp_avg"] is opt._params[0].states["exp_avg"]

    model2, opt2 = _anchored("inner-b")
    model2.load_state_dict(model.state_dict())
    opt2.optimizer.load_state_dict(saved)
    assert opt2.completed_steps == 3
    assert all(opt2.optimizer.state[q.p] is q.states for q in opt2._params)     # still the anchored tensors
    _train(ref, ropt, range(3, 5), rsched)
    _train(model2, opt2, range(3, 5))
    _same(model2, opt2, ref, ropt)


def test_a_plain_jobs_flattened_dcp_checkpoint_and_a_lossy_load_refused(host_daemon, tmp_path):
    """A job moving to gpu-anchor from plain PyTorch's flattened DCP checkpoint, which has no entry
    of ours: with the schedule loaded first and ``allow_partial_load`` (DCP's option for a template
    with keys the checkpoint lacks, ours here), tensors and step counts load, ``completed_steps``
    is the template's (0), and it continues as plain PyTorch does.  DCP's flattened load handed the
    wrapped optimizer (whose live state names no ``step``) would restart Adam's bias correction:
    refused by name, nothing changed."""
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    ref, ropt, rsched = _plain()
    _train(ref, ropt, range(3), rsched)
    dcp.save({"optim": get_optimizer_state_dict(ref, ropt, options=flat)}, checkpoint_id=str(tmp_path / "plain"))

    model, opt = _anchored("moving-in")
    model.load_state_dict(ref.state_dict())
    opt.schedulers.items[0].load_state_dict(rsched.state_dict())     # before the template: it carries the schedule
    sd = {"optim": get_optimizer_state_dict(model, opt, options=flat)}
    with pytest.raises(BaseException, match="Missing key in checkpoint state_dict: optim.param_groups.*gpu_anchor"):
        dcp.load(sd, checkpoint_id=str(tmp_path / "plain"))
    dcp.load(sd, checkpoint_id=str(tmp_path / "plain"), planner=DefaultLoadPlanner(allow_partial_load=True))
    before = [t.clone() for q in opt._params for t in q.states.values()]
    with pytest.raises(ValueError, match=r"no 'step'.*hand it the AnchoredOptimizer.*nothing was loaded"):
        set_optimizer_state_dict(model, opt.optimizer, sd["optim"], options=flat)
    assert opt.completed_steps == 0
    assert all(torch.equal(a, t) for a, t in zip(before, (t for q in opt._params for t in q.states.values())))

    set_optimizer_state_dict(model, opt, sd["optim"], options=flat)
    assert opt.completed_steps == 0 and opt.schedulers.items[0].last_epoch == 3
    _train(ref, ropt, range(3, 5), rsched)
    _train(model, opt, range(3, 5))
    _same(model, opt, ref, ropt)


def test_a_job_leaving_gpu_anchor_resumes_from_its_checkpoint_in_plain_pytorch(host_daemon, tmp_path):
    """``torch.save(opt.state_dict())`` of the anchored job, loaded by plain AdamW and its
    scheduler (whose state is in our entry), the entry then deleted from the plain optimizer's
    group: plain PyTorch continues where it stopped, bit for bit with the run that never used
    gpu-anchor."""
    ref, ropt, rsched = _plain()
    model, opt = _anchored("leaving")
    _train(ref, ropt, range(3), rsched)
    _train(model, opt, range(3))
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, tmp_path / "ckpt.pt")

    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    plain, popt, psched = _plain()
    plain.load_state_dict(ckpt["model"])
    popt.load_state_dict(ckpt["optim"])
    psched.load_state_dict(ckpt["optim"]["param_groups"][0]["gpu_anchor"]["schedulers"][0])
    assert ckpt["optim"]["param_groups"][0]["gpu_anchor"]["completed_steps"] == 3
    del popt.param_groups[0]["gpu_anchor"]          # as docs/training.md says: its checkpoints do not carry it
    assert "gpu_anchor" not in popt.state_dict()["param_groups"][0]
    _train(ref, ropt, range(3, 5), rsched)
    _train(plain, popt, range(3, 5), psched)
    refs = dict(ref.named_parameters())
    assert all(torch.equal(p, refs[name]) for name, p in plain.named_parameters())
    assert all(torch.equal(popt.state[p][k], ropt.state[refs[name]][k]) for name, p in plain.named_parameters()
               for k in ("exp_avg", "exp_avg_sq", "step"))


def test_dcp_async_save_while_the_job_trains_on(host_daemon, tmp_path):
    """``dcp.async_save`` of the tutorial's ``AppState`` after step 3, two more steps while it
    writes: the checkpoint is step 3's (staged when it was called), and restored into a fresh
    namespace it continues as plain PyTorch does from step 3."""
    ref, ropt, rsched = _plain()
    model, opt = _anchored("async-a")
    _train(ref, ropt, range(3), rsched)
    _train(model, opt, range(3))
    pending = dcp.async_save({"app": AppState(model, opt, False)}, checkpoint_id=str(tmp_path / "ckpt"))
    _train(model, opt, range(3, 5))
    pending.result()

    model2, opt2 = _anchored("async-b")
    dcp.load({"app": AppState(model2, opt2, False)}, checkpoint_id=str(tmp_path / "ckpt"))
    assert opt2.completed_steps == 3
    _train(ref, ropt, range(3, 5), rsched)
    _train(model2, opt2, range(3, 5))
    _same(model2, opt2, ref, ropt)
    _same(model, opt, ref, ropt)
