"""The supervisor's bookkeeping without processes: decision table, crash loops,
command parsing, chaos scheduling, checkpoint completeness."""
from __future__ import annotations

import json
import os
import signal

import pytest

from gpu_anchor.checkpoint import format as snapshot_paths
from gpu_anchor.launch import classify, jobstate
from gpu_anchor.launch.chaos import Chaos
from gpu_anchor.launch.classify import Exit, Observation, decide
from gpu_anchor.launch.supervisor import split_python

KILLED = Exit(0, signal=signal.SIGKILL)


def obs(**kw):
    base = dict(exits=(KILLED,), group_size=1, have_checkpoint=True)
    base.update(kw)
    return Observation(**base)


def test_all_ranks_exit_zero_is_done():
    assert decide(obs(exits=(Exit(0, 0), Exit(1, 0)), group_size=2)).action == "done"


@pytest.mark.parametrize("first", [KILLED, Exit(1, signal=signal.SIGSEGV), Exit(0, code=1), Exit(0, code=137)])
def test_worker_death_with_everything_intact_is_shallow(first):
    d = decide(obs(exits=(first, Exit(1, signal=signal.SIGKILL)), group_size=2))
    assert (d.action, d.kind) == ("restart", "shallow")
    assert f"rank {first.rank}" in d.reason and "in place" in d.reason


def test_unknown_device_health_still_restarts_in_place_and_says_so():
    d = decide(obs(device_healthy=None))
    assert d.action == "restart" and "unknown" in d.reason


@pytest.mark.parametrize("kw,why", [
    (dict(daemons_alive=False), "not answering"),
    (dict(daemons_same=False), "replaced"),
    (dict(device_healthy=False, device_problem="GPU 0: 2 new uncorrectable ECC error(s)"), "ECC"),
    (dict(journal_consistent=False, journal_problem="marked inconsistent"), "inconsistent"),
])
def test_destructive_or_unsure_restores_the_checkpoint(kw, why):
    d = decide(obs(**kw))
    assert (d.action, d.kind) == ("restore", "destructive")
    assert why in d.reason


def test_destructive_without_checkpoint_stops_with_advice():
    d = decide(obs(daemons_alive=False, have_checkpoint=False))
    assert d.action == "stop" and "--checkpoint-dir" in d.reason


def test_dead_daemon_outranks_its_journal():
    # a dead daemon cannot be read: the journal verdict must not matter
    d = decide(obs(daemons_alive=False, journal_consistent=False))
    assert "inconsistent" not in d.reason and d.action == "restore"


def test_budget_and_crash_loop_stop():
    assert decide(obs(restarts_done=3, max_restarts=3)).action == "stop"
    d = decide(obs(crash_loop=True, crash_loop_detail="3 failures in a row at step 14 with exit1"))
    assert d.action == "stop" and "step 14" in d.reason and "rerun" in d.reason


def test_decide_needs_an_exit():
    with pytest.raises(ValueError):
        decide(obs(exits=()))


def test_exit_from_returncode():
    assert Exit.from_status(2, -9) == Exit(2, signal=9)
    assert Exit.from_status(0, 3).describe() == "rank 0 exited with code 3"
    assert "SIGKILL" in Exit.from_status(1, -9).describe()


def test_crash_loop_counts_same_point_in_a_row():
    c = classify.CrashLoop(3)
    assert not c.record(14, "exit1") and not c.record(14, "exit1")
    assert c.record(14, "exit1") and "step 14" in c.detail()
    c.reset()
    assert not c.record(14, "exit1")
    assert not c.record(15, "exit1")      # progress: a new point
    assert not c.record(15, "sig9")       # another way of dying
    assert not classify.CrashLoop(0).record(1, "x")  # 0 = never


def test_split_python():
    assert split_python(["python", "-u", "t.py", "--lr", "3"]) [1] == ["t.py", "--lr", "3"]
    assert split_python(["python3.11", "-m", "pkg.train", "-x"])[1] == ["-m", "pkg.train", "-x"]
    assert split_python(["python", "-X", "dev", "-c", "print(1)"])[1] == ["-c", "print(1)"]
    assert split_python(["bash", "train.sh"]) is None
    assert split_python(["python", "--weird"]) is None
    assert split_python(["python"]) is None


def test_chaos_arms_only_after_progress_and_counts_down():
    c = Chaos(kills=2, every=0.001, seed=1)
    assert c.timeout() is None and c.fire({0: 2 ** 22 + 12345}, {}) is None   # not armed
    c.arm()
    assert c.timeout() is not None
    with pytest.raises(ValueError):
        Chaos(kills=1, every=0)
    with pytest.raises(ValueError):
        Chaos(target="gpu")


def _fake_rank(d, step, rank, world, committed=True, size_ok=True):
    rdir = os.path.join(snapshot_paths.step_dir(d, step), f"rank{rank}")
    os.makedirs(rdir, exist_ok=True)
    with open(os.path.join(rdir, "cpu.safetensors"), "wb") as f:
        f.write(b"x" * 16)
    man = {"step": step, "rank": rank, "world_size": world,
           "files": [{"file": "cpu.safetensors", "bytes": 16 if size_ok else 32}]}
    with open(os.path.join(rdir, "manifest.json"), "w") as f:
        json.dump(man, f)
    if committed:
        with open(os.path.join(rdir, "COMMITTED"), "w") as f:
            f.write(f"{step}\n")


