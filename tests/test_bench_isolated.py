"""``bench.common.run_isolated``: one method per fresh process, errors and hangs reported, not inherited."""
from __future__ import annotations

import os
import time

import pytest

from bench.common import run_isolated


def _pid_and_env(key):
    return os.getpid(), os.environ.get(key)


def _raise(msg):
    raise ValueError(msg)


def _die():
    os._exit(7)


def _child_pid_file(path):
    with open(path, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)


def test_fresh_process_sees_current_env():
    os.environ["BENCH_ISOLATED_PROBE"] = "one"
    try:
        pid1, v1 = run_isolated(_pid_and_env, "BENCH_ISOLATED_PROBE", timeout=120)
        os.environ["BENCH_ISOLATED_PROBE"] = "two"  # set after the fork server started
        pid2, v2 = run_isolated(_pid_and_env, "BENCH_ISOLATED_PROBE", timeout=120)
    finally:
        del os.environ["BENCH_ISOLATED_PROBE"]
    assert (v1, v2) == ("one", "two")
    assert len({pid1, pid2, os.getpid()}) == 3  # a new process per call


def test_errors_come_back_as_runtime_errors():
    with pytest.raises(RuntimeError, match="ValueError: boom"):
        run_isolated(_raise, "boom", timeout=120)
    with pytest.raises(RuntimeError, match="exit code 7"):
        run_isolated(_die, timeout=120)


def test_timeout_kills_the_child(tmp_path):
    path = tmp_path / "pid"
    run_isolated(_pid_and_env, "HOME", timeout=120)  # the fork server is up: the child starts at once
    with pytest.raises(TimeoutError):
        run_isolated(_child_pid_file, str(path), timeout=5)   # a fork of the running fork server
    pid = int(path.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
