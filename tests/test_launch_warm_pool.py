"""The warm standby (``runtime.Standby``) with real processes, and ``gpu-anchor serve
--warm-pool``: engines SIGKILLed mid-stream are replaced by the standby, every stream's
text equal to the fault-free run."""
from __future__ import annotations

import json
import os
import random
import signal
import threading
import time

import pytest

from gpu_anchor.runtime import Standby, wait_exit
from gpu_anchor.testing.tiny import make_tiny_model
from test_serve_migration import SERVE, _get, serve_process
from test_launch_supervisor import job, result, run


# forked from pytest's process, which may run threads of earlier tests: these children run
# plain Python only (the fork rules themselves are tested in test_runtime.py, from clean processes)
PYTEST = "pytest process; the children touch no state of its other threads"


def test_standby_prepares_once_then_runs_the_handed_work(tmp_path):
    out = tmp_path / "out.json"

    def run(go):
        out.write_text(json.dumps({"go": go, "pid": os.getpid()}))

    sb = Standby(lambda: {"prepared": os.getpid()}, run, unsafe_ok=PYTEST)
    assert sb.ready(timeout=30) and sb.info["prepared"] == sb.pid
    assert not out.exists(), "nothing runs before go"
    pid = sb.go({"x": 1})
    status = wait_exit(pid, 30)
    assert status is not None and os.WIFEXITED(status[1]) and os.WEXITSTATUS(status[1]) == 0
    assert json.loads(out.read_text()) == {"go": {"x": 1}, "pid": pid}

    idle = Standby(lambda: None, run, unsafe_ok=PYTEST)
    assert idle.ready(timeout=30)
    idle.close()                                   # dismissed: killed and reaped, never runs
    assert json.loads(out.read_text())["pid"] == pid
    failing = Standby(lambda: 1 / 0, run, unsafe_ok=PYTEST)
    assert not failing.ready(timeout=30) and "failed" in failing.info
    failing.close()


def test_wait_exit_sees_a_sigkill_at_once():
    pid = os.fork()
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    t0 = time.perf_counter()
    assert wait_exit(pid, 0.05) is None
    os.kill(pid, signal.SIGKILL)
    r = wait_exit(pid, 10)
    assert r is not None and os.WIFSIGNALED(r[1]) and time.perf_counter() - t0 < 5




# --prewarm implies --warm-pool (the same standby, plus its scratch engine): the plain
# --warm-pool run is the same path minus the scratch engine, so it runs with `make test-all`
@pytest.mark.parametrize("flag", [pytest.param("--warm-pool", marks=pytest.mark.slow), "--prewarm"])
def test_serve_warm_pool_takes_over_after_sigkills(tmp_path, host_daemon, flag):
    """``--prewarm`` (implies the warm pool): the standby also ran a scratch engine first."""
    import openai

    from gpu_anchor.serve.engine import Engine, EngineConfig
    from gpu_anchor.serve.sequence import SamplingParams
    from gpu_anchor.serve.tokenizer import Codec
    model = make_tiny_model(str(tmp_path / "tiny-qwen3"), "qwen3", seed=3)
    rng = random.Random(2)
    words = "fox dog engine block cache hello world".split()
    jobs = [{"prompt": " ".join(rng.choice(words) for _ in range(rng.randint(2, 8))), "max_tokens": 80,
             "temperature": 0.0 if i % 2 == 0 else 0.9, "seed": i} for i in range(8)]
    codec = Codec(model, 384)
    ref = [codec.decode(o) for o in Engine(EngineConfig(model=model, anchor=False, dtype="float64", block_size=4,
                                                        num_blocks=600)).generate(
        [codec.encode(j["prompt"]) for j in jobs],
        [SamplingParams(max_tokens=j["max_tokens"], temperature=j["temperature"], seed=j["seed"]) for j in jobs])]
    from gpu_anchor.launch import jobstate

    def standby_ready(seen, timeout=120):
        """The job record's next standby (a pid not in ``seen``), once ready: made 2 s after an
        engine started (the first one or the one that took over), then its preparation (the
        scratch engine with --prewarm)."""
        deadline = time.time() + timeout
        while True:
            job = {j["namespace"]: j for j in jobstate.load_all()}.get("serve-tiny-qwen3") or {}
            sb = (job.get("standbys") or {}).get("0")
            if sb and sb["pid"] not in seen:
                seen.add(sb["pid"])
                return sb
            assert time.time() < deadline, "no standby became ready"
            time.sleep(0.05)

    with serve_process(tmp_path, model, "--socket", host_daemon[0], flag, *SERVE) as base:
        c = openai.OpenAI(base_url=base + "/v1", api_key="unused", timeout=300, max_retries=0)
        standbys = set()
        first = standby_ready(standbys)    # before the streams: the first kill finds it
        got, kills = [None] * len(jobs), []

        def run(i):
            got[i] = "".join(ch.choices[0].text for ch in c.completions.create(model="tiny-qwen3", stream=True,
                                                                               **jobs[i]))
        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
        for t in threads:
            t.start()
        for k in range(2):
            sb = first if k == 0 else standby_ready(standbys)
            assert "failed" not in sb, sb
            time.sleep(0.4)
            h = _get(base + "/health")
            if h.get("engine_pid"):
                os.kill(h["engine_pid"], signal.SIGKILL)
                kills.append(h["engine_pid"])
        for t in threads:
            t.join(300)
        assert got == ref
        deadline = time.time() + 120       # the last kill's recovery is counted once its engine serves
        while (h := _get(base + "/health")).get("engine_restarts", 0) < len(kills) and time.time() < deadline:
            time.sleep(0.05)
        assert h["engine_restarts"] == len(kills) >= 1 and h["token_mismatches"] == 0
        assert h["last_recovery"]["warm_standby"] == 1, h["last_recovery"]


