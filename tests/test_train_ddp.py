"""DDP (gloo, 2 CPU ranks): one rank SIGKILLed, the group restarted torchrun-style.

Each rank anchors in its own namespace of the host daemon; after every campaign the
two ranks' anchored state equals the fault-free run's, bit for bit, and so do the
per-rank loss trajectories.  A plain-PyTorch DDP run gives the same losses too.
"""
import random

import pytest

import gpu_anchor
from gpu_anchor.testing import campaign as C
from gpu_anchor.testing import ddp_campaign as D


@pytest.fixture
def ddp_reference(host_daemon, references, tmp_path_factory):
    """The fault-free group, once per session (conftest's ``references``)."""
    cfg = C.CampaignConfig(steps=8)
    res = references.get("ddp", lambda: D.run_group("dref", cfg, str(tmp_path_factory.mktemp("dref"))))
    return cfg, dict(res, ref_client=references.connect)


def _same_as_reference(ns, ref_ns, res, ref):
    for r in range(2):
        assert C.trajectory(res["logs"][r])[0] == C.trajectory(ref["logs"][r])[0], f"rank {r} losses"
        a = ref.get("ref_client", lambda n: gpu_anchor.connect("cpu", namespace=n))(f"{ref_ns}/rank{r}")
        b = gpu_anchor.connect("cpu", namespace=f"{ns}/rank{r}")
        assert C.compare(a, b) == [], f"rank {r} state"
        # a rank that had finished prints its digest again when a peer's death restarts the group
        assert set(C.digests(res["logs"][r])) == set(C.digests(ref["logs"][r])) != set()


def test_reference_matches_plain_ddp(ddp_reference, tmp_path):
    cfg, ref = ddp_reference
    plain = D.run_group("plain", cfg, str(tmp_path), plain=True)
    for r in range(2):
        losses = C.trajectory(ref["logs"][r])[0]
        assert losses == C.trajectory(plain["logs"][r])[0]
        assert len(set(losses.values())) == cfg.steps      # it does train
    a0, a1 = ref["ref_client"]("dref/rank0"), ref["ref_client"]("dref/rank1")
    assert C.compare(a0, a1, skip_prefixes=("train.undo.", "train.progress", "train.grad.")) == []   # replicas agree


def test_one_rank_killed_at_each_phase(ddp_reference, tmp_path):
    cfg, ref = ddp_reference
    specs = [(1, "mid_chunk@1:1"), (0, "before_boundary@2"), (1, "after_update@3:0"), (0, "after_commit@4:2"),
             (1, "between_steps@5"), (1, "before_update@6:0")]
    res = D.run_group("dk", cfg, str(tmp_path), faults_seq=specs)
    assert res["kills"] == len(specs)
    _same_as_reference("dk", "dref", res, ref)


def test_first_step_one_rank_past_its_boundary_the_other_fresh(ddp_reference, tmp_path):
    """Killed in the first step with rank 1's boundary committed and rank 0's not: rank 0's
    journal is fresh, rank 1's has step 0 in flight.  Both must join the agreement (rank 1
    discards the step, nobody wrote a chunk of it) — a fresh rank that skipped it left its
    peer alone in the all-gather, and the group failed the same way at every restart."""
    cfg, ref = ddp_reference
    specs = [[(0, "before_boundary@0"), (1, "after_boundary@0")], [(1, "before_boundary@0"), (0, "after_boundary@0")]]
    res = D.run_group("dfirst", cfg, str(tmp_path), faults_seq=specs)
    assert res["kills"] == 2
    _same_as_reference("dfirst", "dref", res, ref)


def test_random_rank_kills(ddp_reference, tmp_path):
    cfg, ref = ddp_reference
    rng = random.Random(7)
    total = 0
    for attempt in range(20):
        d = tmp_path / str(attempt)
        d.mkdir()
        res = D.run_group(f"dr{attempt}", cfg, str(d), random_kills=4, max_delay_s=ref["wall_s"], rng=rng)
        _same_as_reference(f"dr{attempt}", "dref", res, ref)
        total += res["kills"]
        if total >= 8:
            break
    print(f"DDP random: {total} rank kills in {attempt + 1} runs")
    assert total >= 8


def test_device_progress_ranks_a_boundary_apart(host_daemon, tmp_path):
    """Device-progress mode: a rank's journal lags its own progress by up to one step, so when
    rank 0 dies just before committing a boundary, rank 1 may already have committed it (and
    landed the previous step) while rank 0 has not landed that step yet.  The group must still
    agree: rank 0 lands the step its word shows written, rank 1 discards the announced one.
    First, the first-step case in this mode: rank 0 fresh, rank 1's boundary committed but its
    word never published (so no device began the step: rank 1 discards it)."""
    cfg = C.CampaignConfig(steps=8, progress="device")
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    ref = D.run_group("dpref", cfg, str(ref_dir))
    specs = [[(0, "before_boundary@0"), (1, "after_boundary@0")],
             (0, "before_boundary@2"), (1, "between_steps@3"), (0, "after_update@4:1"), (0, "before_boundary@6")]
    res = D.run_group("dpk", cfg, str(tmp_path), faults_seq=specs)
    assert res["kills"] == len(specs)
    _same_as_reference("dpk", "dpref", res, ref)
