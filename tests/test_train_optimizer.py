"""AnchoredOptimizer against plain PyTorch, in one process with a real host daemon."""
import dataclasses
import os
import sys
import textwrap

import pytest
import torch

import gpu_anchor
import preloaded
from gpu_anchor.train import AnchoredOptimizer, LoopState, anchor_module, position, training_state
from gpu_anchor.testing import campaign as C
from gpu_anchor.train.loop_state import LoopPosition as LoopPosition_

FLAVOURS = [("adamw", "default"), ("adamw", "foreach"), ("adamw", "single"), ("adamw", "fused"),
            ("adam", "foreach"), ("adam", "single"), ("adam", "fused"),
            ("sgd", "default"), ("sgd", "single"), ("sgd", "foreach"), ("sgd", "fused")]


def _pair(ns, cfg, chunk_bytes=4096):
    client = gpu_anchor.connect("cpu", namespace=ns)
    ref = C.build_model(cfg.seed)
    ropt = C.build_optimizer(ref, cfg)
    rsched = torch.optim.lr_scheduler.LambdaLR(ropt, C.warmup)
    model = C.build_model(cfg.seed)
    assert set(anchor_module(model, client).values()) == {"created"}
    inner = C.build_optimizer(model, cfg)
    sched = torch.optim.lr_scheduler.LambdaLR(inner, C.warmup)
    opt = AnchoredOptimizer(inner, model=model, client=client, chunk_bytes=chunk_bytes, schedulers=[sched])
    return client, (ref, ropt, rsched), (model, opt)


@pytest.mark.parametrize("name,flavour", FLAVOURS)
def test_bit_identical_to_plain_pytorch(host_daemon, name, flavour):
    cfg = C.CampaignConfig(optimizer=name, flavour=flavour)
    client, (ref, ropt, rsched), (model, opt) = _pair(f"bit-{name}-{flavour}", cfg)
    assert opt.num_chunks >= 3
    for step in range(6):
        x, y = C.batch(step, cfg.seed)
        torch.manual_seed(step)
        l_ref = torch.nn.functional.mse_loss(ref(x), y)
        l_ref.backward()
        ropt.step()
        rsched.step()
        ropt.zero_grad()
        torch.manual_seed(step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        assert torch.equal(loss, l_ref), step
    assert opt.completed_steps == 6
    for (n, a), b in zip(ref.named_parameters(), model.parameters()):
        assert torch.equal(a, b), n
        for k, v in ropt.state[a].items():
            if k != "step":
                assert torch.equal(v, opt.optimizer.state[b][k]), (n, k)
    assert opt.param_groups[0]["lr"] == ropt.param_groups[0]["lr"]
    sd = opt.state_dict()
    if name.startswith("adam"):
        assert all(float(s["step"]) == 6 for s in sd["state"].values())


def test_unused_parameter_is_skipped_like_set_to_none(host_daemon):
    cfg = C.CampaignConfig()
    client, (ref, ropt, rsched), (model, opt) = _pair("unused", cfg)
    for step in range(4):
        x, y = C.batch(step, cfg.seed)
        for m, o in ((ref, ropt), (model, opt)):
            torch.manual_seed(step)
            out = m(x) if step % 2 == 0 else m[2](m[1](m[0](x)))[:, :C.D_OUT]   # later layers unused on odd steps
            torch.nn.functional.mse_loss(out, y).backward()
            o.step()
            if o is ropt:
                rsched.step()
            o.zero_grad()
    assert opt.state_dict()["state"][6]["step"] == 2      # last Linear: updated on even steps only
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a, b)


def test_gradient_accumulation_and_replaced_grads(host_daemon):
    cfg = C.CampaignConfig(optimizer="adam", flavour="single")
    client, (ref, ropt, rsched), (model, opt) = _pair("accum", cfg)
    for step in range(3):
        for m, o in ((ref, ropt), (model, opt)):
            for micro in range(2):
                x, y = C.batch(10 * step + micro, cfg.seed)
                torch.manual_seed(micro)
                torch.nn.functional.mse_loss(m(x), y).backward()
            if o is opt and step == 1:
                for p in model.parameters():      # e.g. a framework that swaps p.grad
                    p.grad = p.grad.clone()
            o.step()
            if o is ropt:
                rsched.step()
            o.zero_grad()
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a, b)


