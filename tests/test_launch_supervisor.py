"""``gpu-anchor run`` end to end with real daemons and workers, faults injected
with SIGKILL; every test ends by comparing with a fault-free run, bit for bit."""
from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import torch

from gpu_anchor.client import control

from launch_reference import DEMO, ROOT, STEPS


def run(cwd, opts, train_args=(), env=None, timeout=240, check=True):
    cmd = [sys.executable, "-m", "gpu_anchor.launch.cli", "run", "--device-type", "cpu", *opts, "--",
           sys.executable, DEMO, "--steps", str(STEPS), *train_args]
    p = subprocess.run(cmd, cwd=cwd, env={**os.environ, "PYTHONPATH": ROOT, **(env or {})}, capture_output=True,
                       text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"rc {p.returncode}\nstdout:\n{p.stdout[-3000:]}\nstderr:\n{p.stderr[-5000:]}")
    return p


def job(socket_dir, namespace="job-demo_train"):
    with open(os.path.join(socket_dir, "jobs", namespace + ".json")) as f:
        return json.load(f)


def result(path):
    return torch.load(path)


def test_shallow_kills_reattach_in_place(reference, clean_daemons, tmp_path):
    p = run(str(tmp_path), ["--chaos-kills", "3", "--chaos-kill-every", "0.3", "--chaos-seed", "1",
                            "--max-restarts", "3"], ["--out", "r.pt", "--step-sleep", "0.01"])
    assert torch.equal(result(tmp_path / "r.pt"), reference[1])
    rs = job(clean_daemons)["restarts"]
    assert [(r["action"], r["kind"], r["chaos"]) for r in rs] == [("restart", "shallow", True)] * 3
    assert all(r["step"] and 0 < r["step"] < STEPS for r in rs)   # killed mid-training, resumed there
    assert all(r["recovery_s"] is not None and r["how"] == "warm (forked)" for r in rs)
    assert p.stderr.count("decision: RESTART") == 3
    status = subprocess.run([sys.executable, "-m", "gpu_anchor.launch.cli", "jobs"], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": ROOT}).stdout
    assert "restart 3: restart (shallow)" in status and "s to first step" in status


def test_cold_path_reattaches_too(reference, clean_daemons, tmp_path):
    run(str(tmp_path), ["--cold", "--chaos-kills", "1", "--chaos-kill-every", "0.3"],
        ["--out", "r.pt", "--step-sleep", "0.01"])
    assert torch.equal(result(tmp_path / "r.pt"), reference[1])
    rs = job(clean_daemons)["restarts"]
    assert len(rs) == 1 and rs[0]["how"] == "cold" and rs[0]["action"] == "restart"


def test_two_ranks_one_killed_restarts_the_group(reference, clean_daemons, tmp_path):
    run(str(tmp_path), ["--nproc-per-node", "2", "--chaos-kills", "2", "--chaos-kill-every", "0.5",
                        "--chaos-seed", "3"], ["--out", "r.pt", "--step-sleep", "0.01"])
    assert torch.equal(result(tmp_path / "r.pt"), reference[2])
    rs = job(clean_daemons)["restarts"]
    assert len(rs) == 2 and all(r["action"] == "restart" for r in rs)


def test_daemon_killed_falls_back_to_checkpoint(reference, clean_daemons, tmp_path):
    p = run(str(tmp_path), ["--checkpoint-dir", "ckpt", "--checkpoint-every", "10", "--checkpoint-keep", "1000",
                            "--chaos-kills", "1", "--chaos-target", "daemon", "--chaos-kill-every", "0.6"],
            ["--out", "r.pt", "--step-sleep", "0.01"])
    rs = job(clean_daemons)["restarts"]
    assert len(rs) == 1 and (rs[0]["action"], rs[0]["kind"]) == ("restore", "destructive")
    k = rs[0]["restore_step"]
    assert k and k % 10 == 0 and "not answering" in rs[0]["reason"]
    assert torch.equal(result(tmp_path / "r.pt"), reference[1])
    # ... and identical to a fault-free run resumed from that checkpoint in fresh daemons
    only = tmp_path / "only"
    shutil.copytree(tmp_path / "ckpt" / f"step-{k:09d}", only / f"step-{k:09d}")
    p2 = run(str(tmp_path), ["--checkpoint-dir", "only", "--namespace", "resumed"], ["--out", "r2.pt"])
    assert f"resuming from checkpoint step {k}" in p2.stderr
    assert torch.equal(result(tmp_path / "r2.pt"), reference[1])


def test_torn_checkpoint_is_ignored_for_the_previous_complete_one(reference, clean_daemons, tmp_path):
    # widen each write so the node "dies" inside one: 15 objects, ~2 s a write (polled every 5 ms)
    env = {"GPU_ANCHOR_SNAPSHOT_THROTTLE_S": "0.15"}
    cmd = [sys.executable, "-m", "gpu_anchor.launch.cli", "run", "--device-type", "cpu", "--checkpoint-dir", "ckpt",
           "--checkpoint-every", "40", "--checkpoint-keep", "1000", "--", sys.executable, DEMO, "--steps",
           str(STEPS), "--out", "r.pt"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env={**os.environ, "PYTHONPATH": ROOT, **env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ckpt = tmp_path / "ckpt"
    torn = None
    deadline = time.monotonic() + 120
    while torn is None and time.monotonic() < deadline:
        steps = sorted(glob.glob(str(ckpt / "step-*")))
        done = [s for s in steps if os.path.exists(os.path.join(s, "rank0", "COMMITTED"))]
        writing = [s for s in steps if os.path.exists(os.path.join(s, "rank0", "cpu.safetensors"))
                   and not os.path.exists(os.path.join(s, "rank0", "COMMITTED"))]
        if done and writing:
            torn = writing[-1]
            # the node dies mid-write: worker and daemon at once
            worker = int(job(clean_daemons)["ranks"]["0"]["pid"])
            daemon = control.ping("cpu", os.path.join(clean_daemons, "cpu.sock"))["pid"]
            os.kill(worker, signal.SIGKILL)
            os.kill(daemon, signal.SIGKILL)
            previous = int(os.path.basename(done[-1])[5:])
        time.sleep(0.005)
    out, err = proc.communicate(timeout=180)
    assert torn is not None, "never caught a checkpoint being written"
    assert proc.returncode == 0, err[-4000:]
    rs = job(clean_daemons)["restarts"]
    # the torn step existed on disk but the restore took the previous complete one
    # (the job later re-reached the torn step and wrote it again, whole)
    assert rs[0]["action"] == "restore" and rs[0]["restore_step"] == previous
    assert previous < int(os.path.basename(torn)[5:])
    assert torch.equal(result(tmp_path / "r.pt"), reference[1])


def test_crash_loop_stops_and_a_fixed_rerun_continues_from_the_kept_state(reference, clean_daemons, tmp_path):
    p = run(str(tmp_path), ["--crash-loop", "3", "--restart-backoff", "0.05", "--max-restarts", "10"],
            ["--out", "r.pt", "--fail-at-step", "15"], check=False)
    assert p.returncode == 1
    assert "crash loop: 3 failures in a row at step 14 with exit1" in p.stderr
    assert "Anchored state is kept" in p.stderr
    assert job(clean_daemons)["state"] == "stopped"
    # the debug-restart case: the user fixes the code and reruns the same command
    p2 = run(str(tmp_path), [], ["--out", "r.pt"])
    assert "reusing pid" in p2.stderr
    assert "resuming at step 14" in p2.stdout
    assert torch.equal(result(tmp_path / "r.pt"), reference[1])


def test_bad_command_line_is_a_clear_error(tmp_path):
    p = subprocess.run([sys.executable, "-m", "gpu_anchor.launch.cli", "run", "--checkpoint-every", "5", "--",
                        "python", "x.py"], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT})
    assert p.returncode == 2 and "--checkpoint-every needs --checkpoint-dir" in p.stderr


def test_two_ranks_daemon_killed_every_rank_restores_the_same_step(reference, clean_daemons, tmp_path):
    p = run(str(tmp_path), ["--nproc-per-node", "2", "--checkpoint-dir", "ckpt", "--checkpoint-every", "10",
                            "--chaos-kills", "1", "--chaos-target", "daemon", "--chaos-kill-every", "0.5"],
            ["--out", "r.pt", "--step-sleep", "0.01"])
    rs = job(clean_daemons)["restarts"]
    assert len(rs) == 1 and rs[0]["action"] == "restore" and rs[0]["restore_step"]
    assert set(rs[0]["marks"]) == {"0", "1"} and all("restored" in m for m in rs[0]["marks"].values())
    assert f"resuming at step {rs[0]['restore_step']}" in p.stdout
    assert torch.equal(result(tmp_path / "r.pt"), reference[2])


def test_hung_group_is_killed_and_restarted_in_place(reference, clean_daemons, tmp_path):
    p = run(str(tmp_path), ["--hang-timeout", "2"], ["--out", "r.pt", "--hang-at-step", "30"])
    rs = job(clean_daemons)["restarts"]
    assert len(rs) == 1 and rs[0]["action"] == "restart" and rs[0]["step"] == 29
    assert "hang: no new committed step" in rs[0]["reason"]
    assert "resuming at step 29" in p.stdout
    assert torch.equal(result(tmp_path / "r.pt"), reference[1])


def test_cpu_device_type_hides_the_gpus_from_the_workers(clean_daemons, tmp_path):
    # on a GPU host, examples/demo_train.py would otherwise pick cuda:LOCAL_RANK, where no daemon of
    # this job runs (rank 1 of a 2-rank job on a one-GPU host failed outright)
    p = subprocess.run([sys.executable, "-m", "gpu_anchor.launch.cli", "run", "--device-type", "cpu", "--nproc-per-node",
                        "2", "--", sys.executable, "-c",
                        "import os; print('visible=%r' % os.environ.get('CUDA_VISIBLE_DEVICES'))"],
                       cwd=tmp_path, env={**os.environ, "PYTHONPATH": ROOT, "CUDA_VISIBLE_DEVICES": "0"},
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.count("visible=''") == 2, p.stdout
