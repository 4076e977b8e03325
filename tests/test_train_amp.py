"""GradScaler under the protocol: scale and growth tracker resume exactly after SIGKILL.

The campaign runs the tiny MLP under fp16 autocast with a scaler that starts at
2**22 (fp16 gradients overflow from about 2**20), backs off by 2**-4 and grows by 2**3
every 2 good steps, so the run mixes overflowing (skipped) and applied steps.
Every worker logs ``step loss scale``; a kill anywhere must give the
fault-free run's losses, scales and anchored state bit for bit, and the fault-free
anchored run must equal plain torch driven by ``GradScaler.step`` / ``update``.  With
clipping, the loop unscales first (``scaler.unscale_(opt)``, torch's recipe) and the step
takes that unscale's inf/NaN flag instead of unscaling again.
"""
import random

import pytest
import torch

import gpu_anchor
from gpu_anchor.testing import campaign as C

CFG = C.CampaignConfig(steps=10, amp=True)
CLIP = C.CampaignConfig(steps=10, amp=True, clip=0.05)


def _plain(cfg=CFG):
    """Plain PyTorch with the same scaler; ``{step: "loss scale"}`` in the campaign's log format."""
    import os
    import tempfile
    C.prewarm(cfg)
    model = C.build_model(cfg.seed)
    opt = C.build_optimizer(model, cfg)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, C.warmup)
    scaler = C.make_scaler()
    fd, path = tempfile.mkstemp()
    skipped = 0
    for step in range(cfg.steps):
        x, y = C.batch(step, cfg.seed)
        loss = C.forward_loss(model, x, y, amp=True)
        scaler.scale(loss).backward()
        C._log(fd, step, loss, scaler)
        before = scaler.get_scale()
        C.clip(model, opt, scaler, cfg.clip)
        scaler.step(opt)
        scaler.update()
        skipped += scaler.get_scale() < before
        sched.step()
        opt.zero_grad()
    os.close(fd)
    with open(path) as f:
        log = f.read()
    os.unlink(path)
    return C.trajectory(log)[0], skipped


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step")
def test_amp_reference_equals_plain_gradscaler(host_daemon, tmp_path):
    ref = C.run("amp-ref", CFG, str(tmp_path / "ref.log"))
    losses = C.trajectory(ref.log)[0]
    plain, skipped = _plain()
    assert losses == plain
    assert 0 < skipped < CFG.steps - 2            # both kinds of step happen
    assert len({v.split()[1] for v in losses.values()}) >= 3    # the scale moves both ways


def test_amp_kills_at_phases_and_random(host_daemon, tmp_path):
    ref = C.run("amp-ref", CFG, str(tmp_path / "ref.log"))
    ref_losses, ref_done = C.trajectory(ref.log)
    ref_client = gpu_anchor.connect("cpu", namespace="amp-ref")
    specs = ["before_boundary@1", "mid_chunk@2:1", "after_update@3:0", "after_commit@4:0", "between_steps@5",
             "before_update@7:1"]
    # Random kills land only while a worker still has steps to run, so how many land in a run
    # depends on the machine's speed: run until 20 have landed (the cap keeps a test whose kills
    # never land from running forever; it then fails below).
    runs = [("amp-phase", dict(faults_seq=specs))]
    runs += [(f"amp-rand{i}", dict(random_kills=6, max_delay_s=ref.wall_s * 0.8, rng=random.Random(i)))
             for i in range(120)]
    kills = 0
    for ns, kw in runs:
        if kills >= len(specs) + 20:
            break
        res = C.run(ns, CFG, str(tmp_path / f"{ns}.log"), **kw)
        kills += res.kills
        losses, done = C.trajectory(res.log)
        assert losses == ref_losses, ns
        assert done == ref_done, ns
        assert C.compare(ref_client, gpu_anchor.connect("cpu", namespace=ns)) == [], ns
    assert kills >= len(specs) + 20


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step")
def test_amp_with_clipping_equals_torchs_recipe_and_survives_kills(host_daemon, tmp_path):
    """``scaler.unscale_(opt); clip_grad_norm_(...); opt.step()``: the anchored run equals plain
    torch's ``unscale_`` / clip / ``scaler.step`` / ``update`` bit for bit, skipped steps among
    them, and a kill at each phase (the first between the loop's unscale and the step's
    boundary) ends on it."""
    ref = C.run("ampclip-ref", CLIP, str(tmp_path / "ref.log"))
    losses = C.trajectory(ref.log)[0]
    plain, skipped = _plain(CLIP)
    assert losses == plain
    assert 0 < skipped < CLIP.steps - 2
    assert losses != _plain(CFG)[0]          # the clipping bites (0.05 is below this MLP's gradient norms)
    specs = ["before_boundary@1", "mid_chunk@2:1", "after_update@3:0", "after_commit@4:0", "between_steps@6",
             "before_update@8:1"]
    res = C.run("ampclip-phase", CLIP, str(tmp_path / "phase.log"), faults_seq=specs)
    assert res.kills == len(specs)
    assert C.trajectory(res.log) == C.trajectory(ref.log)
    ref_client = gpu_anchor.connect("cpu", namespace="ampclip-ref")
    assert C.compare(ref_client, gpu_anchor.connect("cpu", namespace="ampclip-phase")) == []


def test_the_scalers_own_step_is_refused_before_the_step(host_daemon):
    """torch's AMP recipe (``scaler.step(opt); scaler.update()``) on an ``AnchoredOptimizer``
    would skip inf steps behind the loop's back and keep the scale outside the commit:
    refused, naming the fix, with nothing changed."""
    from gpu_anchor.train import AnchoredOptimizer, anchor_module
    client = gpu_anchor.connect("cpu", namespace="amp-misuse")
    model = C.build_model(0)
    anchor_module(model, client)
    scaler = C.make_scaler()
    opt = AnchoredOptimizer(C.build_optimizer(model, CFG), model=model, client=client)
    x, y = C.batch(0, 0)
    scaler.scale(C.forward_loss(model, x, y, amp=True)).backward()
    before = [(p.detach().clone(), p.grad.clone()) for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"scaler=scaler\), keep scaler.scale"):
        scaler.step(opt)
    assert opt.completed_steps == 0
    bits = lambda t: t.detach().contiguous().view(torch.uint8)      # noqa: E731 (the gradients may hold inf)
    assert all(torch.equal(bits(p), bits(a)) and torch.equal(bits(p.grad), bits(g))
               for p, (a, g) in zip(model.parameters(), before))