# --prewarm implies --warm-pool: test_run_prewarm_runs_in_each_standby_before_it_takes_over runs
# the same standbys (plus the pre-warm call) with the same kills and checks the same things
@pytest.mark.slow
def test_run_warm_pool_standby_takes_over_after_worker_kills(reference, clean_daemons, tmp_path):
    """``gpu-anchor run --warm-pool``: after each chaos SIGKILL a standby worker (made
    before the kill) runs the rank; the run ends bit-identical to the fault-free one."""
    import torch
    run(str(tmp_path), ["--warm-pool", "--chaos-kills", "2", "--chaos-kill-every", "1.5", "--chaos-seed", "4",
                        "--max-restarts", "3"], ["--out", "r.pt", "--step-sleep", "0.05"])
    assert torch.equal(result(tmp_path / "r.pt"), reference[1])
    rs = job(clean_daemons)["restarts"]
    assert len(rs) == 2 and all(r["action"] == "restart" for r in rs)
    # a kill sooner than STANDBY_AFTER_S after the last take-over finds no standby: a fork
    hows = [r["how"] for r in rs]
    assert "warm standby" in hows and set(hows) <= {"warm standby", "warm (forked)"}, rs


PREWARM_MODULE = '''
import os, time
def mark(device):
    with open(os.environ["PREWARM_MARKS"], "a") as f:
        f.write(f"{os.getpid()} {device} {time.time()}\\n")
'''


def test_run_prewarm_runs_in_each_standby_before_it_takes_over(reference, clean_daemons, tmp_path):
    """``gpu-anchor run --prewarm MOD:FN`` (implies --warm-pool): every standby calls FN(device)
    before it is ready; a standby that took over had run it; the run stays bit-identical."""
    import torch
    (tmp_path / "prewarm_probe.py").write_text(PREWARM_MODULE)
    marks = tmp_path / "marks.txt"
    run(str(tmp_path), ["--prewarm", "prewarm_probe:mark", "--chaos-kills", "2", "--chaos-kill-every", "1.5",
                        "--chaos-seed", "4", "--max-restarts", "3"], ["--out", "r.pt", "--step-sleep", "0.05"],
        env={"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}".rstrip(os.pathsep)
             + os.pathsep + os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
             "PREWARM_MARKS": str(marks)})
    assert torch.equal(result(tmp_path / "r.pt"), reference[1])
    rs = job(clean_daemons)["restarts"]
    assert len(rs) == 2 and all(r["action"] == "restart" for r in rs), rs
    # a kill sooner than STANDBY_AFTER_S after the last take-over finds no standby: a fork
    hows = [r["how"] for r in rs]
    assert "warm standby" in hows and set(hows) <= {"warm standby", "warm (forked)"}, rs
    lines = marks.read_text().split()
    assert len(lines) >= 3 and lines[1] == "cpu", lines    # pid, the device it was given, time


def test_prewarm_spec_is_checked_before_anything_starts(tmp_path):
    from gpu_anchor.runtime.warm import check_prewarm_spec
    assert check_prewarm_spec("pkg.mod:fn") == "pkg.mod:fn"
    for bad in ("mod", "mod:", ":fn", "mod:fn-x"):
        try:
            check_prewarm_spec(bad)
        except ValueError as e:
            assert "MODULE:FUNCTION" in str(e) and repr(bad) in str(e)
        else:
            raise AssertionError(f"{bad!r} accepted")
    p = run(str(tmp_path), ["--prewarm", "nocolon"], check=False)
    assert p.returncode == 2 and "MODULE:FUNCTION" in p.stderr


@pytest.mark.parametrize("kind", ["qwen3", "llama", "qwen2"])
def test_serving_prewarm_runs_a_one_layer_scratch_engine(tmp_path, kind):
    from gpu_anchor.serve.engine import EngineConfig
    from gpu_anchor.serve.model_runner import load_config
    from gpu_anchor.serve.prewarm import scratch_config, warm_engine
    model = make_tiny_model(str(tmp_path / kind), kind, seed=3)
    cfg = EngineConfig(model=model, max_num_seqs=8, block_size=4, num_blocks=100, namespace="live")
    assert warm_engine(cfg)["engine_prewarm_s"] > 0
    sc = scratch_config(cfg, model)
    assert not sc.anchor and sc.random_weights and sc.cuda_graphs is False and sc.namespace is None
    assert sc.num_blocks * sc.block_size >= sc.max_num_seqs * (cfg.block_size + 4)   # room for every sequence
    assert load_config(model).num_hidden_layers > 1                                 # the live model is untouched


def test_status_shows_each_ranks_standby():
    from gpu_anchor.launch.jobstate import format_jobs
    job = {"namespace": "j", "state": "running", "supervisor_alive": True, "nproc": 2, "devices": ["cuda:0"],
           "warm": True, "restarts": [], "command": ["python", "t.py"], "ranks": {"0": {"pid": 5, "how": "warm"}},
           "standbys": {"0": {"pid": 7, "prewarm_s": 1.5}, "1": {"pid": 8, "failed": "ValueError: x"}}}
    text = format_jobs([job])
    assert "standby for rank 0: pid 7, ready (pre-warmed in 1.50 s)" in text
    assert "standby for rank 1: pid 8, failed to prepare: ValueError: x" in text
    job["standbys"] = {"0": {"pid": 7, "hot": True, "attach_s": 0.5, "device_bytes": 3 << 29}}
    assert "pid 7, ready, hot: attached to the engine's state in 0.50 s, holds 1.50 GiB of the device" in \
        format_jobs([job])
