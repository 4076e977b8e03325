"""``AnchoredOptimizer`` in a loop written for Hugging Face accelerate (``tests/accelerate_job.py``):
gradient accumulation through ``accelerator.accumulate()``, against accelerate's own loop,
fault-free and SIGKILLed at protocol points (``gpu_anchor/train/hf_accelerate.py``)."""
import functools
import os
import subprocess
import sys

import pytest
import torch

import preloaded

pytest.importorskip("accelerate", reason="the test extra installs accelerate")
pytest.importorskip("transformers", reason="the test extra installs transformers")

from gpu_anchor.train import hf_accelerate  # noqa: E402

JOB = os.path.join(os.path.dirname(__file__), "accelerate_job.py")


def _run(mode, namespace="-", fault=None, cuda=False, fp16=False, **job_env):
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "ACC_JOB_CUDA": "1" if cuda else "0", "ACC_JOB_FP16": "1" if fp16 else "0"}
    for k in ("GPU_ANCHOR_TRAIN_FAULT", "ACC_JOB_CKPT", "ACC_JOB_RESUME", "ACC_JOB_KILL_AFTER_LOAD",
              "ACC_JOB_KILL_DAEMON_AT", "ACC_JOB_DAEMON_PID"):
        env.pop(k, None)
    env.update({f"ACC_JOB_{k.upper()}": str(v) for k, v in job_env.items()})
    if fault:
        env["GPU_ANCHOR_TRAIN_FAULT"] = fault
    return preloaded.run([sys.executable, JOB, mode, namespace], env=env, timeout=300, preload=preloaded.HF)


@functools.lru_cache(maxsize=None)
def _plain() -> tuple:
    """accelerate's own loop: one line per optimizer step (step, parameters' digest, rate)."""
    out = _run("plain")
    assert out.returncode == 0, out.stderr
    return tuple(out.stdout.splitlines())


def test_fault_free_it_is_accelerates_own_loop_bit_for_bit(host_daemon):
    anchored = _run("anchored", "acc-clean")
    assert anchored.returncode == 0, anchored.stderr
    plain = _plain()
    assert len(plain) == 9            # 4 steps an epoch, the last of one micro-batch; 2 epochs; the end
    assert tuple(anchored.stdout.splitlines()) == plain


@pytest.mark.parametrize("fault", [
    "before_boundary@2",     # mid-epoch: the rerun skips 6 micro-batches into the epoch
    "mid_chunk@4:0",         # the rerun finishes step 5, then starts 3 micro-batches into epoch 1
    "between_steps@3",       # after the epoch's last (one micro-batch) step
    "after_commit@5:0",
])
def test_killed_it_ends_where_accelerates_own_loop_does(host_daemon, fault):
    killed = _run("anchored", "acc-killed", fault)
    assert killed.returncode == -9, killed.stderr
    again = _run("anchored", "acc-killed")
    assert again.returncode == 0, again.stderr
    lines = killed.stdout.splitlines() + again.stdout.splitlines()
    plain = _plain()
    # Every step a run printed is the fault-free step (a step finished by recovery or killed
    # after its commit prints nothing), and the job ends where accelerate's loop does.
    assert set(lines) <= set(plain), sorted(set(lines) - set(plain))
    assert lines[-1] == plain[-1]
    assert len(set(lines)) >= len(plain) - 1


