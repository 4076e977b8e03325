"""FSDP2 (gloo, 2 CPU ranks, ``fully_shard`` per Linear + root): kills and group restarts.

Each rank anchors its own parameter shards (``anchor_fsdp``), gradients and optimizer
state in its own namespace of the host daemon.  After every campaign each rank's
anchored state equals the fault-free run's bit for bit, and so do the per-rank loss
trajectories; the fault-free anchored run gives plain FSDP2's losses.
"""
import random
import warnings
from datetime import timedelta

import pytest
import torch

import gpu_anchor
from gpu_anchor.testing import campaign as C
from gpu_anchor.testing import ddp_campaign as D
from gpu_anchor.train.config import StepProtocolConfig
from test_train_ddp import _same_as_reference as ddp_check   # same per-rank comparison


@pytest.fixture
def fsdp_reference(host_daemon, references, tmp_path_factory):
    """The fault-free group, once per session (conftest's ``references``)."""
    cfg = C.CampaignConfig(steps=8)
    res = references.get("fsdp", lambda: D.run_group("fref", cfg, str(tmp_path_factory.mktemp("fref")),
                                                      parallel="fsdp"))
    return cfg, dict(res, ref_client=references.connect)


def _same_as_reference(ns, res, ref):
    ddp_check(ns, "fref", res, ref)


def test_reference_matches_plain_fsdp_and_shards_differ(fsdp_reference, tmp_path):
    cfg, ref = fsdp_reference
    plain = D.run_group("plain", cfg, str(tmp_path), parallel="fsdp", plain=True)
    for r in range(2):
        losses = C.trajectory(ref["logs"][r])[0]
        assert losses == C.trajectory(plain["logs"][r])[0]
        assert len(set(losses.values())) == cfg.steps
    objs = ref["ref_client"]("fref/rank0").objects()
    w = objs["model.0.weight"]          # Linear(24, 48): 48 rows sharded over 2 ranks
    assert tuple(w.shape) == (24, 24)
    assert C.digests(ref["logs"][0]) != C.digests(ref["logs"][1])     # each rank holds its own shard


def test_one_rank_killed_at_each_phase(fsdp_reference, tmp_path):
    cfg, ref = fsdp_reference
    specs = [(1, "mid_chunk@1:1"), (0, "before_boundary@2"), (1, "after_update@3:0"), (0, "after_commit@4:1"),
             (1, "between_steps@5"), (0, "before_update@6:0")]
    res = D.run_group("fk", cfg, str(tmp_path), faults_seq=specs, parallel="fsdp")
    assert res["kills"] == len(specs)
    _same_as_reference("fk", res, ref)


def test_first_step_one_rank_past_its_boundary_the_other_fresh(fsdp_reference, tmp_path):
    """The state an all-rank kill once left in CI (the group then failed at every restart):
    rank 0 never committed its first boundary, rank 1 did (see ``test_train_ddp``'s twin)."""
    cfg, ref = fsdp_reference
    res = D.run_group("ffirst", cfg, str(tmp_path), faults_seq=[[(0, "before_boundary@0"), (1, "after_boundary@0")]],
                      parallel="fsdp")
    assert res["kills"] == 1
    _same_as_reference("ffirst", res, ref)


@pytest.mark.parametrize("kill_all", [False, True], ids=["one-rank", "all-ranks"])
def test_random_kills(fsdp_reference, tmp_path, kill_all):
    cfg, ref = fsdp_reference
    rng = random.Random(11 + kill_all)
    total = 0
    for attempt in range(20):
        d = tmp_path / str(attempt)
        d.mkdir()
        ns = f"fr{int(kill_all)}-{attempt}"
        res = D.run_group(ns, cfg, str(d), random_kills=4, max_delay_s=ref["wall_s"], rng=rng, parallel="fsdp",
                          kill_all=kill_all)
        _same_as_reference(ns, res, ref)
        total += res["kills"]
        if total >= 8:
            break
    print(f"FSDP2 random ({'all ranks' if kill_all else 'one rank'}): {total} kills in {attempt + 1} runs")
    assert total >= 8


