"""The benchmark's baselines and harness are correct: SIGKILLed runs end where fault-free runs end.

Training: every checkpoint baseline (and gpu-anchor through the same harness) trains a toy
Llama on CPU while the test SIGKILLs its worker — once right after a checkpoint step
(mid-save for the synchronous ones) and once at an arbitrary step — and restarts it; the
final parameters and optimizer state must equal a fault-free run's bit for bit.
Inference: Replay, KV-memory and gpu-anchor serve a toy model while the engine is
SIGKILLed mid-run; every request's tokens must equal a fault-free run's (greedy).
Workers are forked from gpu-anchor's fork server, as in the benchmarks.
"""
from __future__ import annotations

import os
import random
import shutil
import tempfile

import pytest
import torch

from bench.baselines import standby
from bench.baselines.launcher import EventLog, Launcher
from bench.common import private_daemon

STEPS, EVERY = 12, 3


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    """``({"warm": Launcher}, work dir)``: the benchmarks' launchers, whose warm one a test may
    replace (``launcher.revive``); every test takes the one there now."""
    work = str(tmp_path_factory.mktemp("bench-baselines"))
    with private_daemon("cpu"):
        launchers = {"warm": Launcher(True, work)}
        try:
            yield launchers, work
        finally:
            launchers["warm"].close()


def _train(harness, method, kills=()):
    launchers, work = harness
    lau = launchers["warm"]
    d = tempfile.mkdtemp(prefix=f"tb-{method}-", dir="/dev/shm" if method == "inmemory" else work)
    evfile = os.path.join(work, f"{method}-{len(kills)}-{random.getrandbits(32)}.events")
    dump = evfile + ".pt"
    args = ["--method", method, "--tiny", "--device", "cpu", "--dir", d, "--events", evfile, "--total", str(STEPS),
            "--ckpt-every", str(EVERY), "--batch", "2", "--seq", "16", "--dump", dump,
            "--namespace", f"tb-{os.path.basename(evfile)}"]
    log = EventLog(evfile)
    try:
        # each worker waits to be killed after its kill step: a fast run cannot outrun the kill
        pause = [["--pause-at-step", str(k)] for k in kills] + [[]]
        pid = lau.spawn(args + pause[0])
        for i, k in enumerate(kills):
            log.wait(lambda e: e["ev"] == "paused" and e["pid"] == pid, lambda: lau.alive(pid), 120)
            lau.kill(pid)
            pid = lau.spawn(args + pause[i + 1])
        log.wait(lambda e: e["ev"] == "done" and e["pid"] == pid, lambda: lau.alive(pid), 120)
        lau.wait_exit(pid, 60)
        return torch.load(dump), log.events
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _same(a: dict, b: dict) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k], b[k])]


@pytest.fixture(scope="module")
def reference(harness):
    return _train(harness, "torch_save")[0]


@pytest.mark.parametrize("method", ["torch_save", "checkfreq", "inmemory", "dcp_async"])
def test_training_baseline_survives_sigkill(harness, reference, method):
    kills = [EVERY, random.Random(method).randrange(EVERY + 1, STEPS - 1)]
    got, evs = _train(harness, method, kills)
    assert not _same(got, reference), f"{method}: state after SIGKILLs differs from the fault-free run"
    restored = [e["step"] for e in evs if e["ev"] == "restored"]
    assert len(restored) == 3 and all(s % EVERY == 0 for s in restored), restored
    assert restored[1] <= kills[0] and restored[2] <= kills[1], restored
    if method in ("torch_save", "inmemory"):  # synchronous: the checkpoint before the kill is durable
        assert restored[2] >= EVERY, restored


def test_gpu_anchor_through_the_harness_survives_sigkill(harness):
    ref, _ = _train(harness, "gpu_anchor")
    got, evs = _train(harness, "gpu_anchor", [4, 9])
    assert not _same(got, ref), "gpu-anchor: state after SIGKILLs differs from its fault-free run"
    restored = [e["step"] for e in evs if e["ev"] == "restored"]
    assert restored[0] == 0 and restored[1] >= 4 and restored[2] >= 9, restored  # no completed step lost


