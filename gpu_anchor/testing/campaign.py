"""SIGKILL campaigns against the step protocol on a tiny CPU model (tests and bench).

A *run* trains ``steps`` iterations of a small MLP (dropout, two param groups, LR
warm-up scheduler, a ``loop_state`` counter) in its own namespace of a host daemon.
Workers are forked from the calling interpreter (torch already imported, so a
restart costs milliseconds) and killed either at named protocol points
(``faults.arm``) or by the parent at random instants; each new worker resumes at
``opt.completed_steps``.  Every worker logs ``step loss`` (exact float bits) before
its ``opt.step()``; a replayed iteration logs again and must log the same bits.

``compare(ns_a, ns_b)`` checks every anchored object of two namespaces bit for bit.
"""
from __future__ import annotations

import os
import random
import signal
import struct
import time
from dataclasses import dataclass, field

import torch

import gpu_anchor
from gpu_anchor import runtime

from gpu_anchor.train import faults
from gpu_anchor.train.anchor import anchor_module
from gpu_anchor.train.optimizer import AnchoredOptimizer

D_IN, HIDDEN, D_OUT, BATCH = 24, 48, 8, 16


@dataclass
class CampaignConfig:
    steps: int = 12
    optimizer: str = "adamw"        # adamw | adam | sgd
    flavour: str = "default"        # default | foreach | single | fused
    chunk_bytes: int = 16 << 10
    seed: int = 1234
    progress: str = "journal"       # journal | device (where the per-chunk cursor lives)
    scope: bool = False             # build model + optimizer inside gpu_anchor.managed_scope
    amp: bool = False               # GradScaler (``make_scaler``); the log carries the scale too
    clip: float = 0.0               # clip the gradients' norm to this before each step (AMP: after
                                    # ``scaler.unscale_(opt)``, torch's recipe); 0: no clipping
    device: str = "cpu"             # where the model trains (a CUDA device: forked workers, so the
                                    # forking process must not have initialised CUDA)
    # StepProtocolConfig's (None: the optimizer's automatic choice); the log says what the last
    # worker lent and wrote in place
    lend_grad_bytes: int | None = None
    grads_in_place: bool | None = None


def build_model(seed: int, hidden: int = 0) -> torch.nn.Module:
    """The campaign's MLP (``hidden`` widens it, e.g. for GPU runs)."""
    torch.manual_seed(seed)
    h = hidden or HIDDEN
    return torch.nn.Sequential(torch.nn.Linear(D_IN, h), torch.nn.LayerNorm(h), torch.nn.GELU(),
                               torch.nn.Dropout(0.1), torch.nn.Linear(h, h), torch.nn.GELU(),
                               torch.nn.Linear(h, D_OUT))


def num_chunks(cfg: CampaignConfig) -> int:
    """How many chunks the step protocol cuts the campaign's model and optimizer into."""
    from gpu_anchor.train import chunking
    opt = build_optimizer(build_model(0), cfg)
    keys = 2 if cfg.optimizer == "adamw" else (3 if cfg.optimizer == "adam" else 1)
    ps = [p for g in opt.param_groups for p in g["params"]]
    return len(chunking.plan([p.numel() for p in ps], [[4] * (1 + keys)] * len(ps), cfg.chunk_bytes))


def warmup(step: int) -> float:
    return min(1.0, (step + 1) / 4)


def build_optimizer(model: torch.nn.Module, cfg: CampaignConfig) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.ndim > 1]
    other = [p for n, p in model.named_parameters() if p.ndim <= 1]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}]
    kw = {"default": {}, "foreach": {"foreach": True}, "single": {"foreach": False}, "fused": {"fused": True}}[cfg.flavour]
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=3e-3, **kw)
    if cfg.optimizer == "adam":
        return torch.optim.Adam(groups, lr=3e-3, amsgrad=True, **kw)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=3e-2, momentum=0.9, dampening=0.1, nesterov=False, **kw)
    raise ValueError(cfg.optimizer)