def _zero_copy_worker(store):
    import torch.distributed as dist

    from gpu_anchor.train import AnchoredOptimizer
    from gpu_anchor.train.fsdp import anchor_fsdp, local
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    client = gpu_anchor.connect("cpu", namespace="zc")
    model = C.build_model(1)
    D.shard(model, torch.device("cpu"), 1)
    anchor_fsdp(model, client)
    # asked for, gradient lending and gradients written in place say they do nothing under FSDP2
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        opt = AnchoredOptimizer(torch.optim.AdamW(model.parameters()), model=model, client=client,
                                config=StepProtocolConfig(lend_grad_bytes=1 << 30, grads_in_place=True))
    said = [str(w.message) for w in said if issubclass(w.category, RuntimeWarning)]
    assert any("lend_grad_bytes lends nothing here: under DDP / FSDP2" in m for m in said), said
    assert any("grads_in_place writes no gradient in place here: under DDP / FSDP2" in m for m in said), said
    assert opt.lender is None
    ptrs = {n: local(p).data_ptr() for n, p in model.named_parameters()}
    for step in range(2):
        x, y = C.batch(step, 1)
        torch.nn.functional.mse_loss(model(x), y).backward()
        for n, p in model.named_parameters():
            # FSDP2 accumulated the reduce-scattered shard into the anchored buffer: no copy
            assert local(p.grad).data_ptr() == opt._params[[q.name for q in opt._params].index(n)].grad.data_ptr()
            assert local(p).data_ptr() == ptrs[n]           # the shard stayed in anchored memory
        opt.step()
        opt.zero_grad()
    assert opt._grads.stats == {"in_place": 0, "copied": 0, "modules": 0}    # FSDP2 wrote them all
    anchored = {b.name: b.tensor.data_ptr() for b in client.bind(
        [(f"model.{n}", tuple(local(p).shape), local(p).dtype) for n, p in model.named_parameters()], "lookup")}
    assert all(anchored[f"model.{n}"] == ptrs[n] for n in ptrs)
    # state_dict: DTensors over the anchored shards (as FSDP2's own optimizer state is);
    # loading it back goes through torch's casts and lands in the same anchored memory
    sd = opt.state_dict()
    st = sd["state"][0]
    p0 = next(model.parameters())
    assert type(st["exp_avg"]) is type(p0) and st["exp_avg"].placements == p0.placements
    assert local(st["exp_avg"]).data_ptr() == opt._params[0].states["exp_avg"].data_ptr()
    before = {k: v.clone() for k, v in opt._params[0].states.items()}
    opt.load_state_dict(sd)
    assert all(torch.equal(before[k], v) for k, v in opt._params[0].states.items())
    assert opt._params[0].states["exp_avg"].data_ptr() == local(st["exp_avg"]).data_ptr()
    dist.destroy_process_group()


def test_shards_and_gradients_live_in_anchored_memory(host_daemon, tmp_path):
    C.prewarm(C.CampaignConfig())
    pid = C._child(_zero_copy_worker, str(tmp_path / "store"))
    assert C._wait(pid) == 0


