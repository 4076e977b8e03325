"""Hugging Face ``Trainer``, the way most transformers users train, on anchored state.

``AnchoredTrainer`` against plain ``transformers.Trainer`` (the same job, ``hf_trainer_job``):
the same parameters after every step, bit for bit, and the same logs.  Then the job's workers
are SIGKILLed at each point of the step protocol, at the ends of epochs and at random
instants, each worker a fork of a process that has imported transformers (as the supervisor's
warm workers are), and the job ends where the fault-free one does: every anchored object bit
for bit, every step's parameters bit for bit.  Then the daemon's state is lost and the job
resumes from Trainer's own checkpoint, read into anchored memory.
"""
from __future__ import annotations

import functools
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("transformers", reason="the Hugging Face Trainer tests need transformers (the test extra)")

import gpu_anchor  # noqa: E402
from gpu_anchor.testing import campaign as C  # noqa: E402
from gpu_anchor.testing import ddp_campaign as D  # noqa: E402

import hf_trainer_job as job  # noqa: E402


def _start(namespace, log, out, fault=None, **overrides) -> int:
    return C._child(functools.partial(job.run, namespace, str(log), str(out), fault, **overrides))


def _train(namespace, log, out, fault=None, **overrides) -> int:
    return C._wait(_start(namespace, log, out, fault, **overrides))


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The job under plain ``transformers.Trainer``: its log."""
    d = tmp_path_factory.mktemp("plain")
    assert _train(None, d / "log", d / "out") == 0
    return (d / "log").read_text()


@pytest.fixture
def fault_free(host_daemon, references, tmp_path_factory):
    """The job under ``AnchoredTrainer`` with no fault, once per session: its log, a client of
    its namespace and its wall time."""
    def run():
        d = tmp_path_factory.mktemp("hf-ref")
        t0 = time.perf_counter()
        assert _train("hf-ref", d / "log", d / "out") == 0
        return (d / "log").read_text(), references.connect("hf-ref"), time.perf_counter() - t0
    return references.get("hf_trainer", run)


def test_trains_what_trainer_trains(plain, fault_free):
    log, client, _ = fault_free
    assert job.steps(log) == job.steps(plain)
    assert len(job.steps(log)) == job.STEPS
    assert job.finished(log) == job.finished(plain)       # global step, parameters, every logged value
    objects = client.objects()
    assert "model.model.layers[0].self_attn.q_proj.weight" in objects      # managed_scope names the weights
    assert any(n.startswith("train.state.") for n in objects), sorted(objects)    # the optimizer state is anchored


def _run_with_kills(namespace, tmp_path, specs, random_kills, max_delay_s, rng, **overrides):
    """Rerun the job until it finishes: first killed at each protocol spec, then at random."""
    log = tmp_path / f"{namespace}.log"
    kills = 0
    for spec in specs:
        assert _train(namespace, log, tmp_path / "out", fault=spec, **overrides) == -9, f"{spec} was not reached"
        kills += 1
    left = random_kills
    while True:
        pid = _start(namespace, log, tmp_path / "out", **overrides)
        if left > 0:
            time.sleep(rng.uniform(0, max_delay_s))
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        code = C._wait(pid)
        if code == -9:
            kills += 1
            left -= 1
            continue
        assert code == 0
        return log.read_text(), kills


def test_killed_anywhere_ends_where_the_fault_free_job_does(fault_free, tmp_path):
    ref_log, ref_client, ref_wall = fault_free
    steps_per_epoch = 3            # 5 micro-batches of 4, two a step: the third step has one
    # each spec in a worker that resumed after the previous one's kill (a killed step that
    # recovery finishes is not run again, so a point inside it cannot be reached twice)
    specs = ["before_boundary@0",                    # the first step, before its gradients are final
             "after_boundary@1",                     # the redo log committed, nothing applied
             f"between_steps@{steps_per_epoch - 1}",  # the epoch's last (one micro-batch) step committed
             "mid_chunk@3:0",                        # the next epoch's first step, half applied
             "after_update@4:0",
             f"between_steps@{2 * steps_per_epoch - 1}",
             "after_commit@6:0",
             "before_boundary@8"]                    # the job's last step
    log, kills = _run_with_kills("hf-kills", tmp_path, specs, random_kills=6, max_delay_s=ref_wall,
                                 rng=random.Random(20261204))
    assert kills >= len(specs)
    ref_steps = job.steps(ref_log)
    got = job.steps(log)
    assert {s: ref_steps[s] for s in got} == got          # every step a worker finished: the same parameters
    step, sha, logs = job.finished(log)
    ref_step, ref_sha, ref_logs = job.finished(ref_log)
    assert (step, sha) == (ref_step, ref_sha)
    by_step = {e["step"]: e for e in ref_logs}
    assert all(by_step[e["step"]] == e for e in logs)     # what was logged is what the fault-free job logged
    assert C.compare(ref_client, gpu_anchor.connect("cpu", namespace="hf-kills")) == []


def test_peft_lora_killed_ends_where_the_fault_free_job_does(host_daemon, tmp_path):
    """peft's LoRA (adapters created in the scope, the base frozen and anchored): the same
    parameters as plain ``Trainer``, and killed at protocol points and at random, the same end."""
    pytest.importorskip("peft", reason="the LoRA case needs peft (the test extra)")
    lora = dict(lora=True)
    assert _train(None, tmp_path / "plain", tmp_path / "out", **lora) == 0
    t0 = time.perf_counter()
    assert _train("hf-lora-ref", tmp_path / "ref", tmp_path / "out", **lora) == 0
    wall = time.perf_counter() - t0
    ref = (tmp_path / "ref").read_text()
    assert job.finished(ref) == job.finished((tmp_path / "plain").read_text())
    assert len(set(job.steps(ref).values())) == job.STEPS
    specs = ["mid_chunk@1:0", f"between_steps@{2}", "after_boundary@4", "after_update@6:0"]
    log, kills = _run_with_kills("hf-lora", tmp_path, specs, random_kills=3, max_delay_s=wall,
                                 rng=random.Random(11), **lora)
    assert kills >= len(specs)
    assert job.finished(log)[:2] == job.finished(ref)[:2]
    objects = gpu_anchor.connect("cpu", namespace="hf-lora").objects()
    assert any("lora_A" in n for n in objects) and any(n.startswith("train.state.") and "lora_B" in n for n in objects)
    assert C.compare(gpu_anchor.connect("cpu", namespace="hf-lora-ref"), gpu_anchor.connect("cpu", namespace="hf-lora")) == []


def test_gradient_lending_under_trainer(host_daemon, tmp_path, monkeypatch):
    """``anchor_config=StepProtocolConfig(lend_grad_bytes=...)``: the forward's saved tensors go
    into the gradient buffers between steps (AnchoredTrainer opens lending's window at each
    step's end), and the parameters stay plain ``Trainer``'s, bit for bit."""
    from gpu_anchor.train import grad_lending
    monkeypatch.setattr(grad_lending, "MIN_BYTES", 1024)     # this model's activations are small
    one = dict(gradient_accumulation_steps=1)
    assert _train(None, tmp_path / "plain", tmp_path / "out", **one) == 0
    assert _train("hf-lend", tmp_path / "lend", tmp_path / "out", lend=1 << 30, **one) == 0
    log = (tmp_path / "lend").read_text()
    assert job.finished(log) == job.finished((tmp_path / "plain").read_text())
    assert int(next(line for line in log.splitlines() if line.startswith("lent ")).split()[1]) > 0


@pytest.mark.parametrize("lora", [False, True])
def test_gradients_written_in_place_under_trainer(host_daemon, tmp_path, lora):
    """``anchor_config=StepProtocolConfig(grads_in_place=True)``, with micro-batches and
    ``max_grad_norm``, on the Qwen3 model and on peft's LoRA of it (the adapters' ``nn.Linear``
    layers are written in place, the frozen base is not taken): plain ``Trainer``'s parameters
    and logs, bit for bit."""
    if lora:
        pytest.importorskip("peft", reason="the LoRA case needs peft (the test extra)")
    assert _train(None, tmp_path / "plain", tmp_path / "out", lora=lora) == 0
    assert _train("hf-in-place", tmp_path / "in_place", tmp_path / "out", lora=lora, in_place=True) == 0
    log = (tmp_path / "in_place").read_text()
    assert job.finished(log) == job.finished((tmp_path / "plain").read_text())
    assert job.steps(log) == job.steps((tmp_path / "plain").read_text())
    assert int(next(line for line in log.splitlines() if line.startswith("in_place ")).split()[1]) > 0


def test_a_rerun_after_the_last_step_trains_nothing(host_daemon, tmp_path):
    """Killed after committing the last step, before ``train()`` returned: the rerun trains no
    step and ends where the fault-free job does.  Eight steps end inside the third epoch, where
    Trainer's own resume would run a ninth before it checks."""
    last = dict(max_steps=8)
    assert _train("hf-last-ref", tmp_path / "ref", tmp_path / "out", **last) == 0
    assert _train("hf-last", tmp_path / "log", tmp_path / "out", fault="between_steps@7", **last) == -9
    assert _train("hf-last", tmp_path / "log2", tmp_path / "out", **last) == 0
    step, sha, logs = job.finished((tmp_path / "log2").read_text())
    assert (step, sha, logs) == (8, job.finished((tmp_path / "ref").read_text())[1], [])
    assert C.compare(gpu_anchor.connect("cpu", namespace="hf-last-ref"), gpu_anchor.connect("cpu", namespace="hf-last")) == []