def test_latest_complete_skips_torn_and_partial_steps(tmp_path):
    d = str(tmp_path)
    assert snapshot_paths.latest_complete(d, 2) is None
    for r in range(2):
        _fake_rank(d, 10, r, 2)
    _fake_rank(d, 20, 0, 2)
    _fake_rank(d, 20, 1, 2, committed=False)     # rank 1 died while writing
    _fake_rank(d, 30, 0, 2)
    _fake_rank(d, 30, 1, 2, size_ok=False)       # file shorter than its manifest says
    os.makedirs(snapshot_paths.step_dir(d, 40))  # nothing in it
    assert snapshot_paths.latest_complete(d, 2) == 10
    assert snapshot_paths.latest_complete(d, 1) is None            # every manifest says world 2
    assert snapshot_paths.latest_complete(d, 3) is None            # world size must match


def test_prune_keeps_newest_complete(tmp_path):
    d = str(tmp_path)
    for s in (5, 10, 15):
        _fake_rank(d, s, 0, 1)
    _fake_rank(d, 12, 0, 1, committed=False)
    _fake_rank(d, 20, 0, 1, committed=False)   # in flight: newer than the newest complete, kept
    snapshot_paths.prune(d, 1, keep=2)
    assert snapshot_paths.list_steps(d) == [10, 15, 20]


def test_jobstate_roundtrip_and_format(tmp_path, monkeypatch):
    monkeypatch.setenv("GPU_ANCHOR_SOCKET_DIR", str(tmp_path))
    js = jobstate.JobState("ns1", ["python", "t.py"], 2, ["cuda:0", "cuda:1"], True)
    js.set_ranks({0: {"pid": 11, "how": "warm (forked)"}, 1: {"pid": 12, "how": "warm (forked)"}})
    js.add_restart({"action": "restart", "kind": "shallow", "step": 7, "reason": "rank 1 killed by SIGKILL",
                    "recovery_s": 0.21})
    jobs = jobstate.load_all()
    assert len(jobs) == 1 and jobs[0]["restarts"][0]["step"] == 7 and jobs[0]["supervisor_alive"]
    text = jobstate.format_jobs(jobs)
    assert "restart 1: restart (shallow), step 7, 0.210 s" in text and "rank 1: pid 12" in text


def test_one_supervisor_per_namespace(tmp_path, monkeypatch):
    monkeypatch.setenv("GPU_ANCHOR_SOCKET_DIR", str(tmp_path))
    held = jobstate.lock("jobA")
    with pytest.raises(jobstate.JobBusy, match="already supervised"):
        jobstate.lock("jobA")
    other = jobstate.lock("jobB")
    held.close()
    jobstate.lock("jobA").close()
    other.close()
    assert len(jobstate.events_path("x" * 200).encode()) <= 100


class _FakeNVML:
    """Stands in for pynvml (absent on CPU machines) to drive DeviceHealth's bookkeeping."""
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC, NVML_FEATURE_ENABLED = 1, 0, 1

    class NVMLError(Exception):
        pass

    def __init__(self):
        self.ecc = {0: 0, 3: 0}
        self.lost = set()

    def nvmlInit(self):
        pass

    def nvmlDeviceGetHandleByIndex(self, i):
        if i in self.lost:
            raise self.NVMLError("GPU is lost")
        return i

    def nvmlDeviceGetHandleByUUID(self, u):
        return 3

    def nvmlDeviceGetMemoryInfo(self, h):
        return None

    def nvmlDeviceGetTotalEccErrors(self, h, kind, counter):
        return self.ecc[h]

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h):
        return 0


def test_device_health_from_nvml(monkeypatch):
    import sys
    from gpu_anchor.launch import health
    fake = _FakeNVML()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    dh = health.DeviceHealth([0])          # cuda:0 is NVML device 3 here
    assert dh.available and dh.check() == (True, "")
    fake.ecc[3] = 2
    ok, why = dh.check()
    assert ok is False and "2 new uncorrectable ECC" in why
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    fake.lost.add(0)
    ok, why = health.DeviceHealth([0]).check()
    assert ok is False and "NVML query failed" in why


def test_serving_crash_loop_counts_only_engines_that_fail_by_themselves_before_any_token():
    """``gpu-anchor serve``'s rule (launch/serve_state.EngineFailures): kills from outside and
    deaths after the state's loss never make a loop, however many in a row (the daemon SIGKILLed
    three times within seconds once stopped the server); engines failing at start-up do, but
    only after one on a fresh state failed too."""
    from gpu_anchor.launch.serve_state import EngineFailures
    built, ready, tokens = 0, 1, 2
    f = EngineFailures(3)
    for _ in range(5):      # the daemon killed under engines that had published tokens, or were starting
        assert f.record(tokens, "exit1", outside=False, destructive=True) == (False, False)
        assert f.record(built, "exit1", outside=False, destructive=True) == (False, False)
    for _ in range(5):      # SIGKILLs from outside, before any token
        assert f.record(built, "sig9", outside=True, destructive=False) == (False, False)
    # start-up crashes on a state not known fresh: restart, then restore first, then the loop
    assert f.record(built, "exit1", outside=False, destructive=False) == (False, False)
    assert f.record(ready, "exit1", outside=False, destructive=False) == (False, True)
    f.restored()
    assert f.record(built, "exit1", outside=False, destructive=False) == (True, False)
    assert "3 engines in a row" in f.detail()
    # after a restore the state is fresh: no second restore, straight to the loop
    g = EngineFailures(3)
    g.restored()
    assert [g.record(built, "exit1", False, False) for _ in range(3)] == [(False, False), (False, False), (True, False)]
    # progress in between resets the count (and the state is no longer known fresh)
    h = EngineFailures(3)
    h.restored()
    assert h.record(built, "exit1", False, False) == (False, False)
    assert h.record(tokens, "exit1", False, False) == (False, False)
    assert h.record(built, "exit1", False, False) == (False, False)
    assert h.record(built, "exit1", False, False) == (False, True)
    assert EngineFailures(0).record(built, "exit1", False, False)[0] is False      # --crash-loop 0: never