def _dcp_worker(rank, store, ckpt, helpers):
    """One of two FSDP2 ranks: 3 steps, ``dcp.save``; then, as after a daemon's state is lost, a
    new model and optimizer in fresh namespaces, ``dcp.load``: the step count, the schedule and
    every shard come back, and two more steps match the first optimizer's.  ``helpers``:
    ``"tutorial"``, saved and loaded as PyTorch's DCP tutorial writes it (a ``Stateful`` calling
    ``get_state_dict`` / ``set_state_dict``), flattened as torchtitan saves; ``"full"``, one
    consolidated file (``full_state_dict`` and ``cpu_offload``, ``torch.save`` on rank 0, read by
    every rank); else ``model.state_dict()`` and ``opt.state_dict()``
    themselves with ``dcp.save`` / ``dcp.load``, loaded with ``load_state_dict``."""
    import os

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from gpu_anchor.train import AnchoredOptimizer
    from gpu_anchor.train.fsdp import anchor_fsdp, local
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))

    def build(ns):
        client = gpu_anchor.connect("cpu", namespace=f"{ns}/rank{rank}")
        model = C.build_model(1)
        D.shard(model, torch.device("cpu"), 2)
        anchor_fsdp(model, client)
        inner = C.build_optimizer(model, C.CampaignConfig())
        return model, AnchoredOptimizer(inner, model=model, client=client,
                                        schedulers=[torch.optim.lr_scheduler.LambdaLR(inner, C.warmup)])

    def steps(model, opt, at):
        for step in at:
            x, y = C.batch(step, rank)
            torch.manual_seed(step * 2 + rank)      # the model's dropout
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    model, opt = build(f"dcp-a{helpers}")
    steps(model, opt, range(3))
    if helpers == "full":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
        msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            torch.save({"model": msd, "optim": osd}, ckpt)
        dist.barrier()
        model2, opt2 = build(f"dcp-b{helpers}")
        sd = torch.load(ckpt, weights_only=True)     # each rank keeps its part
        set_state_dict(model2, opt2, model_state_dict=sd["model"], optim_state_dict=sd["optim"],
                       options=StateDictOptions(full_state_dict=True))
    elif helpers:
        from test_train_checkpoints import AppState
        dcp.save({"app": AppState(model, opt, flatten=True)}, checkpoint_id=ckpt)
        model2, opt2 = build(f"dcp-b{helpers}")
        dcp.load({"app": AppState(model2, opt2, flatten=True)}, checkpoint_id=ckpt)
    else:
        dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=ckpt)
        model2, opt2 = build(f"dcp-b{helpers}")
        sd = {"model": model2.state_dict(), "optim": opt2.state_dict()}
        dcp.load(sd, checkpoint_id=ckpt)
        model2.load_state_dict(sd["model"])
        opt2.load_state_dict(sd["optim"])
    assert opt2.completed_steps == 3 and opt2.schedulers.items[0].last_epoch == 3
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    steps(model, opt, range(3, 5))
    steps(model2, opt2, range(3, 5))
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(local(a), local(b))
    for q, q2 in zip(opt._params, opt2._params):
        assert all(torch.equal(q.states[k], q2.states[k]) for k in q.states)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("helpers", ["", "tutorial", "full"], ids=["state_dicts", "tutorial_helpers", "full_state_dict"])
def test_dcp_save_and_load_of_its_state_dict_restore_the_job(host_daemon, tmp_path, helpers):
    """``torch.distributed.checkpoint`` as FSDP2 jobs checkpoint (``dcp.save`` / ``dcp.load``
    of the model's and the optimizer's state dicts, DTensors over the anchored shards, or through
    DCP's ``get_state_dict`` / ``set_state_dict``, or one consolidated ``full_state_dict`` file)
    on two ranks, restored into fresh namespaces (``_dcp_worker``)."""
    C.prewarm(C.CampaignConfig())
    pids = [C._child(_dcp_worker, r, str(tmp_path / "store"), str(tmp_path / "ckpt"), helpers) for r in range(2)]
    assert [C._wait(pid) for pid in pids] == [0, 0]


def test_anchor_fsdp_refuses_an_unsharded_model(host_daemon):
    from gpu_anchor.train.fsdp import anchor_fsdp
    with pytest.raises(ValueError, match="fully_shard"):
        anchor_fsdp(C.build_model(1), gpu_anchor.connect("cpu", namespace="x"))