def test_evaluation_and_the_best_model_across_a_restart(host_daemon, tmp_path):
    """Evaluation every 3 steps, checkpoints with it and ``load_best_model_at_end``: killed after
    step 5 (one evaluation and its best metric behind it), the rerun ends with the fault-free
    run's best checkpoint and parameters."""
    ev = dict(eval_strategy="steps", eval_steps=3, save_strategy="steps", save_steps=3, load_best_model_at_end=True,
              metric_for_best_model="loss", greater_is_better=False)
    assert _train("hf-eval-ref", tmp_path / "ref", tmp_path / "ref-out", **ev) == 0
    assert _train("hf-eval", tmp_path / "log", tmp_path / "out", fault="between_steps@4", **ev) == -9
    assert _train("hf-eval", tmp_path / "log", tmp_path / "out", **ev) == 0
    assert _done(tmp_path / "log") == _done(tmp_path / "ref")
    best = [json.load(open(p / "trainer_state.json"))["best_model_checkpoint"].rsplit("/", 1)[1]
            for p in (tmp_path / "ref-out" / "checkpoint-9", tmp_path / "out" / "checkpoint-9")]
    assert best[0] == best[1]


def test_checkpoints_on_disk_and_the_daemon_state_lost(fault_free, tmp_path):
    """Trainer's own checkpoints every 3 steps; killed after step 5.  The rerun, asked to
    ``resume_from_checkpoint=True``, resumes from the anchored state (step 5, newer than
    checkpoint-3) and says so; killed again after step 7, the daemon's state is lost (the
    namespace dropped: what a new daemon holds), and the rerun reads checkpoint-6 into
    anchored memory.  Both end where the fault-free job does."""
    ref_log, ref_client, _ = fault_free
    out = tmp_path / "out"
    ckpt = dict(save_strategy="steps", save_steps=3, resume_from_checkpoint=True)

    def checkpoints():
        return sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-"))
    assert _train("hf-lost", tmp_path / "log", out, fault="between_steps@4", **{**ckpt, "resume_from_checkpoint": None}) == -9
    assert checkpoints() == ["checkpoint-3"]
    assert _train("hf-lost", tmp_path / "log2", out, fault="between_steps@6", **ckpt) == -9
    assert "resume_from_checkpoint=True is not read: the anchored state, at step 5, is newer" in (out / "warnings").read_text()
    assert job.steps((tmp_path / "log2").read_text()) == {6: job.steps(ref_log)[6]}    # from step 5, not 3
    assert checkpoints() == ["checkpoint-3", "checkpoint-6"]
    gpu_anchor.connect("cpu", namespace="hf-lost").drop_namespace()
    assert _train("hf-lost", tmp_path / "log", out, **ckpt) == 0
    step, sha, _ = job.finished((tmp_path / "log").read_text())
    assert (step, sha) == job.finished(ref_log)[:2]
    assert C.compare(ref_client, gpu_anchor.connect("cpu", namespace="hf-lost")) == []


