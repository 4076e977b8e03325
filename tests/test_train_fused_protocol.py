"""The fused steps' protocol on a CPU, in one process, under DDP and FSDP2: cursor from the tags,
restore of the blocks in flight from the undo ring, kills while a recovery redoes a chunk, a
step begun fused finished by the kernel only.

The kernel runs only on CUDA; here ``fused_emulation`` stands in for it (program by program,
block by block: ring slot, started tag, new values; a finished tag after a program's last
block), so the protocol code of fused steps runs in CI.  Every run ends compared with
a fault-free run under the same stand-in, bit for bit.  The kernel and the same kills on the GPU:
``tests/test_train_fused_adam.py``, ``tests/test_train_gpu.py``.
"""
import dataclasses
import random

import pytest
import torch

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
    return {decode_progress(d[0])[0] for d in map(fused_adam.decode_tag, tags.flatten().tolist()) if d is not None}


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
    total = C.random_kill_runs("fused-rand", cfg, str(tmp_path), ref, "fused-rand-ref", 40, random.Random(20261203),
                               check=lambda ns, res: _check("fused-rand-ref", ref, ns, res))
    assert total.in_flight_at_kill > 0


def test_a_step_begun_fused_is_finished_by_the_kernel_only(monkeypatch, tmp_path):
    """Its written blocks have no undo image, so a step begun fused is finished by the kernel:
    a worker that cannot run it refuses at attach, saying why, and changes nothing; a worker
    whose fused switch is off finishes that step by the kernel and the next ones by copies;
    both end bit for bit where the fault-free run does."""
    from gpu_anchor.train.config import StepProtocolConfig
    emulated(monkeypatch)
    cfg = C.CampaignConfig(steps=6, progress="device")
    assert C.num_chunks(cfg) >= 3
    C.prewarm(cfg)
    off = lambda c: StepProtocolConfig(chunk_bytes=c.chunk_bytes, progress=c.progress, fused_update=False)  # noqa: E731
    C.run("need-ref", dataclasses.replace(cfg, steps=5), str(tmp_path / "ref.log"))     # steps 0-4 fused,
    with monkeypatch.context() as m:                                                    # 5 by copies
        m.setattr(C, "_protocol", off)
        ref = C.run("need-ref", cfg, str(tmp_path / "ref.log"))
    log = str(tmp_path / "run.log")
    assert C._wait(C._child(C.train, "need", cfg, log, "mid_chunk@3:1")) == -9    # fused, killed in chunk 1
    with monkeypatch.context() as m:
        m.setattr(fused_adam, "unavailable_reason", lambda d: "no kernel here (test)")
        with pytest.raises(RuntimeError, match="begun by the fused update and this worker cannot run it"):
            C.train("need", cfg, log)
    assert C._wait(C._child(C.train, "need", cfg, log, "mid_chunk@4:0")) == -9    # the kernel finishes it
    with monkeypatch.context() as m:
        m.setattr(C, "_protocol", off)
        res = C.run("need", cfg, log)
    assert max(_tagged_steps("need")) == 4         # step 4 begun fused, finished by the kernel; 5 by copies
    _check("need-ref", ref, "need", res)


def test_a_step_in_flight_from_the_chunk_sized_undo_is_refused(monkeypatch, tmp_path):
    """A step in flight whose boundary says it was saved by the earlier fused update (an undo
    image of the whole chunk, ``"undo": "fused"``) is refused with an error that says what to
    do, and nothing anchored changes: restoring the record lets a worker finish it bit for bit."""
    import json
    from gpu_anchor.train.protocol import key
    emulated(monkeypatch)
    cfg = C.CampaignConfig(steps=5, progress="device")
    C.prewarm(cfg)
    ref = C.run("old-ref", cfg, str(tmp_path / "ref.log"))
    log = str(tmp_path / "run.log")
    assert C._wait(C._child(C.train, "old", cfg, log, "mid_chunk@2:1")) == -9
    client = gpu_anchor.connect("cpu", namespace="old")
    record = client.journal.get(key("train", "boundary"))
    assert json.loads(record)["undo"] == "ring"
    client.journal.commit({key("train", "boundary"): json.dumps(dict(json.loads(record), undo="fused")).encode()})
    with pytest.raises(RuntimeError, match="another version's fused update .*finish it with that version"):
        C.train("old", cfg, log)
    client.journal.commit({key("train", "boundary"): record})
    _check("old-ref", ref, "old", C.run("old", cfg, log))


def _slot_bytes(ns) -> int:
    return gpu_anchor.connect("cpu", namespace=ns).objects()["train.undo.0"].shape[0]


def test_undo_slots_hold_the_ring_alone_and_grow_for_a_copy_step(monkeypatch, tmp_path):
    """Where steps are expected fused, the undo slots hold the ring alone (two ring slots per
    program and launch; the last chunk spans both parameter groups: two launches).  A worker
    whose kernel does not reproduce torch saves by copies: its first step grows the slots to a
    chunk's image, and a kill in a copy step after that is finished from them.  The run ends
    bit for bit where a fault-free run with the same fused and copy steps does."""
    emulated(monkeypatch)
    monkeypatch.setattr(C, "HIDDEN", 256)                     # chunks larger than the ring
    monkeypatch.setattr(fused_adam, "RING_MIN_BYTES", 2 * fused_adam.RING_STRIDE)
    cfg = C.CampaignConfig(steps=7, progress="device", chunk_bytes=256 << 10)
    assert C.num_chunks(cfg) == 4
    ring = fused_adam.ring_slot_bytes(2, torch.device("cpu"))
    chunk = 261888                    # the largest chunk's p, exp_avg, exp_avg_sq (fp32)
    assert ring < chunk
    no_kernel = lambda key, hp, device: None  # noqa: E731  (verification fails here)
    C.run("grow-ref", dataclasses.replace(cfg, steps=3), str(tmp_path / "ref.log"))
    assert _slot_bytes("grow-ref") == ring
    with monkeypatch.context() as m:
        m.setattr(fused_adam, "verified", no_kernel)
        ref = C.run("grow-ref", cfg, str(tmp_path / "ref.log"))
    assert _slot_bytes("grow-ref") == chunk

    log = str(tmp_path / "run.log")
    assert C._wait(C._child(C.train, "grow", cfg, log, "mid_chunk@1:3")) == -9      # fused, in the 2-launch chunk
    assert C._wait(C._child(C.train, "grow", cfg, log, "between_steps@2")) == -9    # steps 0-2 fused
    assert _slot_bytes("grow") == ring and max(_tagged_steps("grow")) == 2
    with monkeypatch.context() as m:
        m.setattr(fused_adam, "verified", no_kernel)
        assert C._wait(C._child(C.train, "grow", cfg, log, "mid_chunk@4:2")) == -9  # grown at step 3
        assert _slot_bytes("grow") == chunk
        res = C.run("grow", cfg, log)
    assert max(_tagged_steps("grow")) == 2
    _check("grow-ref", ref, "grow", res)


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