def test_fault_free_baselines_agree(harness, reference):
    got, _ = _train(harness, "inmemory")
    assert not _same(got, reference)


# ---------------------------------------------------------------- inference

@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from gpu_anchor.testing.tiny import make_tiny_model
    return make_tiny_model(str(tmp_path_factory.mktemp("serve-model")), family="qwen3")


def _serve(harness, model_dir, method, kill_after_steps=None, prewarm_standby=False, device="cpu"):
    from bench.recovery_serve import next_request
    launchers, work = harness
    lau = launchers["warm"]
    state = tempfile.mkdtemp(prefix=f"ts-{method}-", dir="/dev/shm")
    evfile = os.path.join(work, f"serve-{method}-{random.getrandbits(32)}.events")
    log = EventLog(evfile)

    def args(nxt, pause=None):
        return (["--pause-after-steps", str(pause)] if pause else []) + ["--method", method, "--model-dir", model_dir, "--device", device, "--dtype", "float32",
                "--state-dir", state, "--events", evfile, "--concurrency", "4", "--requests", "10",
                "--next-request", str(nxt), "--num-blocks", "128", "--max-batched-tokens", "256", "--tiny",
                "--record-tokens", "--namespace", f"ts-{os.path.basename(evfile)}"]
    mod = "bench.baselines.server"
    try:
        pid = lau.spawn(args(0, kill_after_steps), mod)
        ready = None
        if kill_after_steps is not None:
            if prewarm_standby:  # the next engine is started, and runs its scratch engine, before the fault
                from bench.baselines.server import PREWARM_ENV
                sid, ready = standby.start(lau, device, "bench.baselines.server:prewarm",
                                           standby.prewarm_env(PREWARM_ENV, args(0)), timeout=120)
            # the worker stops at a step with every slot busy once kill_after_steps are done: the kill
            # always lands with requests in flight, however fast the run goes
            log.wait(lambda e: e["ev"] == "paused" and e["pid"] == pid, lambda: lau.alive(pid), 120)
            lau.kill(pid)
            log.poll()
            if prewarm_standby:
                pid = standby.release(lau, sid, args(next_request(log.events)), mod)
                assert pid == ready["pid"]
            else:
                pid = lau.spawn(args(next_request(log.events)), mod)
        log.wait(lambda e: e["ev"] == "done" and e["pid"] == pid, lambda: lau.alive(pid), 180)
        out: dict[str, dict[int, int]] = {}
        for e in log.events:
            for rid, i, toks in e.get("toks", ()):
                for j, t in enumerate(toks):
                    out.setdefault(rid, {})[i + j] = t
        return {r: [d[i] for i in sorted(d)] for r, d in out.items()}, log.events, ready
    finally:
        shutil.rmtree(state, ignore_errors=True)


@pytest.mark.parametrize("method,prewarm_standby", [("kv_memory", False), ("replay", False), ("gpu_anchor", False),
                                                    ("kv_memory", True), ("gpu_anchor", True)])
def test_serving_method_survives_sigkill(harness, tiny_model, method, prewarm_standby):
    """... also when a pre-warmed standby takes over (its scratch engine must leave the state alone)."""
    ref, _, _ = _serve(harness, tiny_model, method)
    got, evs, ready = _serve(harness, tiny_model, method, kill_after_steps=6, prewarm_standby=prewarm_standby)
    assert set(got) == set(ref) and len(ref) == 10
    assert got == ref, f"{method}: tokens after a SIGKILL differ from the fault-free run"
    eng = [e for e in evs if e["ev"] == "engine"]
    assert len(eng) == 2 and eng[1]["restored"] > 0
    assert any(e["ev"] == "resumed" for e in evs)
    if method == "gpu_anchor":
        assert eng[1]["weights_loaded"] is False
    else:
        assert "weights_load_s" in eng[1]["timings"]  # baselines reload weights from safetensors
    if method == "kv_memory":
        tm = eng[1]["timings"]
        assert "kv_copy_back_s" in tm and not eng[1]["notes"]  # resumed on the copied KV
        assert 0 < tm["kv_blocks_restored"] < tm["kv_blocks_total"] == 128   # the live blocks only
    if prewarm_standby:  # the fork server's standby (runtime.Standby) ran the scratch engine before the fault
        assert ready["info"]["engine_prewarm_s"] > 0 and ready["info"]["prewarm"] == "bench.baselines.server:prewarm"