@pytest.fixture
def ddp_fault_free(host_daemon, references, tmp_path_factory):
    """The job on two DDP ranks (gloo, torchrun-style group), no fault, once per session."""
    def run():
        return D.run_group("hf-ddp-ref", C.CampaignConfig(), str(tmp_path_factory.mktemp("hf-ddp-ref")),
                           target=job.rank_run)
    return references.get("hf_trainer_ddp", run), references.connect


def test_ddp_ranks_killed_end_where_the_fault_free_group_does(ddp_fault_free, tmp_path):
    """Two ranks; plain ``Trainer`` first (the same bits on each rank); then one rank or both
    killed at protocol points and at random, the group torn down and started again each time."""
    ref, ref_client = ddp_fault_free
    (tmp_path / "plain").mkdir()
    plain = D.run_group("hf-ddp-plain", C.CampaignConfig(), str(tmp_path / "plain"), target=job.rank_run, plain=True)
    for r in range(2):
        assert job.finished(ref["logs"][r]) == job.finished(plain["logs"][r])
        assert len(set(job.steps(ref["logs"][r]).values())) == job.STEPS          # it trains: nine different weights
    specs = [(0, "before_boundary@1"), (1, "mid_chunk@2:0"), (0, f"between_steps@{3}"), (1, "after_commit@5:0"),
             [(0, "after_update@6:0"), (1, "after_update@6:0")]]
    (tmp_path / "kills").mkdir()
    res = D.run_group("hf-ddp", C.CampaignConfig(), str(tmp_path / "kills"), faults_seq=specs, random_kills=4,
                      max_delay_s=ref["wall_s"], rng=random.Random(20261205), target=job.rank_run)
    print(f"DDP Trainer campaign: {res['kills']} kills in {res['generations']} generations")
    assert res["kills"] >= len(specs)
    for r in range(2):
        assert job.finished(res["logs"][r])[:2] == job.finished(ref["logs"][r])[:2]
        assert C.compare(ref_client(f"hf-ddp-ref/rank{r}"), gpu_anchor.connect("cpu", namespace=f"hf-ddp/rank{r}")) == []