def batch(step: int, seed: int):
    g = torch.Generator().manual_seed(seed * 100003 + step)
    x = torch.randn(BATCH, D_IN, generator=g)
    return x, torch.sin(x[:, :D_OUT] * 2.0) + 0.1 * torch.randn(BATCH, D_OUT, generator=g)


def make_scaler() -> torch.amp.GradScaler:
    """A scaler that overflows now and then on this model under fp16 autocast (fp16 gradients
    overflow from a scale of about 2**20): skipped and applied steps mix."""
    return torch.amp.GradScaler("cpu", init_scale=2.0 ** 22, growth_factor=2.0 ** 3,
                                backoff_factor=2.0 ** -4, growth_interval=2)


def forward_loss(model, x, y, amp: bool) -> torch.Tensor:
    """The campaign's loss; ``amp``: the model runs under fp16 autocast (loss in fp32)."""
    if not amp:
        return torch.nn.functional.mse_loss(model(x), y)
    with torch.autocast(x.device.type, dtype=torch.float16):
        out = model(x)
    return torch.nn.functional.mse_loss(out.float(), y)


def clip(model, opt, scaler, max_norm: float) -> None:
    """The campaign loop's clipping (none if ``max_norm`` is 0), as torch's AMP recipe writes it."""
    if max_norm:
        if scaler is not None:
            scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


def _log(fd: int, step: int, loss: torch.Tensor, scaler=None) -> None:
    extra = f" {scaler.get_scale():.6e}" if scaler is not None else ""
    os.write(fd, f"{step} {struct.unpack('<I', struct.pack('<f', loss.item()))[0]:08x}{extra}\n".encode())


def _protocol(cfg: CampaignConfig):
    from gpu_anchor.train.config import StepProtocolConfig
    return StepProtocolConfig(chunk_bytes=cfg.chunk_bytes, progress=cfg.progress, lend_grad_bytes=cfg.lend_grad_bytes,
                              grads_in_place=cfg.grads_in_place)


def train(namespace: str, cfg: CampaignConfig, log_path: str, fault: str | None = None) -> int:
    """One worker's life: attach, recover, train to the end.  Returns the steps it began at."""
    faults.arm(fault)
    scaler = make_scaler() if cfg.amp else None
    if cfg.device != "cpu" and (cfg.scope or cfg.amp):
        raise ValueError("the campaign runs managed_scope and AMP on the CPU only")
    if cfg.scope:
        with gpu_anchor.managed_scope(namespace=namespace):
            model = build_model(cfg.seed)
            inner = build_optimizer(model, cfg)
            sched = torch.optim.lr_scheduler.LambdaLR(inner, warmup)
            opt = AnchoredOptimizer(inner, model=model, schedulers=[sched], scaler=scaler, config=_protocol(cfg))
    else:
        client = gpu_anchor.connect(cfg.device, namespace=namespace)
        model = build_model(cfg.seed).to(cfg.device)
        anchor_module(model, client)
        inner = build_optimizer(model, cfg)
        sched = torch.optim.lr_scheduler.LambdaLR(inner, warmup)
        opt = AnchoredOptimizer(inner, model=model, client=client, schedulers=[sched], scaler=scaler,
                                config=_protocol(cfg))
    start = opt.completed_steps
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        for step in range(start, cfg.steps):
            x, y = (t.to(cfg.device) for t in batch(step, cfg.seed))
            loss = forward_loss(model, x, y, cfg.amp)
            (scaler.scale(loss) if scaler is not None else loss).backward()
            opt.loop_state["samples"] = opt.loop_state.get("samples", 0) + BATCH
            _log(fd, step, loss, scaler)
            clip(model, opt, scaler, cfg.clip)
            opt.step()
            opt.zero_grad()
        os.write(fd, f"done {opt.loop_state.get('samples', 0)} {opt.completed_steps}\n".encode())
        if cfg.device != "cpu":
            os.write(fd, f"updates fused={opt.stats['fused_steps']} copy={opt.stats['copy_steps']}\n".encode())
        if opt.lender is not None:
            st = opt.lender.stats
            os.write(fd, f"lending lent_total={st['lent_bytes']} evicted={st['evicted_bytes']}\n".encode())
        if opt.config.grads_in_place:
            st = opt._grads.stats
            os.write(fd, f"grads in_place={st['in_place']} copied={st['copied']} modules={st['modules']}\n".encode())
    finally:
        os.close(fd)
    return start


