"""LR schedulers with ``AnchoredOptimizer``, the way training loops build them (transformers'
``get_scheduler`` and torch's own), and every way a loop can leave one outside the step's
commit refused before it does harm (``gpu_anchor/train/schedulers.py``)."""
import os
import sys
import textwrap

import pytest
import torch

import gpu_anchor
import preloaded
from gpu_anchor.train import AnchoredOptimizer

transformers = pytest.importorskip("transformers", reason="the test extra installs transformers")

STEPS = 12


def _model(namespace: str):
    with gpu_anchor.managed_scope(namespace=namespace, require=True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    return model


def _loss(model, step: int):
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
    return model(x).square().mean()


def _digest(model) -> list:
    return [p.detach().clone() for p in model.parameters()]


def test_a_given_scheduler_the_loop_also_steps_is_refused_before_the_step(host_daemon):
    model = _model("sched-twice")
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = transformers.get_linear_schedule_with_warmup(inner, 3, STEPS)
    opt = AnchoredOptimizer(inner, model=model, schedulers=[sched])
    _loss(model, 0).backward()
    opt.step()
    sched.step()                    # the habit: the loop steps its scheduler too
    opt.zero_grad()
    _loss(model, 1).backward()
    before, lr = _digest(model), inner.param_groups[0]["lr"]
    with pytest.raises(RuntimeError, match=r"schedulers\[0\] \(LambdaLR\) was stepped outside"):
        opt.step()
    assert opt.completed_steps == 1 and not opt._state.in_flight
    assert all(torch.equal(a, b) for a, b in zip(before, _digest(model)))
    assert inner.param_groups[0]["lr"] == lr


def test_a_scheduler_built_on_the_wrapped_optimizer_and_not_given_is_refused(host_daemon):
    model = _model("sched-stray")
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt = AnchoredOptimizer(inner, model=model)
    sched = transformers.get_scheduler("cosine", inner, num_warmup_steps=2, num_training_steps=STEPS)
    _loss(model, 0).backward()
    before = _digest(model)
    with pytest.raises(RuntimeError, match=r"LR scheduler \(LambdaLR\) is built on the optimizer .* not given"):
        opt.step()
    assert opt.completed_steps == 0
    assert all(torch.equal(a, b) for a, b in zip(before, _digest(model)))
    del sched


def test_a_scheduler_built_and_dropped_is_not_counted(host_daemon):
    model = _model("sched-dropped")
    inner = torch.optim.SGD(model.parameters(), lr=1e-2)
    torch.optim.lr_scheduler.StepLR(inner, step_size=5)      # built, never kept
    opt = AnchoredOptimizer(inner, model=model)
    for step in range(3):
        _loss(model, step).backward()
        opt.step()
        opt.zero_grad()
    assert opt.completed_steps == 3


def test_schedulers_that_cannot_commit_with_the_step_are_refused_at_construction(host_daemon):
    model = _model("sched-bad")
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pytest.raises(ValueError, match="ReduceLROnPlateau"):
        AnchoredOptimizer(inner, model=model, schedulers=[torch.optim.lr_scheduler.ReduceLROnPlateau(inner)])
    other = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-2)
    with pytest.raises(ValueError, match="built on another optimizer"):
        AnchoredOptimizer(inner, model=model, schedulers=[torch.optim.lr_scheduler.StepLR(other, 2)])
    with pytest.raises(TypeError, match="not an LR scheduler"):
        AnchoredOptimizer(inner, model=model, schedulers=[0.5])


def test_a_sequential_schedule_steps_inside_and_a_child_stepped_by_the_loop_is_refused(host_daemon):
    """``SequentialLR``'s children are built on the optimizer too: they are its, not strays;
    stepping one of them by hand moves the given scheduler's position."""
    model = _model("sched-seq")
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    warm = torch.optim.lr_scheduler.LinearLR(inner, start_factor=0.1, total_iters=3)
    decay = torch.optim.lr_scheduler.ExponentialLR(inner, gamma=0.9)
    seq = torch.optim.lr_scheduler.SequentialLR(inner, [warm, decay], milestones=[3])
    ref_inner = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    ref = torch.optim.lr_scheduler.SequentialLR(
        ref_inner, [torch.optim.lr_scheduler.LinearLR(ref_inner, start_factor=0.1, total_iters=3),
                    torch.optim.lr_scheduler.ExponentialLR(ref_inner, gamma=0.9)], milestones=[3])
    opt = AnchoredOptimizer(inner, model=model, schedulers=[seq])
    for step in range(6):
        _loss(model, step).backward()
        opt.step()
        ref_inner.step()
        ref.step()
        opt.zero_grad()
        assert inner.param_groups[0]["lr"] == ref_inner.param_groups[0]["lr"]
    decay.step()
    _loss(model, 6).backward()
    with pytest.raises(RuntimeError, match="SequentialLR"):
        opt.step()


