"""The fused steps' protocol on a CPU, in one process, under DDP and FSDP2: cursor from the tags,
rollback of tagged blocks, kills while a recovery redoes a chunk, a step begun fused and
finished by copies.

The kernel runs only on CUDA; here ``fused_emulation`` stands in for it (block by block: undo,
tag, new values), so the protocol code of fused steps runs in CI.  Every run ends compared with
a fault-free run under the same stand-in, bit for bit.  The kernel and the same kills on the GPU:
``tests/test_train_fused_adam.py``, ``tests/test_train_gpu.py``.
"""
import random

import pytest

import gpu_anchor
from gpu_anchor.testing import campaign as C
from gpu_anchor.train import fused_adam
from gpu_anchor.train.protocol import decode_progress

from fused_emulation import emulated

pytestmark = pytest.mark.usefixtures("host_daemon")
PHASES = ("before_update", "mid_chunk", "after_update", "after_commit")


def _check(ref_ns, ref, ns, res):
    assert C.trajectory(res.log) == C.trajectory(ref.log)
    assert C.compare(gpu_anchor.connect("cpu", namespace=ref_ns), gpu_anchor.connect("cpu", namespace=ns)) == []


def _tagged_steps(ns) -> set:
    """The steps whose blocks the (emulated) fused update tagged, read from the anchored tags."""
    from gpu_anchor.client.mapping import torch_dtype
    client = gpu_anchor.connect("cpu", namespace=ns)
    info = client.objects()["train.undo.tags"]
    tags = client.lookup("train.undo.tags", info.shape, torch_dtype(info.dtype))
    return {decode_progress(t)[0] for t in tags.flatten().tolist() if t >= 0}


def test_each_phase_at_every_chunk_and_again_while_recovering(monkeypatch, tmp_path):
    emulated(monkeypatch)
    cfg = C.CampaignConfig(steps=8, progress="device")
    n = C.num_chunks(cfg)
    assert n >= 3
    cfg.steps = n + 4
    ref = C.run("fused-ref", cfg, str(tmp_path / "ref.log"))
    assert _tagged_steps("fused-ref") == {cfg.steps - 1}      # the stand-in ran: the last step tagged all
    # the four phases of chunk c in step 1 + c, each while the previous kill is being recovered
    specs = (["after_boundary@0"] + [f"{ph}@{1 + c}:{c}" for c in range(n) for ph in PHASES]
             + [f"between_steps@{n + 1}", f"before_boundary@{n + 2}"])
    res = C.run("fused-run", cfg, str(tmp_path / "run.log"), faults_seq=specs)
    assert res.kills == len(specs)
    _check("fused-ref", ref, "fused-run", res)


def test_random_kills(monkeypatch, tmp_path):
    """40 SIGKILLs at random instants: between any two stores of the stand-in too."""
    emulated(monkeypatch)
    cfg = C.CampaignConfig(steps=10, progress="device")
    ref = C.run("fused-rand-ref", cfg, str(tmp_path / "ref.log"))
    rng = random.Random(20261203)
    kills = in_flight = runs = 0
    while kills < 40:
        ns = f"fused-rand-{runs}"
        client = gpu_anchor.connect("cpu", namespace=ns)
        res = C.run(ns, cfg, str(tmp_path / f"{ns}.log"), random_kills=40 - kills, max_delay_s=ref.wall_s * 0.8,
                    rng=rng, client=client)
        _check("fused-rand-ref", ref, ns, res)
        kills, in_flight, runs = kills + res.kills, in_flight + res.in_flight_at_kill, runs + 1
        client.drop_namespace()
    assert in_flight > 0


@pytest.mark.parametrize("second", [None, "before_update@3:1", "mid_chunk@3:1", "after_commit@3:1",
                                    "after_update@3:2"])
def test_a_step_begun_fused_is_finished_by_copies(monkeypatch, tmp_path, second):
    """A worker that cannot run the kernel rolls the chunk back by its tags, saves it whole,
    moves the word to it and finishes the step by copies — and a kill right after that switch
    (``second``) ends where the same switch without it does."""
    emulated(monkeypatch)
    cfg = C.CampaignConfig(steps=6, progress="device")
    assert C.num_chunks(cfg) >= 3
    C.prewarm(cfg)
    runs = {}
    for name, faults in (("switch-ref", []), (f"switch-{second}", [second] if second else [])):
        log = str(tmp_path / f"{name}.log")
        assert C._wait(C._child(C.train, name, cfg, log, "mid_chunk@3:1")) == -9    # fused, killed in chunk 1
        with monkeypatch.context() as m:
            m.setattr(fused_adam, "unavailable_reason", lambda d: "no kernel here (test)")
            runs[name] = C.run(name, cfg, log, faults_seq=faults)
        assert runs[name].kills == len(faults)
        assert max(_tagged_steps(name)) == 3          # steps 3 (its first chunks) and on: copies
    if second:
        _check("switch-ref", runs["switch-ref"], f"switch-{second}", runs[f"switch-{second}"])


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_ranks_fused_steps_a_rank_killed_at_each_phase(monkeypatch, tmp_path, parallel):
    """DDP or FSDP2 (gloo, two forked CPU ranks) with fused steps: one rank killed at a chunk
    phase, its peer killed with it (torchrun-style), each rank's cursor read from its own tags;
    both ranks end bit for bit where the fault-free group does."""
    from gpu_anchor.testing import ddp_campaign as D
    emulated(monkeypatch)
    cfg = C.CampaignConfig(steps=8, progress="device")
    (tmp_path / "ref").mkdir()
    ref = D.run_group(f"{parallel}fref", cfg, str(tmp_path / "ref"), parallel=parallel)
    specs = [(1, "mid_chunk@1:1"), (0, "after_update@2:0"), (1, "after_commit@3:1"), (0, "before_update@4:1"),
             [(0, "mid_chunk@5:0"), (1, "after_update@5:0")], (1, "between_steps@6")]
    res = D.run_group(f"{parallel}fk", cfg, str(tmp_path), faults_seq=specs, parallel=parallel)
    assert res["kills"] == len(specs)
    for r in range(2):
        assert C.trajectory(res["logs"][r])[0] == C.trajectory(ref["logs"][r])[0], f"rank {r} losses"
        assert C.compare(gpu_anchor.connect("cpu", namespace=f"{parallel}fref/rank{r}"),
                         gpu_anchor.connect("cpu", namespace=f"{parallel}fk/rank{r}")) == [], f"rank {r} state"
        assert _tagged_steps(f"{parallel}fk/rank{r}") == {cfg.steps - 1}        # fused to the end