def _supervised(cwd, opts, namespace, steps=100, step_sleep=0.02):
    """``gpu-anchor run [opts] -- python hf_trainer_job.py``: its job record's restarts."""
    cmd = [sys.executable, "-m", "gpu_anchor.launch.cli", "run", "--device-type", "cpu", "--namespace", namespace,
           *opts, "--", sys.executable, job.__file__, "log", "out", str(steps), str(step_sleep)]
    root = os.path.dirname(os.path.dirname(job.__file__))
    p = subprocess.run(cmd, cwd=cwd, env={**os.environ, "PYTHONPATH": root}, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"rc {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    with open(os.path.join(os.environ["GPU_ANCHOR_SOCKET_DIR"], "jobs", namespace + ".json")) as f:
        record = json.load(f)
    return record["restarts"]


def _done(log) -> tuple[int, str]:
    """The global step and parameter digest the job's last worker ended with."""
    return job.finished(log.read_text())[:2]


def test_under_the_supervisor_workers_and_the_daemon_killed(clean_daemons, tmp_path):
    """The user's command line: ``gpu-anchor run -- python job.py``.  Workers SIGKILLed twice
    (restarted in place), then in another run the daemon (its memory gone: restored from the
    supervisor's last checkpoint); both end where the fault-free run under the same supervisor
    does (the same threads, so the same bits)."""
    for d in ("ref", "workers", "daemon"):
        (tmp_path / d).mkdir()
    assert _supervised(tmp_path / "ref", [], "hf-sup-ref") == []
    ref = _done(tmp_path / "ref" / "log")
    assert ref[0] == 100
    restarts = _supervised(tmp_path / "workers", ["--chaos-kills", "2", "--chaos-kill-every", "0.5",
                                                  "--chaos-seed", "1"], "hf-sup-workers")
    assert [(r["action"], r["kind"]) for r in restarts] == [("restart", "shallow")] * 2
    assert _done(tmp_path / "workers" / "log") == ref
    restarts = _supervised(tmp_path / "daemon", ["--checkpoint-dir", "ckpt", "--checkpoint-every", "10",
                                                 "--chaos-kills", "1", "--chaos-target", "daemon",
                                                 "--chaos-kill-every", "1.0", "--chaos-seed", "2"], "hf-sup-daemon")
    assert [(r["action"], r["kind"]) for r in restarts] == [("restore", "destructive")]
    assert restarts[0]["restore_step"] and restarts[0]["restore_step"] % 10 == 0
    assert _done(tmp_path / "daemon" / "log") == ref


def test_under_the_supervisor_two_ranks_one_killed(clean_daemons, tmp_path):
    """``gpu-anchor run --nproc-per-node 2``: Trainer's DDP over the two workers the supervisor
    starts; one rank SIGKILLed twice, the group restarted in place; each rank ends on the
    fault-free group's parameters."""
    two = ["--nproc-per-node", "2"]
    for d in ("ref", "kills"):
        (tmp_path / d).mkdir()
    assert _supervised(tmp_path / "ref", two, "hf-np2-ref") == []
    ref = _done(tmp_path / "ref" / "log.rank0")
    assert _done(tmp_path / "ref" / "log.rank1") == ref and ref[0] == 100      # replicas
    restarts = _supervised(tmp_path / "kills", [*two, "--chaos-kills", "2", "--chaos-kill-every", "0.7",
                                                "--chaos-seed", "3"], "hf-np2")
    assert [(r["action"], r["kind"]) for r in restarts] == [("restart", "shallow")] * 2
    assert [_done(tmp_path / "kills" / f"log.rank{r}") for r in range(2)] == [ref, ref]


@pytest.mark.gpu
@pytest.mark.parametrize("fp16", [False, True], ids=["fp32", "fp16"])
def test_on_a_gpu_killed_at_protocol_points(cuda_daemon, tmp_path, fp16):
    """On one GPU (device progress, the fused Adam kernel), each worker a new interpreter, with
    torch's deterministic algorithms: plain ``Trainer`` and ``AnchoredTrainer`` end on the same
    parameters and log history, and the job killed at four protocol points ends where the
    fault-free one does.  ``fp16``: ``fp16=True`` with Trainer's clipping (``max_grad_norm``),
    accelerate's GradScaler and clip driving the anchored step (``hf_accelerate.join``)."""
    pytest.importorskip("triton", reason="the GPU path under test is the fused Triton kernel")

    def worker(name, namespace, fault=None, plain=False):
        env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(job.__file__)), "HF_JOB_CUDA": "1",
               "GPU_ANCHOR_NAMESPACE": namespace, "HF_JOB_PLAIN": "1" if plain else "0",
               "HF_JOB_FP16": "1" if fp16 else "0"}
        env.pop("GPU_ANCHOR_TRAIN_FAULT", None)
        if fault:
            env["GPU_ANCHOR_TRAIN_FAULT"] = fault
        return subprocess.run([sys.executable, job.__file__, str(tmp_path / name), str(tmp_path / "out"), "20", "0"],
                              env=env, timeout=300).returncode
    assert worker("plain", "-", plain=True) == 0
    assert worker("ref", f"hf-gpu-ref-{fp16}") == 0
    logs = [job.finished((tmp_path / name).read_text())[2] for name in ("ref", "plain")]
    assert logs[0] == logs[1]          # first: losses, norms and rates say where they part
    assert _done(tmp_path / "ref") == _done(tmp_path / "plain")
    for spec in ("before_boundary@2", "mid_chunk@5:0", "after_update@9:0", "between_steps@14"):
        assert worker("kills", f"hf-gpu-kills-{fp16}", fault=spec) == -signal.SIGKILL, spec
    assert worker("kills", f"hf-gpu-kills-{fp16}") == 0
    assert _done(tmp_path / "kills") == _done(tmp_path / "ref")
    assert C.compare(gpu_anchor.connect("cuda:0", namespace=f"hf-gpu-ref-{fp16}"),
                     gpu_anchor.connect("cuda:0", namespace=f"hf-gpu-kills-{fp16}")) == []