def test_state_is_anchored_and_named(host_daemon):
    cfg = C.CampaignConfig()
    client, _, (model, opt) = _pair("names", cfg)
    names = set(client.names())
    assert "model.0.weight" in names and "train.grad.0.weight" in names
    assert "train.state.0.weight.exp_avg" in names and {"train.undo.0", "train.undo.1"} <= names
    p = next(model.parameters())
    assert p.grad is None                     # as torch leaves it before the first backward
    x, y = C.batch(0, cfg.seed)
    torch.nn.functional.mse_loss(model(x), y).backward()
    # the gradient backward made was copied home at once: p.grad is the anchored buffer
    assert p.grad.data_ptr() == client.lookup("train.grad.0.weight", p.shape, p.dtype).data_ptr()
    opt.zero_grad(set_to_none=False)          # kept, zeroed in place
    assert p.grad.data_ptr() == client.lookup("train.grad.0.weight", p.shape, p.dtype).data_ptr()
    assert not p.grad.any()
    opt.zero_grad()
    assert p.grad is None
    total = sum(t.numel() * t.element_size() * 4 for t in model.parameters())
    assert opt.undo_bytes <= max(2 * 4096, 0.5 * total)


def test_state_goes_where_the_parameters_are_anchored(host_daemon):
    """Built after its scope closed (or by a library, as AnchoredTrainer builds it), the
    optimizer keeps its state in the namespace its parameters are anchored in."""
    with gpu_anchor.managed_scope(namespace="elsewhere"):
        model = C.build_model(0)
    opt = AnchoredOptimizer(torch.optim.AdamW(model.parameters()), model=model)
    assert opt.client.namespace == "elsewhere"
    assert "train.state.0.weight.exp_avg" in gpu_anchor.connect("cpu", namespace="elsewhere").names()
    assert "train.state.0.weight.exp_avg" not in gpu_anchor.connect("cpu").names()


def test_parameters_outside_anchored_memory_are_refused(host_daemon):
    """Unanchored at construction: refused, naming them (a restart would resume the state over
    fresh weights).  Moved out after it (a copy): the next step is refused before it commits
    anything (it would update memory the model no longer reads)."""
    plain = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"2 of 2 parameter\(s\) are not in anchored memory \(weight, bias\)"):
        AnchoredOptimizer(torch.optim.AdamW(plain.parameters()), model=plain)
    with gpu_anchor.managed_scope(namespace="moved"):
        model = torch.nn.Linear(4, 4)
    opt = AnchoredOptimizer(torch.optim.AdamW(model.parameters()), model=model)
    model.to("cpu:0")                  # torch copies a CPU tensor for "cpu:0": new storage under the Parameter
    model(torch.ones(2, 4)).sum().backward()
    with pytest.raises(RuntimeError, match=r"parameter 'weight' no longer lies in the anchored memory"):
        opt.step()
    assert opt.completed_steps == 0 and not opt._state.in_flight


def test_both_undo_slots_stay_anchored_with_one_chunk(host_daemon):
    """A one-chunk plan writes only slot 0, and the optimizer still holds slot 1: an anchored
    object is freed once its last tensor is collected, and a step in flight needs both."""
    import gc
    cfg = C.CampaignConfig()
    client, _, (model, opt) = _pair("undo-held", cfg, chunk_bytes=1 << 20)
    assert opt.num_chunks == 1
    gc.collect()
    assert {"train.undo.0", "train.undo.1"} <= set(client.names())


def test_bad_inputs(host_daemon):
    client = gpu_anchor.connect("cpu", namespace="bad")
    model = C.build_model(0)
    with pytest.raises(TypeError, match="supports"):
        AnchoredOptimizer(torch.optim.RMSprop(model.parameters()), client=client)
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, C.D_IN)).sum().backward()
    inner.step()
    with pytest.raises(ValueError, match="before its first step"):
        AnchoredOptimizer(inner, client=client)
    with pytest.raises(TypeError):
        AnchoredOptimizer(model, client=client)
    anchor_module(model, client)
    with pytest.raises(ValueError, match="closure"):
        AnchoredOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), client=client).step(lambda: 0)