_warm = False


def prewarm(cfg: CampaignConfig) -> None:
    """Run one plain step here so torch's lazy imports happen before any fork."""
    global _warm
    if _warm:
        return
    # An OpenMP thread team that existed at fork time deadlocks the child's first parallel
    # op (libgomp is not fork-safe): keep the forking interpreter single-threaded.
    torch.set_num_threads(1)
    model = build_model(cfg.seed)
    opt = build_optimizer(model, cfg)
    torch.optim.lr_scheduler.LambdaLR(opt, warmup)
    x, y = batch(0, cfg.seed)
    loss = torch.nn.functional.mse_loss(model(x), y)
    if not torch.backends.cuda.is_built():
        # Only with a CPU build of torch.  With a CUDA build, autograd's first backward counts
        # the devices and torch's step asks whether a graph is being captured: either initialises
        # CUDA here, after which a forked child's first CUDA query fails ("initialization
        # error"), and where torch sees a GPU the backward also starts autograd's device threads,
        # after which no forked child can run a backward ("Unable to handle autograd's threading
        # in combination with fork-based multiprocessing").  Asked of the build, not the
        # machine: counting the devices would initialise CUDA too.
        loss.backward()
        opt.step()
    _warm = True


# Campaign workers are forked from the test process (pytest), which may still run threads of
# earlier tests.  Safe here: this process runs torch on one thread (``prewarm``), so no OpenMP
# team is shared with the children, and the children touch no state of those threads.
IN_TEST_PROCESS = "a test driver's process: torch on one thread; children touch no other thread's state"


def _child(fn, *args, unsafe_ok: str | None = IN_TEST_PROCESS) -> int:
    """Fork a worker running ``fn(*args)`` (``gpu_anchor.runtime.fork``: thread pool rebuilt,
    exit path, ...).  ``unsafe_ok=None``: refuse if this process runs other threads."""
    return runtime.fork(lambda: fn(*args), unsafe_ok=unsafe_ok)