def test_refuses_what_it_cannot_anchor(host_daemon, tmp_path):
    import torch
    from gpu_anchor.train import AnchoredOptimizer
    from gpu_anchor.train import AnchoredTrainer
    with gpu_anchor.managed_scope(namespace="hf-refuse"):
        model = job.build_model()
    opt = AnchoredOptimizer(torch.optim.AdamW(model.parameters()), model=model)
    with pytest.raises(ValueError, match=r"pass the torch optimizer"):
        AnchoredTrainer(model=model, args=job.arguments(str(tmp_path)), train_dataset=job.Tokens(),
                        optimizers=(opt, None))
    with pytest.raises(ValueError, match=r"reduce_lr_on_plateau steps with a metric"):
        AnchoredTrainer(model=model, args=job.arguments(str(tmp_path), lr_scheduler_type="reduce_lr_on_plateau",
                                                        eval_strategy="steps", eval_steps=3),
                        train_dataset=job.Tokens(), eval_dataset=job.Tokens())
    from gpu_anchor.train.hf import _resume_is_wrong_here
    five = list(range(5))                          # an epoch of 5 batches, two a step
    assert "merged into the next epoch's first" in _resume_is_wrong_here("4.56.2", five, 2)
    assert _resume_is_wrong_here("5.3.0", five, 2) is None and _resume_is_wrong_here("4.56.2", five, 1) is None
    assert _resume_is_wrong_here("4.56.2", list(range(6)), 2) is None
    with pytest.raises(ValueError, match=r"model_init builds a new model"):
        AnchoredTrainer(model_init=job.build_model, args=job.arguments(str(tmp_path)), train_dataset=job.Tokens())
