"""Multi-rank kill campaigns: DDP or FSDP2 training where a rank is SIGKILLed and the group restarts.

Torchrun-style: when any rank dies the others are killed too and the whole group is
started again (fresh file rendezvous, so no port can be taken by
another job); every rank resumes at the agreed
``completed_steps``.  CPU ranks (gloo, host daemon, namespace ``<ns>/rank<r>``) are
forked from the calling interpreter; GPU ranks (NCCL, one daemon per GPU) are fresh
interpreters (``python -m gpu_anchor.testing.ddp_campaign``), since CUDA does not
survive ``fork``.

Order that matters: ``anchor_module`` -> ``AnchoredOptimizer`` (recovery) ->
``DistributedDataParallel``.  DDP broadcasts rank 0's parameters at construction; it
must not overwrite a rank's parameters before that rank finished its in-flight step.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from datetime import timedelta

from . import campaign as C


def rank_train(rank: int, world: int, store: str, namespace: str, cfg: C.CampaignConfig, log_path: str,
               fault: str | None, device: str = "cpu", plain: bool = False, width: int = 0,
               parallel: str = "ddp") -> None:
    """One rank's life.  ``parallel``: ``"ddp"`` (replicas), ``"fsdp"`` (FSDP2 ``fully_shard``
    per Linear plus the root, each rank anchoring its own shards with ``anchor_fsdp``),
    ``"fsdp-bf16"`` (the same with bf16 mixed precision, ``shard``) or ``"fsdp:<shape>"``
    (``fsdp_llama``'s transformer; ``width`` is then the sequence length)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    if parallel.startswith("fsdp:"):
        from . import fsdp_llama
        fsdp_llama.rank_train(rank, world, f"file://{store}", namespace, parallel[5:], cfg.steps, log_path, device,
                              seq=width or 256, seed=cfg.seed, fault=fault, plain=plain, chunk_bytes=cfg.chunk_bytes)
        return
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gpu_anchor

    from gpu_anchor.train import faults
    from gpu_anchor.train.anchor import anchor_module
    from gpu_anchor.train.fsdp import anchor_fsdp
    from gpu_anchor.train.optimizer import AnchoredOptimizer

    faults.arm(fault)
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", init_method=f"file://{store}",
                            rank=rank, world_size=world, timeout=timedelta(seconds=120))
    model = C.build_model(cfg.seed, width).to(dev)
    fsdp = parallel in ("fsdp", "fsdp-bf16")
    if fsdp:
        shard(model, dev, world, bf16=parallel == "fsdp-bf16")
    inner = C.build_optimizer(model, cfg)
    sched = torch.optim.lr_scheduler.LambdaLR(inner, C.warmup)
    scaler = C.make_scaler() if cfg.amp else None
    if plain:
        opt, start = inner, 0
    else:
        client = gpu_anchor.connect(device, namespace=namespace)
        if fsdp:
            anchor_fsdp(model, client)
        else:
            anchor_module(model, client)
        opt = AnchoredOptimizer(inner, model=model, client=client, chunk_bytes=cfg.chunk_bytes, schedulers=[sched],
                                progress=cfg.progress, scaler=scaler)
        start = opt.completed_steps
    ddp = model if fsdp else DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None)
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    for step in range(start, cfg.steps):
        x, y = C.batch(step * world + rank, cfg.seed)
        loss = C.forward_loss(ddp, x.to(dev), y.to(dev), cfg.amp)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        C._log(fd, step, loss, scaler)
        C.clip(model, opt, scaler, cfg.clip)
        if plain and scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        if plain:
            sched.step()
        opt.zero_grad()
    if not plain:
        os.write(fd, f"digest {state_digest(model, opt)}\n".encode())
    os.write(fd, f"done {cfg.steps}\n".encode())
    os.close(fd)
    # gloo + FileStore: destroy_process_group() sometimes hung after both ranks were done (on
    # the 2-core CI machine, about 1 run in 2).  A barrier keeps what it gave — no rank leaves
    # while a peer may still need it — and a forked CPU rank os._exit()s right after, which
    # releases the group.  NCCL ranks (a process each) destroy it as before.
    dist.barrier()
    if dev.type == "cuda":
        dist.destroy_process_group()