@pytest.mark.parametrize("parallel,clip", [("fsdp", 0.0), ("fsdp", 0.05), ("ddp", 0.05)])
def test_gradscaler_over_ranks(host_daemon, tmp_path, parallel, clip):
    """fp16 autocast + GradScaler on FSDP2 and DDP: the inf/NaN flag is agreed over the ranks,
    the scale resumes with the step; kills give the fault-free run, which gives plain torch +
    ``GradScaler.step``.  ``clip``: each rank's loop calls ``scaler.unscale_(opt)`` and clips
    (over FSDP2's shards, the norm all-reduced) before the step."""
    cfg = C.CampaignConfig(steps=8, amp=True, clip=clip)
    tag = f"{parallel[0]}a{'c' if clip else ''}"
    runs = {}
    for name, kw in [(f"{tag}-ref", {}), (f"{tag}-plain", {"plain": True}),
                     (f"{tag}-k", {"faults_seq": [(1, "mid_chunk@1:1"), (0, "after_update@2:0"),
                                                  (1, "before_boundary@4"), (0, "after_commit@5:1")]})]:
        d = tmp_path / name
        d.mkdir()
        runs[name] = D.run_group(name, cfg, str(d), parallel=parallel, **kw)
    for r in range(2):
        ref = C.trajectory(runs[f"{tag}-ref"]["logs"][r])[0]
        assert ref == C.trajectory(runs[f"{tag}-plain"]["logs"][r])[0] == C.trajectory(runs[f"{tag}-k"]["logs"][r])[0]
        assert len({v.split()[1] for v in ref.values()}) >= 3          # the scale moved
        assert C.compare(gpu_anchor.connect("cpu", namespace=f"{tag}-ref/rank{r}"),
                         gpu_anchor.connect("cpu", namespace=f"{tag}-k/rank{r}")) == []
    assert runs[f"{tag}-k"]["kills"] == 4


def test_bf16_mixed_precision_policy_over_ranks(host_daemon, tmp_path):
    """FSDP2 as torchtitan configures it by default, ``MixedPrecisionPolicy(param_dtype=bf16,
    reduce_dtype=float32)``: bf16 copies of the float32 anchored shards are gathered for the
    forward and backward, gradients reduced in float32 into the anchored buffers.  The anchored
    group gives plain torch's losses step for step and, SIGKILLed at protocol points on either
    rank, the fault-free run's end state, bit for bit."""
    cfg = C.CampaignConfig(steps=6)
    runs = {}
    for name, kw in [("mp-ref", {}), ("mp-plain", {"plain": True}),
                     ("mp-k", {"faults_seq": [(1, "mid_chunk@1:1"), (0, "after_update@2:0"), (1, "before_boundary@3"),
                                              (0, "after_commit@4:1")]})]:
        d = tmp_path / name
        d.mkdir()
        runs[name] = D.run_group(name, cfg, str(d), parallel="fsdp-bf16", **kw)
    for r in range(2):
        ref = C.trajectory(runs["mp-ref"]["logs"][r])[0]
        assert ref == C.trajectory(runs["mp-plain"]["logs"][r])[0] == C.trajectory(runs["mp-k"]["logs"][r])[0]
        assert C.compare(gpu_anchor.connect("cpu", namespace=f"mp-ref/rank{r}"),
                         gpu_anchor.connect("cpu", namespace=f"mp-k/rank{r}")) == []
    assert runs["mp-k"]["kills"] == 4


def test_device_progress_mode_one_rank_killed(fsdp_reference, tmp_path):
    """The device-progress protocol (the default on CUDA) on FSDP2 shards: same end state."""
    cfg, ref = fsdp_reference
    cfg = C.CampaignConfig(steps=cfg.steps, progress="device")
    specs = [(1, "mid_chunk@1:1"), (0, "before_boundary@2"), (1, "after_update@3:0"), (0, "after_commit@4:1"),
             (1, "between_steps@5")]
    res = D.run_group("fdev", cfg, str(tmp_path), faults_seq=specs, parallel="fsdp")
    assert res["kills"] == len(specs)
    _same_as_reference("fdev", res, ref)