@pytest.mark.gpu
@pytest.mark.parametrize("prewarm_standby", [False, True])
def test_kv_memory_on_cuda_survives_sigkill(harness, tiny_model, prewarm_standby):
    """KV-memory's GPU path: the per-step mirror on its own stream, landed before each commit, and
    the pipelined copy-back of the live blocks; tokens equal a fault-free run on the same GPU."""
    ref, _, _ = _serve(harness, tiny_model, "kv_memory", device="cuda:0")
    got, evs, _ = _serve(harness, tiny_model, "kv_memory", kill_after_steps=6, prewarm_standby=prewarm_standby,
                         device="cuda:0")
    assert got == ref
    tm = [e for e in evs if e["ev"] == "engine"][1]["timings"]
    assert 0 < tm["kv_blocks_restored"] < tm["kv_blocks_total"]


def test_fault_schedule_and_workload_are_seeded():
    from bench.baselines.server import workload
    from bench.e2e_faults import fault_times
    a, b = fault_times(0.01, 7, 1e6), fault_times(0.01, 7, 1e6)
    assert a == b and a == sorted(a) and fault_times(0.01, 8, 1e6) != a
    assert 0.9e4 < len(a) < 1.1e4            # rate × horizon, Poisson
    assert fault_times(0.0, 7, 1e6) == []
    w = workload(0, 2000, 1000)
    assert w == workload(0, 2000, 1000) and w != workload(1, 2000, 1000)
    plen = sorted(len(p) for p, _ in w)
    olen = sorted(o for _, o in w)
    assert 8 <= plen[0] and plen[-1] <= 2048 and 8 <= olen[0] and olen[-1] <= 1024
    assert 120 < plen[len(plen) // 2] < 260 and 100 < olen[len(olen) // 2] < 220   # ShareGPT-like medians
    assert plen[int(0.99 * len(plen))] > 3 * plen[len(plen) // 2]                 # a long tail


def test_goodput_accounting():
    from bench.e2e_faults import summarise
    rows = [{"method": "inmemory", "wall_s": 130.0, "step_dts": [0.1] * 1000, "lost_steps": 50,
             "ckpt_blocking_s": 5.0, "recovery_s": 10.0},
            {"method": "gpu_anchor", "wall_s": 110.0, "step_dts": [0.102] * 1000, "lost_steps": 0,
             "ckpt_blocking_s": 0.0, "recovery_s": 6.0}]
    out = summarise(rows, 1000)
    assert "step_dts" in rows[0]                              # the raw rows stay usable for the next summary
    base, anc = rows = out
    assert base["ref_step_s"] == anc["ref_step_s"] == 0.1   # the plain optimizer's step, from baselines only
    assert abs(base["goodput"] - 100 / 130) < 1e-12 and abs(anc["goodput"] - 100 / 110) < 1e-12
    assert abs(base["recompute_s"] - 5.0) < 1e-9 and abs(anc["slower_steps_s"] - 2.0) < 1e-9
    for r in rows:  # the parts add up to the waste
        parts = r["ckpt_blocking_s"] + r["recovery_s"] + r["recompute_s"] + r["slower_steps_s"] + r["other_s"]
        assert abs(parts - r["wasted_s"]) < 1e-9


def test_recovery_intervals_do_not_overlap_when_a_kill_lands_during_recovery():
    from bench.e2e_faults import recovery_and_recomputed
    steps = [{"t": t, "step": n} for t, n in [(1, 1), (2, 2), (3, 3), (9, 2), (10, 3), (11, 4)]]
    rec, recomputed = recovery_and_recomputed(steps, [3.5, 6.0])   # the 2nd kill before any step
    assert rec == [2.5, 3.0]                    # 3.5 -> 6.0 (killed again), 6.0 -> 9.0 (next step)
    assert recomputed == 2                      # steps 2 and 3 ran twice
    assert recovery_and_recomputed(steps, []) == ([], 2)


@pytest.mark.slow     # a whole benchmark scenario end to end (issue 18: at most three in `make test`)
def test_recovery_train_supervised_standby_rows(tmp_path, monkeypatch):
    """`recovery_train --modes standby,prewarm --supervised warm_pool,prewarm,default`: every
    method's worker is released from a standby the fork server made before the kill (the
    prewarm one ran a scratch step first: ``runtime.Standby``, as in the product), and each of
    gpu-anchor run's kills is taken over by its own warm standby; each lands in the mode of the
    same name.  Without flags, `gpu-anchor run` on a CPU job forks (standbys are the GPU default)."""
    import json
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, GPU_ANCHOR_SOCKET_DIR=str(tmp_path / "sock"), CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=root)
    p = subprocess.run([sys.executable, "-m", "bench", "recovery_train", "--tiny", "--methods", "inmemory,gpu_anchor",
                        "--modes", "standby,prewarm", "--supervised", "warm_pool,prewarm,default", "--out",
                        str(tmp_path)],
                       cwd=root, env=env, capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = {r["method"]: r["modes"] for r in
            json.load(open(tmp_path / "recovery_train_tiny.json"))["models"]["llama3.2-1b"]}
    assert set(rows) == {"inmemory", "gpu_anchor", "gpu_anchor_run_warm_pool", "gpu_anchor_run_prewarm",
                         "gpu_anchor_run_default"}
    for meth in ("inmemory", "gpu_anchor"):
        for mode in ("standby", "prewarm"):
            t = rows[meth][mode]["trials"][0]
            assert 0 <= t["go_s"] < t["total_s"] and "imports_s" not in t
            assert (t["prewarm_s"] is not None) == (mode == "prewarm")
        lost = rows[meth]["prewarm"]["trials"][0]["lost_steps"]
        assert lost == 0 if meth == "gpu_anchor" else lost >= 1
    assert list(rows["gpu_anchor_run_warm_pool"]) == ["standby"] and list(rows["gpu_anchor_run_prewarm"]) == ["prewarm"]
    for sup in ("gpu_anchor_run_warm_pool", "gpu_anchor_run_prewarm"):
        trials = next(iter(rows[sup].values()))["trials"]
        assert [t["how"] for t in trials] == ["warm standby"] and trials[0]["lost_steps"] == 0
    assert list(rows["gpu_anchor_run_default"]) == ["warm"]
    assert rows["gpu_anchor_run_default"]["warm"]["trials"][0]["how"] == "warm (forked)"
    result = json.load(open(tmp_path / "recovery_train_tiny.json"))
    assert all(r["fault_free_step_s"] for r in result["models"]["llama3.2-1b"])   # the protocol's throughput row
    from bench import common
    from bench.recovery_train import render
    monkeypatch.setattr(common, "IMG_DIR", str(tmp_path / "img"))     # its plot must not land in docs/img
    text = render(result)
    assert "vs strongest baseline" in text and "Strongest baseline per mode" in text and "fault-free" in text
    bad = subprocess.run([sys.executable, "-m", "bench", "recovery_train", "--tiny", "--supervised", "nope"],
                         cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "unknown --supervised variant" in bad.stderr


def test_a_dead_fork_server_is_replaced_and_the_next_method_runs(harness, reference):
    """A recovery bench keeps its later methods' figures when its warm fork server dies
    (on the H200 one exited under the 14B serving bench); how it ended is recorded.  The
    module's own launcher is the one killed: the later tests run on its replacement."""
    from bench.baselines.launcher import revive
    launchers, work = harness
    assert revive(launchers, work) is None
    old = launchers["warm"]
    old.zygote.proc.kill()
    old.zygote.proc.wait()
    assert revive(launchers, work) == "killed by signal 9"
    assert launchers["warm"] is not old
    got, _ = _train(harness, "torch_save")
    assert not _same(got, reference), "the replacement fork server's run differs from the fault-free run"