def shard(model, dev, world: int, bf16: bool = False) -> None:
    """FSDP2 over all ranks: each Linear its own group, the rest (LayerNorm) with the root.
    ``bf16``: torchtitan's default ``MixedPrecisionPolicy`` (parameters gathered in bf16 for
    the forward and backward, gradients reduced in float32; the shards stay float32)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh = init_device_mesh(dev.type, (world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            fully_shard(m, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)


def state_digest(model, opt) -> str:
    """sha256 over the parameters and optimizer state, for comparing runs across processes."""
    import hashlib

    import torch

    from gpu_anchor.train.fsdp import local
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(local(p).detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        for k in sorted(opt.optimizer.state.get(p, {})):
            t = opt.optimizer.state[p][k]
            if torch.is_tensor(t) and k != "step":
                h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _to_file(fn, path):
    def run(*args):
        # a survivor's "peer died" traceback is expected noise: keep it in the log dir
        err = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(err, 2)
        import faulthandler
        faulthandler.dump_traceback_later(60, exit=False)   # a hung rank explains itself
        fn(*args)
    return run


def _start(rank, world, store, namespace, cfg, log_path, fault, device, plain, width, parallel, target=None):
    if device == "cpu":
        return C._child(_to_file(target or rank_train, log_path + ".err"), rank, world, store, namespace, cfg, log_path,
                        fault, device, plain, width, parallel)
    if target is not None:
        raise ValueError("a rank target of one's own runs on CPU ranks only (forked)")
    args = json.dumps([rank, world, store, namespace, cfg.__dict__, log_path, fault, device, plain, width, parallel])
    return subprocess.Popen([sys.executable, "-m", "gpu_anchor.testing.ddp_campaign", args])


def _poll(h):
    if isinstance(h, int):
        pid, status = os.waitpid(h, os.WNOHANG)
        if pid == 0:
            return None
        return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    return h.poll()


def _kill(h):
    try:
        os.kill(h if isinstance(h, int) else h.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_group(namespace: str, cfg: C.CampaignConfig, log_dir: str, world: int = 2, faults_seq=(),
              random_kills: int = 0, max_delay_s: float = 1.0, rng=None, devices=None, plain=False,
              width: int = 0, timeout_s: float = 150, parallel: str = "ddp", kill_all: bool = False,
              target=None) -> dict:
    """Run the group to the end; ``faults_seq`` items are ``(rank, spec)``, or a list of them
    (those ranks armed in one generation: the group is torn down only once each has reached
    its point).  Returns counts and logs.  ``target``: a rank's life other than ``rank_train``
    (same arguments; CPU ranks), such as a Hugging Face Trainer job.

    A random kill SIGKILLs one random rank (``kill_all``: every rank at the same instant).
    A generation in which no rank was killed on purpose must end with every rank at 0."""
    rng = rng or random.Random(0)
    devices = devices or ["cpu"] * world
    if devices[0] == "cpu":
        C.prewarm(cfg)
        if parallel.startswith("fsdp:"):
            from . import fsdp_llama
            fsdp_llama.preload(parallel[5:])
    fixed = list(faults_seq)
    left = random_kills
    kills = generations = 0
    t0 = time.perf_counter()
    while True:
        store = os.path.join(log_dir, f".rendezvous-{os.getpid()}-{time.time_ns()}")
        spec = fixed.pop(0) if fixed else None
        armed = dict(spec) if isinstance(spec, list) else dict([spec]) if spec else {}
        procs = [_start(r, world, store, namespace, cfg, os.path.join(log_dir, f"rank{r}.log"),
                        armed.get(r), devices[r], plain, width, parallel, target)
                 for r in range(world)]
        generations += 1
        deadline = time.monotonic() + timeout_s
        kill_at = time.monotonic() + rng.uniform(0, max_delay_s) if spec is None and left > 0 else None
        victim = rng.randrange(world)
        codes = [None] * world
        killed = False
        while any(c is None for c in codes):
            if time.monotonic() > deadline:
                for h in procs:
                    _kill(h)
                raise TimeoutError(f"group generation {generations} hung")
            if kill_at is not None and time.monotonic() >= kill_at:
                for h in procs if kill_all else [procs[victim]]:
                    _kill(h)
                kill_at, killed = None, True
            for r, h in enumerate(procs):
                if codes[r] is None:
                    codes[r] = _poll(h)
            if not killed and not armed and any(c not in (None, 0) for c in codes):
                # nobody was killed: a rank that failed is a bug, not a fault to recover from
                for h in procs:
                    _kill(h)
                raise RuntimeError(f"generation {generations}: ranks ended with {codes} with no fault injected; "
                                   f"see {log_dir}/rank*.log.err")
            failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
            # torchrun-style: one rank died, tear down the group — once every armed rank has
            # reached its own point (unless an unarmed one failed: then at once)
            if failed and (all(codes[r] is not None for r in armed) or any(r not in armed for r in failed)):
                for r, h in enumerate(procs):
                    if codes[r] is None:
                        _kill(h)
            time.sleep(0.002)
        if all(c == 0 for c in codes):
            if spec is not None:
                raise RuntimeError(f"fault {spec} was never reached")
            break
        # The victim shows SIGKILL; a survivor may have been killed by us or have failed on
        # its own first when gloo/NCCL noticed the dead peer — torchrun restarts either way.
        if -signal.SIGKILL not in codes or any(codes[r] != -signal.SIGKILL for r in armed):
            raise RuntimeError(f"ranks ended with {codes} (fault {spec})")
        kills += 1
        left -= spec is None
    logs = []
    for r in range(world):
        with open(os.path.join(log_dir, f"rank{r}.log")) as f:
            logs.append(f.read())
    return {"kills": kills, "generations": generations, "wall_s": time.perf_counter() - t0, "logs": logs}


def main() -> None:  # pragma: no cover - entry point of a GPU rank
    a = json.loads(sys.argv[1])
    rank_train(a[0], a[1], a[2], a[3], C.CampaignConfig(**a[4]), a[5], a[6], a[7], a[8], a[9], a[10])


if __name__ == "__main__":
    main()
