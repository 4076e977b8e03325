"""SIGKILL the training worker at every protocol point and at random instants.

Every run ends compared with a fault-free run of the same seed: every anchored
object (parameters, optimizer state, gradients) bit for bit, the loss of every step
bit for bit (a replayed iteration must log the same bits), and the carried loop state.
``GA_TRAIN_KILLS`` scales the random campaign (default 200).
"""
import os
import random

import pytest

import gpu_anchor
from gpu_anchor.testing import campaign as C

KILLS = int(os.environ.get("GA_TRAIN_KILLS", "200"))


@pytest.fixture
def reference(host_daemon, references, tmp_path_factory):
    """The fault-free run of a configuration, once per session (conftest's ``references``)."""
    def get(cfg):
        k = (cfg.optimizer, cfg.flavour, cfg.steps, cfg.chunk_bytes, cfg.progress, cfg.scope)
        ns = "ref-" + "-".join(map(str, k))

        def run():
            res = C.run(ns, cfg, str(tmp_path_factory.mktemp("ref") / f"{ns}.log"))
            return (references.connect(ns), *C.trajectory(res.log), res.wall_s)
        return references.get(("train_faults", k), run)
    return get


def _check(reference, cfg, ns, res):
    ref_client, ref_losses, ref_done, _ = reference(cfg)
    losses, done = C.trajectory(res.log)
    assert losses == ref_losses
    assert done == ref_done                     # same samples counter, same completed steps
    assert C.compare(ref_client, gpu_anchor.connect("cpu", namespace=ns)) == []


@pytest.mark.parametrize("progress", ["journal", "device"])
@pytest.mark.parametrize("phase", ["before_update", "mid_chunk", "after_update", "after_commit"])
def test_each_phase_at_every_chunk(reference, tmp_path, phase, progress):
    cfg = C.CampaignConfig(steps=10, progress=progress)
    n = C.num_chunks(cfg)
    assert n >= 3
    specs = [f"{phase}@{1 + c}:{c}" for c in range(n)]
    ns = f"phase-{phase}-{progress}"
    client = gpu_anchor.connect("cpu", namespace=ns)
    res = C.run(ns, cfg, str(tmp_path / "log"), faults_seq=specs, client=client)
    assert res.kills == n
    if phase != "after_commit":
        assert res.in_flight_at_kill == n      # each kill left a step in flight ...
        if progress == "journal":
            assert res.rollbacks == n          # ... whose chunk came back from the undo slot
    _check(reference, cfg, ns, res)


def test_between_steps_and_before_boundary(reference, tmp_path):
    cfg = C.CampaignConfig(steps=10)
    specs = ["between_steps@0", "before_boundary@2", "between_steps@4", "before_boundary@6", "before_boundary@6",
             "before_boundary@9"]
    ns = "between"
    client = gpu_anchor.connect("cpu", namespace=ns)
    res = C.run(ns, cfg, str(tmp_path / "log"), faults_seq=specs, client=client)
    assert res.kills == len(specs) and res.in_flight_at_kill == 0
    _check(reference, cfg, ns, res)


@pytest.mark.parametrize("progress", ["journal", "device"])
def test_after_boundary(reference, tmp_path, progress):
    """Killed with the boundary (the redo log) committed and no chunk touched: journal mode
    finishes the step from it, device mode discards it (its word was never published)."""
    cfg = C.CampaignConfig(steps=6, progress=progress)
    specs = ["after_boundary@0", "after_boundary@3"]
    ns = f"afterb-{progress}"
    client = gpu_anchor.connect("cpu", namespace=ns)
    res = C.run(ns, cfg, str(tmp_path / "log"), faults_seq=specs, client=client)
    assert res.kills == len(specs) and res.in_flight_at_kill == len(specs)
    _check(reference, cfg, ns, res)


@pytest.mark.parametrize("progress", ["journal", "device"])
def test_killed_again_while_recovering(reference, tmp_path, progress):
    """The redo in the next worker's constructor is itself killed, at each of its points."""
    cfg = C.CampaignConfig(steps=8, progress=progress)
    n = C.num_chunks(cfg)
    specs = ["mid_chunk@3:0", "before_update@3:0", "mid_chunk@3:0", "after_update@3:1",
             f"mid_chunk@3:{n - 1}", f"after_update@3:{n - 1}", f"after_commit@3:{n - 1}"]
    ns = f"rerecover-{progress}"
    res = C.run(ns, cfg, str(tmp_path / "log"), faults_seq=specs)
    assert res.kills == len(specs)
    _check(reference, cfg, ns, res)


@pytest.mark.parametrize("name,flavour", [("sgd", "foreach"), ("adam", "single"), ("adamw", "fused")])
def test_other_optimizers_mid_chunk(reference, tmp_path, name, flavour):
    cfg = C.CampaignConfig(steps=6, optimizer=name, flavour=flavour)
    n = C.num_chunks(cfg)
    cfg.steps = n + 2
    specs = ["after_update@0:0"] + [f"mid_chunk@{1 + c}:{c}" for c in range(n)]
    ns = f"other-{name}-{flavour}"
    res = C.run(ns, cfg, str(tmp_path / "log"), faults_seq=specs)
    _check(reference, cfg, ns, res)


# campaigns above 100 kills run with the slow tests (`make test-all`)
@pytest.mark.parametrize("progress,kills", [("journal", min(100, KILLS)), ("device", min(100, KILLS // 2)),
                                            pytest.param("journal", KILLS, marks=pytest.mark.slow)])
def test_random_kill_campaign(reference, tmp_path, progress, kills):
    """>= 200 SIGKILLs at random instants (parent-timed, so anywhere: start-up, forward,
    backward, inside the protocol, inside recovery)."""
    cfg = C.CampaignConfig(steps=16, progress=progress)
    _, _, _, ref_wall = reference(cfg)
    rng = random.Random(20261130)
    total = in_flight = rollbacks = runs = 0
    while total < kills:
        ns = f"rand-{progress}-{runs}"
        client = gpu_anchor.connect("cpu", namespace=ns)
        res = C.run(ns, cfg, str(tmp_path / f"{ns}.log"), random_kills=min(25, kills - total),
                    max_delay_s=ref_wall * 0.8, rng=rng, client=client)
        _check(reference, cfg, ns, res)
        total += res.kills
        in_flight += res.in_flight_at_kill
        rollbacks += res.rollbacks
        runs += 1
        client.drop_namespace()
    print(f"random campaign ({progress}): {total} kills in {runs} runs, {in_flight} left a step in flight, "
          f"{rollbacks} needed the undo slot (journal mode)")
    assert total >= kills
    assert in_flight > 0                         # the campaign did reach inside the step


def test_under_managed_scope(reference, tmp_path):
    """The issue's usage: model and AnchoredOptimizer built inside managed_scope (the
    optimizer attaches when the scope has bound); killed at each phase and at random."""
    cfg = C.CampaignConfig(steps=10, scope=True)
    n = C.num_chunks(cfg)
    specs = ["mid_chunk@1:0", f"after_update@2:{n - 1}", "before_update@3:1", "after_commit@4:0",
             "between_steps@5", "before_boundary@7"]
    ns = "scoped"
    client = gpu_anchor.connect("cpu", namespace=ns)
    _, _, _, ref_wall = reference(cfg)
    res = C.run(ns, cfg, str(tmp_path / "log"), faults_seq=specs, random_kills=10, max_delay_s=ref_wall * 0.8,
                rng=random.Random(5), client=client)
    assert res.kills >= len(specs)
    _check(reference, cfg, ns, res)
    assert "model[0].weight" in client.names()       # the scope's names, the optimizer's next to them