def test_lost_state_is_refused_not_silently_reinitialised(host_daemon, tmp_path):
    cfg = C.CampaignConfig(steps=3)
    C.run("lost", cfg, str(tmp_path / "log"))
    client = gpu_anchor.connect("cpu", namespace="lost")
    client.free(*[n for n in client.names() if n.startswith("train.state.")])
    model = C.build_model(cfg.seed)
    anchor_module(model, client)
    with pytest.raises(RuntimeError, match="restore from a checkpoint"):
        AnchoredOptimizer(C.build_optimizer(model, cfg), model=model, client=client, chunk_bytes=cfg.chunk_bytes)


def test_fallback_hook_reads_the_journal(host_daemon, tmp_path):
    cfg = C.CampaignConfig(steps=5)
    assert training_state("cpu", namespace="hook")["present"] is False
    C.run("hook", cfg, str(tmp_path / "log"), faults_seq=["mid_chunk@3:1"] , random_kills=0)
    d = training_state("cpu", namespace="hook")
    assert d["consistent"] and d["completed_steps"] == 5 and d["phase"] == "idle"
    # a worker killed mid-step leaves an in-flight step that the hook calls consistent
    pid = C._child(C.train, "hook2", C.CampaignConfig(steps=5), str(tmp_path / "log2"), "after_update@2:1")
    assert C._wait(pid) == -9
    d = training_state("cpu", namespace="hook2")
    assert d["consistent"] and d["in_flight_step"] == 2 and d["cursor"] == 1 and d["completed_steps"] == 3


def test_loop_position():
    assert position(0, 10) == LoopPosition_(0, 0, 0)
    p = position(23, 10)
    assert (p.epoch, p.batch_in_epoch) == (2, 3)
    with pytest.raises(ValueError):
        position(1, 0)

    class _Opt:
        completed_steps = 7
        loop_state = {"tokens": 5}
    ls = LoopState(_Opt(), 4)
    assert ls.position.epoch == 1 and ls.data == {"tokens": 5}
    assert list(ls.batches(9)) == [(7, 1, 3), (8, 2, 0)]


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_load_state_dict_from_plain_pytorch(host_daemon, name):
    cfg = C.CampaignConfig(optimizer=name, flavour="single")
    ref = C.build_model(cfg.seed)
    ropt = C.build_optimizer(ref, cfg)

    def train(m, o, steps):
        for step in steps:
            x, y = C.batch(step, cfg.seed)
            torch.manual_seed(step)
            torch.nn.functional.mse_loss(m(x), y).backward()
            o.step()
            o.zero_grad()
    train(ref, ropt, range(3))
    client = gpu_anchor.connect("cpu", namespace=f"load-{name}")
    model = C.build_model(cfg.seed)
    model.load_state_dict(ref.state_dict())
    anchor_module(model, client)
    opt = AnchoredOptimizer(C.build_optimizer(model, cfg), model=model, client=client, chunk_bytes=4096)
    opt.load_state_dict(ropt.state_dict())
    assert all(t.data_ptr() == q.data_ptr() for t, q in
               zip(opt.optimizer.state[next(model.parameters())].values(),
                   [client.lookup(f"train.state.0.weight.{k}", (C.HIDDEN, C.D_IN), torch.float32)
                    for k in opt.optimizer.state[next(model.parameters())]]))
    train(ref, ropt, range(3, 6))
    train(model, opt, range(3, 6))
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a, b)
    sd = opt.state_dict()
    for k, v in ropt.state_dict()["state"][0].items():
        assert torch.equal(torch.as_tensor(v), torch.as_tensor(sd["state"][0][k])), k


def test_protocol_settings_are_one_record(host_daemon):
    from gpu_anchor.train import AnchoredOptimizer, StepProtocolConfig
    with pytest.raises(ValueError, match="progress"):
        StepProtocolConfig(progress="disk")
    with pytest.raises(ValueError, match="chunk_bytes"):
        StepProtocolConfig(chunk_bytes=0)
    lin = torch.nn.Linear(4, 4)
    from gpu_anchor.train import anchor_module
    import gpu_anchor
    client = gpu_anchor.connect("cpu", namespace="cfg-record")
    anchor_module(lin, client)
    cfg = StepProtocolConfig(prefix="p1", progress="journal")
    opt = AnchoredOptimizer(torch.optim.SGD(lin.parameters(), lr=0.1), model=lin, client=client, config=cfg)
    # the automatic settings decided (on the CPU: off); a record that names them is kept as it is
    assert opt.config == dataclasses.replace(cfg, lend_grad_bytes=0, grads_in_place=False)
    assert opt.prefix == "p1" and opt.progress == "journal"
    named = StepProtocolConfig(prefix="p2", lend_grad_bytes=0, grads_in_place=False)
    assert AnchoredOptimizer(torch.optim.SGD(lin.parameters(), lr=0.1), model=lin, client=client,
                             config=named).config is named
    lin(torch.ones(2, 4)).sum().backward()
    opt.step()
    assert opt.completed_steps == 1


