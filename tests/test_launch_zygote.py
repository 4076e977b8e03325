"""The warm-worker server: forks repeatedly, each worker correct and isolated,
exits reported with their code or signal."""
from __future__ import annotations

import json
import os
import signal
import sys
import time

import pytest

from gpu_anchor.launch.zygote import Zygote

WORKER = r'''
import json, os, sys, torch
torch.manual_seed(int(os.environ["SEED"]))
a = torch.randn(64, 64, dtype=torch.float64)
out = {"pid": os.getpid(), "argv": sys.argv[1:], "cwd": os.getcwd(), "env": os.environ.get("MARK"),
       "sum": float((a @ a).sum()), "threads_ok": torch.get_num_threads() >= 1}
with open(os.environ["OUT"], "w") as f:
    json.dump(out, f)
code = int(os.environ.get("CODE", "0"))
if code == -1:
    import time; time.sleep(60)
sys.exit(code)
'''


def _wait_exit(z: Zygote, pid: int, timeout: float = 30.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for m in z.messages():
            if m["pid"] == pid:
                return m["status"]
        time.sleep(0.01)
    raise TimeoutError(pid)


@pytest.fixture(scope="module")
def zygote():
    """One server for the tests that fork workers from it: each waits for its own workers' exits."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    z = Zygote(sys.executable, ["torch"], env)
    yield z
    z.close()


def test_fork_server_is_single_threaded_python_and_preloaded(zygote):
    r = zygote.ready
    assert r["failed"] == {} and r["python_threads"] == 1 and r["preload_s"] > 0


def test_forks_repeatedly_and_workers_are_correct(zygote, tmp_path):
    import torch
    script = tmp_path / "w.py"
    script.write_text(WORKER)
    pids = set()
    for i in range(6):
        out = tmp_path / f"out{i}.json"
        env = {**os.environ, "SEED": str(i), "OUT": str(out), "MARK": f"m{i}", "CODE": str(i % 3)}
        pid = zygote.spawn([str(script), "--i", str(i)], env, str(tmp_path))
        assert _wait_exit(zygote, pid) == i % 3
        res = json.loads(out.read_text())
        torch.manual_seed(i)
        a = torch.randn(64, 64, dtype=torch.float64)
        assert res["sum"] == float((a @ a).sum())      # same maths as a fresh interpreter here
        assert res["argv"] == ["--i", str(i)] and res["env"] == f"m{i}" and res["cwd"] == str(tmp_path)
        assert res["pid"] == pid and pid != zygote.proc.pid
        pids.add(pid)
    assert len(pids) == 6


def test_kill_is_reported_as_a_signal_and_process_group_is_the_worker(zygote, tmp_path):
    script = tmp_path / "w.py"
    script.write_text(WORKER)
    env = {**os.environ, "SEED": "0", "OUT": str(tmp_path / "o.json"), "CODE": "-1"}
    pid = zygote.spawn([str(script)], env, str(tmp_path))
    deadline = time.monotonic() + 30
    while not (tmp_path / "o.json").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert os.getpgid(pid) == pid
    os.killpg(pid, signal.SIGKILL)
    assert _wait_exit(zygote, pid) == -signal.SIGKILL


def test_exception_in_user_code_exits_1_with_traceback(zygote, tmp_path, capfd):
    script = tmp_path / "bad.py"
    script.write_text("raise ValueError('boom')\n")
    pid = zygote.spawn([str(script)], dict(os.environ), str(tmp_path))
    assert _wait_exit(zygote, pid) == 1


def test_module_target(zygote, tmp_path):
    out = tmp_path / "m.txt"
    pid = zygote.spawn(["-c", f"import sys; open({str(out)!r}, 'w').write(' '.join(sys.argv))", "a", "b"],
                       dict(os.environ), str(tmp_path))
    assert _wait_exit(zygote, pid) == 0
    assert out.read_text() == "-c a b"


def test_a_dead_server_is_reported_with_how_it_ended():
    z = Zygote(sys.executable, ["json"], dict(os.environ))
    try:
        os.kill(z.proc.pid, signal.SIGKILL)
        z.proc.wait(10)
        with pytest.raises(RuntimeError, match=r"warm-worker server exited \(killed by signal 9\)"):
            z.messages()
        with pytest.raises(RuntimeError, match="killed by signal 9"):
            z.spawn([sys.executable, "-c", "pass"], dict(os.environ), os.getcwd())
    finally:
        z.sock.close()


PREWARM = r'''
import os
def mark(device):
    with open(os.environ["PREWARM_OUT"], "w") as f:
        f.write(f"{os.getpid()} {device} {os.environ.get('MARK')}")
'''


def test_a_standby_asked_for_prepares_in_its_env_then_runs_the_handed_target(tmp_path):
    """The benchmarks' standby is the product's (``runtime.Standby`` in this server): made on
    request, it reports ``standby_ready`` with what its preparation did (the pre-warm ran in the
    environment it was given), runs nothing before ``go``, then runs the target as a worker."""
    (tmp_path / "prewarm_mod.py").write_text(PREWARM)
    script = tmp_path / "w.py"
    script.write_text(WORKER)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=f"{root}{os.pathsep}{tmp_path}", PREWARM_OUT=str(tmp_path / "prewarm.txt"),
               MARK="from-standby-env", SEED="3", OUT=str(tmp_path / "out.json"))
    zygote = Zygote(sys.executable, ["torch"], env)     # the pre-warm module is on its path
    try:
        _standby_round_trip(zygote, env, script, tmp_path)
    finally:
        zygote.close()


def _standby_round_trip(zygote, env, script, tmp_path):
    sid = zygote.standby("cpu", env, prewarm="prewarm_mod:mark")
    ready = zygote.wait_standby(sid, timeout=60)
    pid, info = ready["pid"], ready["info"]
    assert info["prewarm"] == "prewarm_mod:mark" and info["prewarm_s"] >= 0 and info["pid"] == pid
    assert (tmp_path / "prewarm.txt").read_text() == f"{pid} cpu from-standby-env"
    assert not (tmp_path / "out.json").exists(), "nothing runs before go"
    assert zygote.go(sid, [str(script), "x"], dict(env, MARK="at-go"), str(tmp_path)) == pid
    assert _wait_exit(zygote, pid) == 0
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["pid"] == pid and out["env"] == "at-go" and out["argv"] == ["x"]

    failing = zygote.standby("cpu", env, prewarm="prewarm_mod:no_such_function")
    with pytest.raises(RuntimeError, match="failed to prepare"):
        zygote.wait_standby(failing, timeout=60)
    with pytest.raises(RuntimeError, match="could not take over"):
        zygote.go(failing, [str(script)], env, str(tmp_path))
    idle = zygote.standby("cpu", env)
    idle_pid = zygote.wait_standby(idle, timeout=60)["pid"]
    zygote.dismiss(idle)                       # killed and reaped by the server
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(idle_pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"dismissed standby {idle_pid} still runs")


def test_standby_default_is_on_for_gpu_jobs_and_off_for_cpu_jobs(monkeypatch):
    from gpu_anchor.launch.config import WarmStart, resolve_standby
    monkeypatch.delenv("GPU_ANCHOR_WARM_POOL", raising=False)
    assert WarmStart().standby is None
    assert resolve_standby(WarmStart(), ["cuda:0", "cuda:1"]) is True
    assert resolve_standby(WarmStart(), ["cpu"]) is False
    assert resolve_standby(WarmStart(standby=False), ["cuda:0"]) is False
    assert resolve_standby(WarmStart(standby=True), ["cpu"]) is True
    assert resolve_standby(WarmStart(prewarm="m:f"), ["cpu"]) is True        # the pre-warm runs in a standby
    assert resolve_standby(WarmStart(enabled=False, standby=True), ["cuda:0"]) is False   # --cold: nothing to fork
    monkeypatch.setenv("GPU_ANCHOR_WARM_POOL", "0")
    assert resolve_standby(WarmStart(), ["cuda:0"]) is False
    monkeypatch.setenv("GPU_ANCHOR_WARM_POOL", "1")
    assert resolve_standby(WarmStart(), ["cpu"]) is True