def test_save_state_and_load_state_checkpoint_it_as_they_do_accelerates_own_loop(host_daemon, tmp_path):
    """``accelerator.save_state`` every other step, then the daemon's state lost (a fresh
    namespace) and the job resumed with ``accelerator.load_state`` as accelerate's examples do:
    the anchored job's checkpoint holds its optimizer, schedule and step count (before, it held
    the model and RNG only, silently), and the resumed job goes on as accelerate's own loop
    resumed from its own checkpoint does, bit for bit.  SIGKILLed right after the load (not yet
    durable: the rerun loads again), inside and after the first step that follows it (durable:
    the rerun goes on from the anchored state), it ends there too."""
    plain = _plain()
    mine = _run("plain", ckpt=tmp_path / "plain")
    assert mine.returncode == 0, mine.stderr
    assert tuple(mine.stdout.splitlines()) == plain            # saving changes nothing
    resumed = _run("plain", ckpt=tmp_path / "plain-again", resume=tmp_path / "plain" / "step_4")
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout.splitlines() == list(plain[4:])      # accelerate's own resume is exact here

    saved = _run("anchored", "acc-ckpt", ckpt=tmp_path / "anchored")
    assert saved.returncode == 0, saved.stderr
    assert tuple(saved.stdout.splitlines()) == plain
    sd = torch.load(tmp_path / "anchored" / "step_4" / "optimizer.bin", weights_only=True)
    ours = sd["param_groups"][0]["gpu_anchor"]
    assert ours["completed_steps"] == 4 and ours["schedulers"][0]["last_epoch"] == 4
    assert sd["state"] and all("exp_avg" in st for st in sd["state"].values())

    checkpoint = tmp_path / "anchored" / "step_4"
    lost = _run("anchored", "acc-ckpt-lost", ckpt=tmp_path / "lost", resume=checkpoint)
    assert lost.returncode == 0, lost.stderr
    assert lost.stdout.splitlines() == list(plain[4:])

    moved = _run("anchored", "acc-ckpt-moved", ckpt=tmp_path / "moved", resume=tmp_path / "plain" / "step_4")
    assert moved.returncode == 0, moved.stderr          # from accelerate's own loop's checkpoint
    assert moved.stdout.splitlines() == list(plain[4:])

    lines, runs = [], []
    for fault, kill_after_load in [(None, 1), ("mid_chunk@0:0", 0), ("after_commit@1:0", 0), (None, 0)]:
        run = _run("anchored", "acc-ckpt-killed", fault, ckpt=tmp_path / "killed", resume=checkpoint,
                   kill_after_load=kill_after_load)
        assert run.returncode == (0 if fault is None and not kill_after_load else -9), run.stderr
        lines += run.stdout.splitlines()
        runs.append((fault, kill_after_load, run.returncode, run.stdout, run.stderr[-2000:]))
    # the protocol's step numbers count from the load (0 is the checkpoint's step 5); every
    # step printed is the fault-free one, and the job ends where it does.  (This sequence and
    # mid_chunk@4:0 above failed now and then until the recovery settled torch's CPU sqrt first:
    # docs/training.md; every run's output is in the message.)
    assert set(lines) <= set(plain[4:]) and lines[-1] == plain[-1], (sorted(set(lines) - set(plain)), plain, runs)
    assert len(set(lines)) >= len(plain) - 4 - 2


def test_the_daemon_killed_it_resumes_from_accelerates_checkpoint(host_daemon, tmp_path):
    """The daemon SIGKILLed right after the job's step-6 ``save_state``: the job fails at its
    next request; a new daemon is started, the job rerun in the same namespace with
    ``load_state`` of that checkpoint, as accelerate's examples resume, and it ends where
    accelerate's own loop does, its steps 7 and 8 bit for bit."""
    from gpu_anchor.client import control
    path, daemon = host_daemon
    plain = _plain()
    died = _run("anchored", "acc-daemon", ckpt=tmp_path / "ckpt", kill_daemon_at=6, daemon_pid=daemon.pid)
    assert died.returncode not in (0, -9), died.stderr
    assert "DaemonUnavailable: lost the gpu-anchor daemon" in died.stderr      # named, not a hang
    assert died.stdout.splitlines() == list(plain[:6])
    assert daemon.wait(timeout=30) == -9
    control.start("cpu", path)
    try:
        again = _run("anchored", "acc-daemon", ckpt=tmp_path / "ckpt", resume=tmp_path / "ckpt" / "step_6")
        assert again.returncode == 0, again.stderr
        assert again.stdout.splitlines() == list(plain[6:])
    finally:
        control.stop("cpu", path)


@pytest.mark.gpu
def test_on_a_gpu_killed_it_ends_where_accelerates_own_loop_does(cuda_daemon):
    """On one GPU (device progress, the fused Adam kernel where Triton is), each worker a new
    interpreter with torch's deterministic algorithms: accelerate's own loop and the anchored
    one step for step, and the job killed at three protocol points ends where it does."""
    plain = _run("plain", cuda=True)
    assert plain.returncode == 0, plain.stderr
    plain = plain.stdout.splitlines()
    clean = _run("anchored", "acc-gpu-clean", cuda=True)
    assert clean.returncode == 0, clean.stderr
    assert clean.stdout.splitlines() == plain
    lines = []
    for fault in ("before_boundary@2", "mid_chunk@4:0", "between_steps@6"):
        killed = _run("anchored", "acc-gpu-killed", fault, cuda=True)
        assert killed.returncode == -9, killed.stderr
        lines += killed.stdout.splitlines()
    again = _run("anchored", "acc-gpu-killed", cuda=True)
    assert again.returncode == 0, again.stderr
    lines += again.stdout.splitlines()
    assert set(lines) <= set(plain), sorted(set(lines) - set(plain))
    assert lines[-1] == plain[-1]


