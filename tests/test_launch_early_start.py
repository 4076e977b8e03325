"""Early start (gpu_anchor/launch/early_start.py): a failed worker's successor starts at the
worker's death, runs the user's code up to its start gate, and touches no anchored state
before the old process has exited and the supervisor decided to restart in place."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from gpu_anchor import fdwait
from gpu_anchor.client.gate import ENV as GATE_ENV, Gate
from gpu_anchor.runtime import liveness

from launch_reference import ROOT, STEPS

LINGER_JOB = os.path.join(ROOT, "tests", "linger_job.py")
pytestmark = pytest.mark.skipif(not liveness.available(), reason="needs glibc's robust mutexes")


def _child(code: str, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": ROOT, **env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _line(p: subprocess.Popen, timeout: float) -> str:
    if not fdwait.readable([p.stdout], timeout):
        return ""
    return p.stdout.readline().strip()


REQUESTER = """
import gpu_anchor
c = gpu_anchor.connect("cpu", namespace="gated")   # hello only: allowed before the gate opens
print("connected", flush=True)
c.journal.get("k")                                  # a request: waits for the gate
print("through", flush=True)
"""


def test_a_gated_client_sends_no_request_until_its_gate_opens(host_daemon, tmp_path):
    gate = Gate(str(tmp_path / "g"))
    try:
        p = _child(REQUESTER, {GATE_ENV: gate.path})
        assert _line(p, 60) == "connected", p.stderr.read() if p.poll() is not None else ""
        assert _line(p, 1.0) == ""          # held at the gate
        assert p.poll() is None
        gate.open()
        assert _line(p, 60) == "through"
        assert p.wait(30) == 0
    finally:
        gate.close()


def test_a_gate_closed_without_opening_ends_the_process_before_any_request(host_daemon, tmp_path):
    gate = Gate(str(tmp_path / "g"))
    p = _child(REQUESTER, {GATE_ENV: gate.path})
    assert _line(p, 60) == "connected"
    gate.close()                            # the supervisor dropped it (or died)
    assert p.wait(30) == 1
    assert "it exits before touching any anchored state" in p.stderr.read()
    assert "through" not in p.stdout.read()


HOLDER = """
import os, sys
from gpu_anchor.runtime import liveness
live = liveness.Liveness(liveness.shared_file(sys.argv[1]))
for w in range(liveness.WRITERS):
    live.hold(int(sys.argv[2]), w)
print("held", flush=True)
if sys.argv[3] == "release":
    for w in range(liveness.WRITERS):
        live.release(int(sys.argv[2]), w)
    print("released", flush=True)
sys.stdin.readline()
"""


@pytest.mark.parametrize("end", ["release", "kill"])
def test_the_watcher_tells_a_death_from_a_clean_end(tmp_path, end):
    path = str(tmp_path / "live")
    live = liveness.Liveness(liveness.shared_file(path, create=True))
    slot = live.arm()
    p = subprocess.Popen([sys.executable, "-c", HOLDER, path, str(slot), end], env={**os.environ, "PYTHONPATH": ROOT},
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    if end == "release":
        assert p.stdout.readline().strip() == "released"
        assert live.wait_writers(slot) == "released"    # returns while the process still lives
        assert p.poll() is None
        p.communicate("\n", timeout=30)
    else:
        p.send_signal(signal.SIGKILL)
        assert live.wait_writers(slot) == "died"
        p.wait(30)


def _run(tmp_path, opts, env) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "gpu_anchor.launch.cli", "run", "--device-type", "cpu", *opts, "--",
           sys.executable, LINGER_JOB, "--steps", str(STEPS), "--out", "r.pt", "--step-sleep", "0.01"]
    return subprocess.run(cmd, cwd=str(tmp_path), env={**os.environ, "PYTHONPATH": ROOT, **env},
                          capture_output=True, text=True, timeout=240)


def _job(socket_dir: str) -> dict:
    import json
    with open(os.path.join(socket_dir, "jobs", "job-linger_job.json")) as f:
        return json.load(f)


def _stamp(path) -> tuple[int, float]:
    pid, t = open(path).read().split()
    return int(pid), float(t)


def test_the_successor_runs_while_the_old_worker_lives_and_binds_after_its_exit(reference, clean_daemons,
                                                                                tmp_path):
    mark = str(tmp_path / "mark")
    p = _run(tmp_path, ["--max-restarts", "2"], {"LINGER_MARK": mark, "LINGER_AT_STEP": "30"})
    assert p.returncode == 0, p.stderr[-4000:]
    assert torch.equal(torch.load(tmp_path / "r.pt"), reference[1])    # bit-identical to a fault-free run
    (rec,) = _job(clean_daemons)["restarts"]
    assert (rec["action"], rec["kind"], rec.get("early")) == ("restart", "shallow", True), rec
    _, t_user_code = _stamp(f"{mark}.1")      # the successor's user code ran ...
    _, t_old_end = _stamp(f"{mark}.old")      # ... before the old process's end (it waited for it)
    assert rec["t_started"] < t_user_code < t_old_end <= rec["t_exit"]
    # its first request past hello (the bind at managed_scope's exit) came after the exit and the decision
    assert rec["t_exit"] <= rec["t_detect"] <= rec["t_gate"] <= rec["marks"]["0"]["bind"]
    assert "resuming at step" in p.stdout and "started early" in p.stderr


def test_a_decision_other_than_restart_drops_the_successor_at_its_gate(clean_daemons, tmp_path):
    mark = str(tmp_path / "mark")
    p = _run(tmp_path, ["--max-restarts", "0"], {"LINGER_MARK": mark, "LINGER_AT_STEP": "30"})
    assert p.returncode == 1 and "decision: STOP" in p.stderr, p.stderr[-4000:]
    assert "started early" in p.stderr                  # it did start ...
    pid, _ = _stamp(f"{mark}.1")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:                  # ... and is gone, killed at its gate
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the dropped early-started worker {pid} still runs")
    assert "resuming at step" not in p.stdout           # it never bound anything
    (rec,) = _job(clean_daemons)["restarts"]
    assert rec["action"] == "stop" and not rec.get("early")


def test_status_says_which_restart_started_early_and_reads_serving_records_too():
    from gpu_anchor.launch import jobstate
    base = {"namespace": "j", "state": "running", "supervisor_alive": True, "nproc": 1, "devices": ["cuda:0"],
            "warm": True, "command": ["python", "t.py"], "ranks": {}}
    train = dict(base, restarts=[{"action": "restart", "kind": "shallow", "step": 7, "recovery_s": 0.31,
                                  "reason": "killed", "early": True, "early_s": 0.1}])
    serve = dict(base, kind="serve", restarts=[{"action": "restart", "kind": "shallow", "step": None,
                                                "recovery_s": 0.05, "reason": "killed", "early": True}])
    text = jobstate.format_jobs([train, serve])
    assert "0.310 s to first step (started early, 100 ms before its gate opened)" in text
    assert "0.050 s to first step: killed" in text