def test_a_checkpoint_load_commits_the_schedulers_loaded_before_it(host_daemon):
    """A torch optimizer's ``state_dict`` (no schedulers in it): load the scheduler, then the
    optimizer (whose load commits both): the next step runs and a restarted worker gets the
    loaded schedule.  The other order is refused at the next step.  Our own ``state_dict``
    carries the schedulers' state, so its load sets them whatever was loaded before."""
    model = _model("sched-load")
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = transformers.get_linear_schedule_with_warmup(inner, 3, STEPS)
    opt = AnchoredOptimizer(inner, model=model, schedulers=[sched])
    ref_inner = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-2)
    ref = transformers.get_linear_schedule_with_warmup(ref_inner, 3, STEPS)
    for _ in range(5):
        ref_inner.step()
        ref.step()
    ours = opt.state_dict()
    assert ours["param_groups"][0]["gpu_anchor"] == {"completed_steps": 0, "schedulers": [sched.state_dict()]}
    saved_sched = ref.state_dict()
    saved_opt = {**ours, "param_groups": [{k: v for k, v in g.items() if k != "gpu_anchor"} for g in ours["param_groups"]]}

    sched.load_state_dict(saved_sched)
    opt.load_state_dict(saved_opt)
    _loss(model, 0).backward()
    opt.step()
    opt.zero_grad()
    assert sched.last_epoch == 6

    opt.load_state_dict(saved_opt)
    sched.load_state_dict(saved_sched)      # after the optimizer's load: never committed
    _loss(model, 1).backward()
    with pytest.raises(RuntimeError, match="was stepped outside"):
        opt.step()

    opt.load_state_dict(ours)                  # ours: the schedule it was saved with, committed
    assert sched.last_epoch == 0
    opt.step()
    assert sched.last_epoch == 1


JOB = textwrap.dedent("""
    import sys, torch, gpu_anchor, transformers
    from gpu_anchor.train import AnchoredOptimizer
    with gpu_anchor.managed_scope(namespace=sys.argv[1], require=True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = transformers.get_scheduler("cosine", inner, num_warmup_steps=3, num_training_steps=%(steps)d)
        opt = AnchoredOptimizer(inner, model=model, schedulers=[sched])
    for step in range(opt.completed_steps, %(steps)d):
        print("lr", step, repr(inner.param_groups[0]["lr"]), flush=True)     # the rate this step uses
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    print("digest", [p.detach().double().sum().item() for p in model.parameters()], flush=True)
""") % {"steps": STEPS}


@pytest.mark.parametrize("fault", ["between_steps@2", "before_boundary@5", "mid_chunk@7:0", "after_commit@9:0"])
def test_killed_the_schedule_resumes_where_the_fault_free_run_is(host_daemon, tmp_path, fault):
    """A transformers cosine schedule given to the optimizer, the job SIGKILLed and rerun: the same
    learning rate at every step and the same parameters as a run never killed."""
    script = tmp_path / "job.py"
    script.write_text(JOB)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}

    def run(ns, fault=None):
        e = {**env, "GPU_ANCHOR_TRAIN_FAULT": fault} if fault else env
        return preloaded.run([sys.executable, str(script), ns], env=e, timeout=300, preload=preloaded.HF)

    clean = run("sched-clean")
    assert clean.returncode == 0, clean.stderr
    killed = run("sched-killed", fault)
    assert killed.returncode == -9, killed.stderr
    again = run("sched-killed")
    assert again.returncode == 0, again.stderr
    lrs = lambda out: dict(l.split()[1:] for l in out.splitlines() if l.startswith("lr "))
    merged = {**lrs(killed.stdout), **lrs(again.stdout)}
    assert merged == lrs(clean.stdout) and len(merged) == STEPS
    digest = lambda out: [l for l in out.splitlines() if l.startswith("digest")]
    assert digest(again.stdout) == digest(clean.stdout)


def test_a_plain_trainer_handed_the_optimizer_and_its_scheduler_is_told_to_use_anchored_trainer(host_daemon, tmp_path):
    """``Trainer(optimizers=(anchored, scheduler))`` steps the scheduler itself after each step:
    before, silently twice a step (and no resume); now its second step is refused, naming the fix."""
    from transformers import Trainer, TrainingArguments
    model = _model("sched-trainer")
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = transformers.get_linear_schedule_with_warmup(inner, 2, STEPS)
    opt = AnchoredOptimizer(inner, model=model, schedulers=[sched])

    class Regression(torch.nn.Module):
        def __init__(self, net):
            super().__init__()
            self.net = net

        def forward(self, x):
            return {"loss": self.net(x).square().mean()}

    data = [{"x": torch.randn(8, generator=torch.Generator().manual_seed(i))} for i in range(16)]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4, report_to=[],
                             save_strategy="no", use_cpu=True, disable_tqdm=True)
    trainer = Trainer(model=Regression(model), args=args, train_dataset=data, optimizers=(opt, sched))
    with pytest.raises(RuntimeError, match="use gpu_anchor.train.AnchoredTrainer"):
        trainer.train()
    assert opt.completed_steps == 1