@pytest.mark.gpu
def test_on_a_gpu_in_fp16_with_clipping_killed_it_ends_where_accelerates_own_loop_does(cuda_daemon):
    """accelerate's fp16 with ``accelerator.clip_grad_norm_`` and the scaler given as
    ``scaler=accelerator.scaler``: the clip unscales the anchored gradients (the optimizer
    joined the Accelerator's), the step takes that unscale's inf flag, and a skipped step does
    not step the schedule, as accelerate's wrapped scheduler does not.  Fault-free, step for
    step accelerate's own loop (parameters, rate, scale), skipped and applied steps mixed;
    killed at three protocol points, the job ends where it does."""
    plain = _run("plain", cuda=True, fp16=True)
    assert plain.returncode == 0, plain.stderr
    plain = plain.stdout.splitlines()
    scales = [float(l.split()[4]) for l in plain[:-1]]
    assert any(b < a for a, b in zip([2.0 ** 24] + scales, scales)), scales     # a step skipped (the scale backed off)
    assert any(b > a for a, b in zip([2.0 ** 24] + scales, scales)), scales     # and one applied (it grew)
    clean = _run("anchored", "acc-fp16-clean", cuda=True, fp16=True)
    assert clean.returncode == 0, clean.stderr
    assert clean.stdout.splitlines() == plain
    lines = []
    for fault in ("before_boundary@2", "mid_chunk@4:0", "between_steps@6"):
        killed = _run("anchored", "acc-fp16-killed", fault, cuda=True, fp16=True)
        assert killed.returncode == -9, killed.stderr
        lines += killed.stdout.splitlines()
    again = _run("anchored", "acc-fp16-killed", cuda=True, fp16=True)
    assert again.returncode == 0, again.stderr
    lines += again.stdout.splitlines()
    assert set(lines) <= set(plain), sorted(set(lines) - set(plain))
    assert lines[-1] == plain[-1]


def test_refused_where_accelerate_owns_the_step_or_scales_the_loss(monkeypatch):
    from accelerate.state import AcceleratorState, DistributedType
    monkeypatch.setattr(AcceleratorState, "_shared_state", {"distributed_type": DistributedType.DEEPSPEED,
                                                          "_mixed_precision": "bf16"})
    assert "DeepSpeed" in hf_accelerate.refusal(None, torch.device("cpu"))
    monkeypatch.setattr(AcceleratorState, "_shared_state", {"distributed_type": DistributedType.FSDP,
                                                          "_mixed_precision": "bf16"})
    assert "fully_shard" in hf_accelerate.refusal(None, torch.device("cuda"))
    monkeypatch.setattr(AcceleratorState, "_shared_state", {"distributed_type": DistributedType.MULTI_GPU,
                                                          "_mixed_precision": "fp16"})
    assert "scaler=accelerator.scaler" in hf_accelerate.refusal(None, torch.device("cuda"))
    # a scaler that is not the Accelerator's: backward() scaled the loss with another one
    assert "not accelerator.scaler" in hf_accelerate.refusal(object(), torch.device("cuda"))
    assert hf_accelerate.refusal(object(), torch.device("cuda"), joined=object()) is None
    assert hf_accelerate.refusal(None, torch.device("cpu")) is None      # accelerate scales nothing on the CPU
    monkeypatch.setattr(AcceleratorState, "_shared_state", {})
    assert hf_accelerate.refusal(None, torch.device("cuda")) is None


