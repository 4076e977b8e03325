"""``gpu-anchor status`` as a user runs it: which daemon it asks (``--socket``, then
``GPU_ANCHOR_SOCKET``, then the per-user directory) and which jobs it lists (live ones;
finished and abandoned ones with ``--all``)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import torch

import gpu_anchor
import preloaded
from gpu_anchor.client import control

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLI = [sys.executable, "-m", "gpu_anchor.cli"]


def _cli(*args, env=None, check=True) -> subprocess.CompletedProcess:
    p = subprocess.run(CLI + list(args), env={**os.environ, "PYTHONPATH": ROOT, **(env or {})},
                       capture_output=True, text=True, timeout=240)
    if check and p.returncode != 0:
        raise AssertionError(f"{args}: rc {p.returncode}\n{p.stdout}\n{p.stderr}")
    return p


def _namespaces(out: str) -> list[list[str]]:
    return [sorted(d.get("namespaces", {})) for d in json.loads(out)["daemons"]]


def test_status_asks_socket_flag_then_environment_then_user_directory(host_daemon, tmp_path):
    home, _ = host_daemon                       # the per-user directory's daemon
    other = str(tmp_path / "elsewhere" / "cpu.sock")
    proc = control.start("cpu", other)
    try:
        keep = [gpu_anchor.connect("cpu", namespace="at-home", socket=home).tensor("w", (4,), torch.float32),
                gpu_anchor.connect("cpu", namespace="elsewhere", socket=other).tensor("w", (4,), torch.float32)]
        assert _namespaces(_cli("status", "--json").stdout) == [["at-home"]]
        env = {"GPU_ANCHOR_SOCKET": other}
        assert _namespaces(_cli("status", "--json", env=env).stdout) == [["elsewhere"]]
        human = _cli("status", env=env).stdout
        assert "elsewhere" in human and "at-home" not in human and "no gpu-anchor daemons" not in human, human
        assert _namespaces(_cli("status", "--json", "--socket", home, env=env).stdout) == [["at-home"]]
        gone = str(tmp_path / "nobody" / "cpu.sock")
        out = _cli("status", env={"GPU_ANCHOR_SOCKET": gone}).stdout
        assert f"{gone}: no daemon answers" in out, out
        del keep
    finally:
        control.stop("cpu", other)
        proc.wait(10)


def _run_job(namespace: str, code: str, socket_dir: str) -> subprocess.Popen:
    cmd = CLI + ["run", "--device-type", "cpu", "--cold", "--quiet", "--namespace", namespace, "--",
                 sys.executable, "-c", code]
    return subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": ROOT}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _job_state(socket_dir: str, namespace: str):
    try:
        with open(os.path.join(socket_dir, "jobs", namespace + ".json")) as f:
            return json.load(f)["state"]
    except (OSError, ValueError):
        return None


def test_status_lists_live_jobs_and_finished_ones_with_all(socket_dir):
    try:
        done = _run_job("finished-job", "print('bye')", socket_dir)
        out = done.communicate(timeout=240)[0]
        assert done.returncode == 0 and _job_state(socket_dir, "finished-job") == "done", out
        live = _run_job("live-job", "import time; time.sleep(600)", socket_dir)
        try:
            deadline = time.monotonic() + 120
            while _job_state(socket_dir, "live-job") != "running" and time.monotonic() < deadline:
                assert live.poll() is None, live.communicate()[0]
                time.sleep(0.1)
            assert _job_state(socket_dir, "live-job") == "running"
            human = _cli("status").stdout
            assert "job 'live-job': running" in human and "finished-job" not in human, human
            assert "1 finished or abandoned job(s) not shown: --all" in human, human
            st = json.loads(_cli("status", "--json").stdout)
            assert [j["namespace"] for j in st["jobs"]] == ["live-job"] and st["jobs_not_shown"] == 1
            every = _cli("status", "--all").stdout
            assert "job 'live-job': running" in every and "job 'finished-job': done" in every, every
        finally:
            live.terminate()                      # the supervisor stops its worker and records "stopped"
            live.communicate(timeout=120)
        assert "live-job" not in _cli("status").stdout
        assert "job 'live-job': stopped" in _cli("status", "--all").stdout

        stale = _run_job("stale-job", "import time; time.sleep(600)", socket_dir)   # its supervisor will be killed
        try:
            deadline = time.monotonic() + 120
            while _job_state(socket_dir, "stale-job") != "running" and time.monotonic() < deadline:
                time.sleep(0.1)
            stale.kill()
            stale.wait(60)
        finally:
            with open(os.path.join(socket_dir, "jobs", "stale-job.json")) as f:
                for rank in json.load(f)["ranks"].values():
                    try:
                        os.kill(rank["pid"], signal.SIGKILL)
                    except (ProcessLookupError, KeyError, TypeError):
                        pass
            stale.communicate(timeout=60)           # the worker held the output pipe open
        assert _job_state(socket_dir, "stale-job") == "running"       # what the record still says
        assert "stale-job" not in _cli("status").stdout
        assert "job 'stale-job': running (supervisor gone)" in _cli("status", "--all").stdout
    finally:
        _cli("stop", check=False)   # the daemons the supervisors started


STEPPER = """
import sys, torch, gpu_anchor
from gpu_anchor.train import AnchoredOptimizer
with gpu_anchor.managed_scope(namespace="stepping", require=True):
    model = torch.nn.Linear(4, 4)
    opt = AnchoredOptimizer(torch.optim.AdamW(model.parameters()), model=model)
for _ in range(int(sys.argv[1])):
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
"""


def test_status_says_where_training_stands(host_daemon):
    """Per namespace, each training protocol's position as its next worker would resume
    (``training_state``), killed inside a step too."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    ran = preloaded.run([sys.executable, "-c", STEPPER, "3"], env=env, timeout=120)
    assert ran.returncode == 0, ran.stderr
    assert "training ('train'): 3 step(s) completed" in _cli("status").stdout
    killed = preloaded.run([sys.executable, "-c", STEPPER, "5"], env={**env, "GPU_ANCHOR_TRAIN_FAULT": "after_boundary@4"},
                           timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    out = _cli("status").stdout
    assert "training ('train'): 4 step(s) completed and one in flight (chunk 0 of 1)" in out, out
    doc = json.loads(_cli("status", "--json").stdout)
    assert doc["daemons"][0]["namespaces"]["stepping"]["training"]["train"]["completed_steps"] == 5