def _wait(pid: int) -> int:
    _, status = os.waitpid(pid, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


@dataclass
class RunResult:
    kills: int = 0
    workers: int = 0
    in_flight_at_kill: int = 0     # kills that left a step in flight (recovered by redo)
    rollbacks: int = 0             # ... of which needed the undo slot (a chunk half done or unknown)
    wall_s: float = 0.0
    log: str = ""
    starts: list = field(default_factory=list)


def _journal_state(client, prefix="train"):
    from gpu_anchor.train.protocol import StepState, key
    return StepState.decode(client.journal.get(key(prefix, "state")))


def run(namespace: str, cfg: CampaignConfig, log_path: str, faults_seq=(), random_kills: int = 0,
        max_delay_s: float = 0.05, rng: random.Random | None = None, client=None) -> RunResult:
    """Train to the end in ``namespace``, killing workers: first at each spec of
    ``faults_seq`` (one per worker), then up to ``random_kills`` times at random
    instants (fewer if training ends first).  ``client`` (same namespace) lets the
    result count kills that left a step in flight."""
    rng = rng or random.Random(0)
    prewarm(cfg)
    res = RunResult()
    t0 = time.perf_counter()
    fixed = list(faults_seq)
    left = random_kills
    while True:
        spec = fixed.pop(0) if fixed else None
        pid = _child(train, namespace, cfg, log_path, spec)
        res.workers += 1
        if spec is None and left > 0:
            time.sleep(rng.uniform(0, max_delay_s))
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        code = _wait(pid)
        if code == -signal.SIGKILL:
            res.kills += 1
            left -= spec is None
            if client is not None:
                st = _journal_state(client)
                res.in_flight_at_kill += st.in_flight
                res.rollbacks += st.in_flight and st.undo == st.cursor
            continue
        if code != 0:
            raise RuntimeError(f"worker exited with {code} (fault {spec})")
        if spec is not None:
            raise RuntimeError(f"fault point {spec} was never reached")
        break   # training finished (the remaining random kills, if any, came too late)
    res.wall_s = time.perf_counter() - t0
    with open(log_path) as f:
        res.log = f.read()
    return res


def random_kill_runs(prefix: str, cfg: CampaignConfig, log_dir: str, ref: RunResult, ref_namespace: str,
                     kills: int, rng: random.Random, check=None) -> RunResult:
    """Runs of ``cfg``, each in a fresh namespace ``<prefix>-<n>`` dropped after it, killed at
    random instants (within 80 % of the fault-free ``ref``'s wall time) until ``kills`` kills
    in all.  Each run's losses and anchored objects must equal ``ref``'s (in
    ``ref_namespace``), else AssertionError; ``check(namespace, run)``, if given, replaces that
    comparison.  Returns the totals (kills, workers, steps in flight at a kill)."""
    total, runs = RunResult(), 0
    while total.kills < kills:
        ns = f"{prefix}-{runs}"
        client = gpu_anchor.connect(cfg.device, namespace=ns)
        res = run(ns, cfg, os.path.join(log_dir, f"{ns}.log"), random_kills=kills - total.kills,
                  max_delay_s=ref.wall_s * 0.8, rng=rng, client=client)
        if check is not None:
            check(ns, res)
        else:
            assert trajectory(res.log) == trajectory(ref.log), ns
            differ = compare(gpu_anchor.connect(cfg.device, namespace=ref_namespace), client)
            assert differ == [], (ns, differ)
        total.kills, total.workers = total.kills + res.kills, total.workers + res.workers
        total.in_flight_at_kill += res.in_flight_at_kill
        runs += 1
        client.drop_namespace()
    return total


def trajectory(log: str) -> tuple[dict[int, str], str | None]:
    """``{step: loss bits}`` from a worker log; raises if a replayed step logged other bits."""
    out: dict[int, str] = {}
    done = None
    for line in log.splitlines():
        a, b = line.split(" ", 1)
        if a == "done":
            done = b
            continue
        if not a.isdigit():     # digest / resume / stats lines of multi-rank logs
            continue
        s = int(a)
        if s in out and out[s] != b:
            raise AssertionError(f"step {s} replayed with a different loss: {out[s]} vs {b}")
        out[s] = b
    return out, done


def digests(log: str) -> list[str]:
    """The ``digest`` lines a DDP rank log carries (one per finished worker)."""
    return [line.split(" ", 1)[1] for line in log.splitlines() if line.startswith("digest ")]


def compare(client_a, client_b, skip_prefixes=("train.undo.", "train.progress")) -> list[str]:
    """Names whose contents differ (or exist on one side only) between two namespaces."""
    from gpu_anchor.client.mapping import torch_dtype
    a, b = client_a.objects(), client_b.objects()
    keep = lambda names: {n for n in names if not n.startswith(skip_prefixes)}  # noqa: E731
    bad = sorted(keep(a) ^ keep(b))
    names = sorted(keep(a) & keep(b))
    ta = client_a.bind([(n, a[n].shape, torch_dtype(a[n].dtype)) for n in names], "lookup")
    tb = client_b.bind([(n, b[n].shape, torch_dtype(b[n].dtype)) for n in names], "lookup")
    for n, x, y in zip(names, ta, tb):
        if x.tensor is None or y.tensor is None or not torch.equal(x.tensor, y.tensor):
            bad.append(n)
    return bad