ATTACH = textwrap.dedent('''
    import sys, torch, gpu_anchor
    from gpu_anchor.train import AnchoredOptimizer, anchor_module
    from gpu_anchor.testing import campaign as C
    cfg = C.CampaignConfig(optimizer="adamw", flavour="single")
    client = gpu_anchor.connect("cpu", namespace=sys.argv[1])
    model = C.build_model(cfg.seed)
    anchor_module(model, client)
    inner = C.build_optimizer(model, cfg)
    sched = torch.optim.lr_scheduler.LambdaLR(inner, C.warmup)
    opt = AnchoredOptimizer(inner, model=model, client=client, chunk_bytes=4096, schedulers=[sched])
    print(opt.completed_steps, "train/committed" in client.journal.get_many(prefix="train/"), sched.last_epoch)
''')


def test_its_state_dict_restores_the_job_whole_in_a_fresh_daemon(host_daemon, tmp_path):
    """``torch.save(opt.state_dict())`` then, with the daemon's state lost (a fresh namespace),
    ``load_state_dict(torch.load(..., weights_only=True))``: the step count and the schedule come
    back with the tensors, and the next steps are the uninterrupted run's, bit for bit, also after
    going back to the checkpoint two steps later.  In a namespace with no step yet a restarted
    worker starts afresh (and the job loads again: ``test_train_accelerate``'s kills); a torch
    optimizer loads the same file; bad entries of ours are refused, nothing changed."""
    from test_train_checkpoints import CFG as cfg, _train as train     # the same loop and configuration
    client, (ref, ropt, rsched), (model, opt) = _pair("sd-whole-a", cfg)
    train(ref, ropt, range(3), rsched)
    train(model, opt, range(3))
    sd = opt.state_dict()
    assert sd["param_groups"][0]["gpu_anchor"]["completed_steps"] == 3
    torch.save({"model": model.state_dict(), "opt": sd}, tmp_path / "ckpt.pt")
    train(ref, ropt, range(3, 6), rsched)

    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    plain = C.build_optimizer(C.build_model(cfg.seed), cfg)
    plain.load_state_dict(ckpt["opt"])       # a torch optimizer keeps our entry as an unused group key
    assert plain.state_dict()["param_groups"][0]["lr"] == ckpt["opt"]["param_groups"][0]["lr"]

    _, _, (model2, opt2) = _pair("sd-whole-b", cfg)
    sched2 = opt2.schedulers.items[0]
    model2.load_state_dict(ckpt["model"])
    before = [t.clone() for q in opt2._params for t in q.states.values()]
    for bad, match in [({"completed_steps": -1, "schedulers": [{}]}, "not a step count"),
                       ({"completed_steps": True, "schedulers": [{}]}, "not a step count"),
                       ({"completed_steps": 3, "schedulers": []}, "holds 0 scheduler state"),
                       ([3], "not the dict")]:
        with pytest.raises(ValueError, match=match):
            groups = [{**ckpt["opt"]["param_groups"][0], "gpu_anchor": bad}, *ckpt["opt"]["param_groups"][1:]]
            opt2.load_state_dict({**ckpt["opt"], "param_groups": groups})
    wrong = {**ckpt["opt"], "state": {**ckpt["opt"]["state"], 3: {**ckpt["opt"]["state"][3],
                                                                   "exp_avg_sq": torch.zeros(7)}}}
    with pytest.raises(ValueError, match=r"\['state'\]\[3\]\['exp_avg_sq'\] has shape \(7,\).*another model"):
        opt2.load_state_dict(wrong)       # torch checks groups, not shapes: this would stop half way
    assert opt2.completed_steps == 0 and sched2.last_epoch == 0
    assert all(torch.equal(a, t) for a, t in zip(before, (t for q in opt2._params for t in q.states.values())))

    opt2.load_state_dict(ckpt["opt"])
    assert opt2.completed_steps == 3 and sched2.last_epoch == 3
    # the journal, what a restarted worker reads: a namespace with no step yet starts afresh
    # (the job loads again); once it has one, the loaded count is the job's
    assert training_state("cpu", "sd-whole-b")["completed_steps"] == 0
    worker = preloaded.run([sys.executable, "-c", ATTACH, "sd-whole-b"], timeout=120,
                           env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert worker.returncode == 0, worker.stderr
    assert worker.stdout.split() == ["0", "False", "0"]      # afresh: the load's records are gone, schedule at 0
    model2.load_state_dict(ckpt["model"])        # so the job loads again (the worker zeroed the states)
    opt2.load_state_dict(ckpt["opt"])
    train(model2, opt2, range(3, 5))
    assert opt2.completed_steps == 5 and training_state("cpu", "sd-whole-b")["completed_steps"] == 5
    model2.load_state_dict(ckpt["model"])        # back to step 3 in a namespace with steps
    opt2.load_state_dict(ckpt["opt"])
    assert opt2.completed_steps == 3 and training_state("cpu", "sd-whole-b")["completed_steps"] == 3
    train(model2, opt2, range(3, 4))
    train(model2, opt2, range(4, 6))
    for a, b in zip(ref.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    assert opt2.param_groups[0]["lr"] == ropt.param_groups[0]["lr"]


def test_a_dropped_optimizer_leaves_nothing_mapped(host_daemon):
    """The parameters' gradient hooks hold the optimizer's buffers weakly: autograd keeps hooks
    where the collector cannot see them, so a strong reference kept the parameters, gradients and
    optimizer state mapped (one descriptor each on the host backend) after the job dropped them.
    Freed, they are gone from the daemon too, and the journal's step count then refuses a new
    optimizer in that namespace, saying why."""
    import gc

    def fds():
        return len(os.listdir("/proc/self/fd"))
    gc.collect()
    before = fds()
    for i in range(2):
        client = gpu_anchor.connect("cpu", namespace=f"dropped-{i}")
        model = C.build_model(0)
        anchor_module(model, client)
        opt = AnchoredOptimizer(C.build_optimizer(model, C.CampaignConfig()), model=model, client=client)
        x, y = C.batch(0, 0)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        assert fds() > before + 10
        del client, model, opt, x, y
        gc.collect()
        assert fds() <= before + 1, fds() - before       # the connection's socket may linger until collected
    # the daemon freed them, and the journal still counts the step: a new optimizer there is refused
    client = gpu_anchor.connect("cpu", namespace="dropped-0")
    model = C.build_model(0)
    anchor_module(model, client)
    with pytest.raises(RuntimeError, match=r"says 1 steps were committed.*as `del opt` does.*gpu-anchor drop dropped-0"):
        AnchoredOptimizer(C.build_optimizer(model, C.CampaignConfig()), model=model, client=client)


def test_a_group_added_to_the_wrapped_optimizer_is_refused_by_name(host_daemon):
    """``add_param_group`` after the optimizer was anchored: its parameters would never be updated
    (the step updates those anchored at construction).  On the AnchoredOptimizer it is refused at
    once; on the wrapped optimizer, the step is refused before it begins."""
    client = gpu_anchor.connect("cpu", namespace="added-group")
    model = C.build_model(0)
    anchor_module(model, client)
    inner = C.build_optimizer(model, C.CampaignConfig())
    opt = AnchoredOptimizer(inner, model=model, client=client)
    head = torch.nn.Linear(4, 4)
    with pytest.raises(TypeError, match="takes no group later.*Build the wrapped optimizer with every group"):
        opt.add_param_group({"params": list(head.parameters())})
    assert len(inner.param_groups) == 2
    inner.add_param_group({"params": list(head.parameters())})
    x, y = C.batch(0, 0)
    torch.nn.functional.mse_loss(model(x), y).backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"now holds 10 parameter\(s\) in 3 group\(s\), and 8 were anchored"):
        opt.step()
    assert opt.completed_steps == 0 and all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