def test_joins_the_accelerator_whose_scaler_it_is_given(host_daemon, monkeypatch):
    """``join``'s contract on the CPU, where accelerate scales nothing (its fp16 state set by
    hand; the GPU test above runs the real thing): the optimizer joins the Accelerator whose
    scaler it was given, once; ``optimizer_step_was_skipped`` reads it; another scaler joins none;
    dropped by ``free_memory()`` (which left Trainer's clip on scaled gradients on the H200), the
    next step is refused by name and the optimizer joins again."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    import gpu_anchor
    from gpu_anchor.testing import campaign as C
    from gpu_anchor.train import AnchoredOptimizer, anchor_module
    accelerator = Accelerator(cpu=True)
    accelerator.scaler = C.make_scaler()
    monkeypatch.setitem(AcceleratorState._shared_state, "_mixed_precision", "fp16")
    client = gpu_anchor.connect("cpu", namespace="acc-join")
    model = C.build_model(0)
    anchor_module(model, client)
    opt = AnchoredOptimizer(C.build_optimizer(model, C.CampaignConfig()), model=model, client=client,
                            scaler=accelerator.scaler)
    assert accelerator._optimizers == [opt] and hf_accelerate.join(opt, accelerator.scaler) is accelerator
    assert accelerator._optimizers == [opt]
    assert accelerator.optimizer_step_was_skipped is False
    opt.step_was_skipped = True
    assert accelerator.optimizer_step_was_skipped is True
    assert hf_accelerate.join(opt, C.make_scaler()) is None
    assert hf_accelerate.join(opt, None) is None
    cuda = torch.device("cuda")        # the check's fp16 branch: accelerate scales only there
    assert hf_accelerate.refusal(accelerator.scaler, cuda, accelerator, opt) is None
    accelerator.free_memory()          # as Trainer's train() begins: its clip would not unscale opt
    assert "free_memory() (or clear()) dropped AnchoredOptimizer" in \
        hf_accelerate.refusal(accelerator.scaler, cuda, accelerator, opt)
    assert accelerator._optimizers == [opt]      # joined again
    assert hf_accelerate.refusal(accelerator.scaler, cuda, accelerator, opt) is None


def test_joins_the_accelerator_that_prepared_its_model(host_daemon):
    """Without fp16: the only Accelerator alive at construction, or, with several, the one
    whose ``prepare`` got the model (looked up at the first step); after ``free_memory()`` the
    next step puts it back (so that ``save_state`` sees it).  None of several: a warning says
    ``save_state`` will not save it."""
    from accelerate import Accelerator

    import gpu_anchor
    from gpu_anchor.testing import campaign as C
    from gpu_anchor.train import AnchoredOptimizer, anchor_module

    def build(ns):
        client = gpu_anchor.connect("cpu", namespace=ns)
        model = C.build_model(0)
        anchor_module(model, client)
        return model, AnchoredOptimizer(C.build_optimizer(model, C.CampaignConfig()), model=model, client=client)

    def step(model, opt):
        x, y = C.batch(0, 0)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    import gc
    gc.collect()             # the other tests' Accelerators
    only = Accelerator(cpu=True)
    model, opt = build("acc-join-only")
    assert only._optimizers == [opt]
    other = Accelerator(cpu=True)
    model2, opt2 = build("acc-join-two")
    assert other._optimizers == [] and only._optimizers == [opt]          # two alive: not yet known
    model2, opt2 = other.prepare(model2, opt2)
    step(model2, opt2)
    assert other._optimizers == [opt2] and only._optimizers == [opt]
    other.free_memory()
    step(model2, opt2)
    assert other._optimizers == [opt2]
    model3, opt3 = build("acc-join-none")          # two alive, and neither prepared this model
    with pytest.warns(RuntimeWarning, match="found no Accelerator that prepared its model among the 2 alive"):
        step(model3, opt3)
    assert opt3 not in only._optimizers and opt3 not in other._optimizers


def _lines(log: str) -> list:
    return [l for l in log.splitlines() if l.startswith(("step ", "end "))]


def test_two_ranks_killed_end_where_accelerates_own_group_does(host_daemon, tmp_path):
    """``accelerate launch`` with two processes (gloo, DDP from ``prepare``): accelerate's own
    loop, whose prepared scheduler steps twice a step, against the anchored loop with the
    scheduler given in one rank's steps; then ranks killed at protocol points, the group
    started again each time, torchrun-style."""
    from gpu_anchor.testing import campaign as C
    from gpu_anchor.testing import ddp_campaign as D
    sys.path.insert(0, os.path.dirname(JOB))
    import accelerate_job as job
    logs = {}
    for name, kwargs in [("plain", {"plain": True}), ("clean", {}),
                         ("killed", {"faults_seq": [(0, "before_boundary@1"), (1, "mid_chunk@2:0"),
                                                    [(0, "after_update@3:0"), (1, "after_update@3:0")]]})]:
        (tmp_path / name).mkdir()
        res = D.run_group(f"acc-ddp-{name}", C.CampaignConfig(), str(tmp_path / name), target=job.rank_run, **kwargs)
        logs[name] = [_lines(log) for log in res["logs"]]
    steps = job.steps_per_epoch(2) * job.EPOCHS
    for r in range(2):
        assert len(logs["plain"][r]) == steps + 1 and len({l.split()[2] for l in logs["plain"][r][:-1]}) == steps
        assert logs["clean"][r] == logs["plain"][r]
        assert set(logs["killed"][r]) <= set(logs["plain"][r])
        assert logs["killed"][r][-1] == logs["plain"][r][-1]
    assert logs["plain"][0] == logs["plain"][1]          # DDP: every rank holds the same parameters


def test_two_ranks_resume_from_save_state_as_accelerates_own_group_does(host_daemon, tmp_path, monkeypatch):
    """Two processes (gloo, DDP from ``prepare``): accelerate's own group and the anchored one
    each ``save_state`` every other step; each group resumed from its step-2 checkpoint (the
    anchored one in fresh namespaces: its daemon state lost) prints its steps 3-4 and end, and
    the anchored group's are accelerate's group's, bit for bit on both ranks."""
    from gpu_anchor.testing import campaign as C
    from gpu_anchor.testing import ddp_campaign as D
    sys.path.insert(0, os.path.dirname(JOB))
    import accelerate_job as job
    logs = {}
    split = [[(0, "before_boundary@0"), (1, "after_boundary@0")]]     # the first step after the load
    for name, plain, ckpt, resume, faults in [("plain", True, "p", None, ()), ("plain-again", True, "p2", "p/step_2", ()),
                                              ("anchored", False, "a", None, ()),
                                              ("anchored-again", False, "a2", "a/step_2", ()),
                                              ("anchored-split", False, "a3", "a/step_2", split)]:
        (tmp_path / name).mkdir()
        monkeypatch.setenv("ACC_JOB_CKPT", str(tmp_path / ckpt))
        if resume:
            monkeypatch.setenv("ACC_JOB_RESUME", str(tmp_path / resume))
        else:
            monkeypatch.delenv("ACC_JOB_RESUME", raising=False)
        res = D.run_group(f"acc-ddp-ckpt-{name}", C.CampaignConfig(), str(tmp_path / name), target=job.rank_run,
                          plain=plain, faults_seq=faults)
        assert res["kills"] == len(faults)
        logs[name] = [_lines(log) for log in res["logs"]]
    assert job.steps_per_epoch(2) * job.EPOCHS == 4
    for r in range(2):
        assert len(logs["plain"][r]) == 5 and logs["anchored"][r] == logs["plain"][r]
        assert logs["plain-again"][r] == logs["plain"][r][2:]      # accelerate's own resume is exact here
        assert logs["anchored-again"][r] == logs["plain"][r][2:]
        assert logs["anchored-split"][r] == logs["plain"][r][2:]


def _supervised(cwd, opts, namespace, epochs=30):
    """``gpu-anchor run [opts] -- python accelerate_job.py anchored``: the job record's restarts."""
    import json
    cmd = [sys.executable, "-m", "gpu_anchor.launch.cli", "run", "--device-type", "cpu", "--namespace", namespace,
           *opts, "--", sys.executable, JOB, "anchored"]
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "ACC_JOB_LOG": str(cwd / "log"), "ACC_JOB_EPOCHS": str(epochs),
           "ACC_JOB_SLEEP": "0.03", "ACC_JOB_CUDA": "0"}
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"rc {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    with open(os.path.join(os.environ["GPU_ANCHOR_SOCKET_DIR"], "jobs", namespace + ".json")) as f:
        return json.load(f)["restarts"]


def test_under_the_supervisor_two_ranks_one_killed(clean_daemons, tmp_path):
    """``gpu-anchor run --nproc-per-node 2`` in place of ``accelerate launch``: accelerate joins
    the group from the supervisor's torchrun variables; one rank SIGKILLed twice, the group
    restarted in place; each rank ends on the fault-free group's parameters."""
    two = ["--nproc-per-node", "2"]
    for d in ("ref", "kills"):
        (tmp_path / d).mkdir()
    assert _supervised(tmp_path / "ref", two, "acc-np2-ref") == []
    ref = [_lines((tmp_path / "ref" / f"log.rank{r}").read_text()) for r in range(2)]
    assert ref[0] == ref[1] and len(ref[0]) == 2 * 30 + 1          # replicas; 2 steps an epoch, the end
    restarts = _supervised(tmp_path / "kills", [*two, "--chaos-kills", "2", "--chaos-kill-every", "0.7",
                                                "--chaos-seed", "3"], "acc-np2")
    assert [(r["action"], r["kind"]) for r in restarts] == [("restart", "shallow")] * 2
    for r in range(2):
        lines = _lines((tmp_path / "kills" / f"log.rank{r}").read_text())
        assert set(lines) <= set(ref[r]) and lines[-1] == ref[r][-1]
