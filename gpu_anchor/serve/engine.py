"""The serving engine: anchored weights + paged KV, continuous batching, a commit per step.

    eng = Engine(EngineConfig(model="/models/qwen3", device="cuda:0"))
    eng.add_request("r1", prompt_ids, SamplingParams(max_tokens=64))
    while eng.has_work(): events = eng.step()

Step contract: ``schedule → forward (writes KV) → sample → commit → return events``.
On CUDA, decode-only steps replay a captured CUDA graph (``cuda_graphs.py``; off with
``cuda_graphs=False``); prefill and mixed steps run the eager forward.
Tokens leave the engine only after the commit that contains them, so whatever a client
has seen is durable, and a crash costs at most the one uncommitted step.
Construction rebinds anchored memory and restores every committed sequence.
"""
from __future__ import annotations

import logging
import math
import os
import random
import signal
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from gpu_anchor.errors import ConflictError

from . import commit as C
from .anchor import Anchor
from .attention import AttnMeta
from .block_manager import BlockManager
from .cuda_graphs import DecodeGraphs
from .model_runner import Model, head_dim, init_random, load_config, load_weights, param_specs, weights_fingerprint
from .sampling import sample, token_logprobs
from .scheduler import Scheduler, Work
from .sequence import SamplingParams, Sequence, Status

log = logging.getLogger("gpu_anchor.serve")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
# Fault-injection points (tests): mid_prefill / mid_decode fire halfway through the layers of
# the first step at or after the given one that has prefill work / only decodes.
PHASES = ("between_steps", "mid_prefill", "mid_decode", "before_commit", "after_commit")


class _Immediate:
    """Runs 'submitted' work at once (no journal: nothing to overlap)."""

    def submit(self, fn, *args) -> Future:
        f: Future = Future()
        f.set_result(fn(*args))
        return f


@dataclass
class EngineConfig:
    model: str                       # model dir (config + safetensors) or, with random_weights, a config path
    random_weights: bool = False
    seed: int = 0                    # for random weights
    device: str = "cpu"
    dtype: str = "float32"
    block_size: int = 16
    num_blocks: int = 256
    max_num_seqs: int = 64
    max_batched_tokens: int = 512
    max_model_len: int = 2048
    anchor: bool = True
    namespace: str | None = None
    socket: str | None = None        # daemon socket
    fault: tuple[int, str] | None = None   # (step, phase): SIGKILL self there (tests)
    cpu_threads: int | None = None   # torch intra-op threads on the CPU (None: torch's default)
    # decode steps from CUDA graphs; None: on for CUDA.  True on the CPU runs the same padded
    # static-buffer path without capture (tests its bookkeeping)
    cuda_graphs: bool | None = None
    # the first steps of an engine run eagerly: a restarted engine's first tokens are not
    # held up by capturing a graph (each size is captured at its first use after these)
    graph_after_steps: int = 2
    extra: dict = field(default_factory=dict)


class Engine:
    def __init__(self, cfg: EngineConfig, progress=None) -> None:
        """``progress(phase, done=None, total=None)``, if given, hears how the start-up goes:
        phases ``cuda_init``, ``bind`` (mapping or creating the anchored objects),
        ``weights`` (bytes loaded of the total; only when they are not already anchored),
        ``restore`` (reading the journal)."""
        t0 = time.perf_counter()
        self.cfg = cfg
        report = progress or (lambda phase, done=None, total=None: None)
        self.timings: dict[str, float] = {}
        if cfg.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {cfg.dtype!r}")
        self.dtype = DTYPES[cfg.dtype]
        self.device = torch.device(cfg.device)
        if cfg.cpu_threads:
            torch.set_num_threads(cfg.cpu_threads)
        if self.device.type == "cuda":
            report("cuda_init")
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
            torch.empty(1, device=self.device)
        self.timings["cuda_init_s"] = time.perf_counter() - t0
        self.mc = load_config(cfg.model)
        t1 = time.perf_counter()
        self.anchor = Anchor(str(self.device), cfg.namespace, cfg.socket, enabled=cfg.anchor)
        wspecs = param_specs(self.mc, self.dtype)
        L, hkv, d = self.mc.num_hidden_layers, self.mc.num_key_value_heads, head_dim(self.mc)
        kshape = (2, cfg.num_blocks, cfg.block_size, hkv, d)
        kspecs = [(f"kv_cache[{i}]", kshape, self.dtype) for i in range(L)]
        report("bind", None, sum(math.prod(shape) * dt.itemsize for _, shape, dt in wspecs + kspecs))
        try:
            tensors, status = self.anchor.bind(wspecs + kspecs)
        except ConflictError as e:   # another layout or model under these names: start them afresh
            log.warning("anchored objects do not fit this engine (%s); replacing them", str(e).splitlines()[0])
            tensors, status = self.anchor.bind(wspecs + kspecs, policy="replace")
        self.timings["bind_s"] = time.perf_counter() - t1
        self.bind_status = status
        weights = {n: tensors[n] for n, _, _ in wspecs}
        kv = [tensors[n] for n, _, _ in kspecs]
        journal = self.anchor.journal
        fp = weights_fingerprint(cfg.model, self.mc, self.dtype, cfg.seed if cfg.random_weights else None)
        t2 = time.perf_counter()
        have = journal.get(C.WEIGHTS) if journal is not None else None
        weights_matched = all(status[n] == "matched" for n, _, _ in wspecs) and have == fp.encode()
        if not weights_matched:
            if journal is not None:
                journal.commit({}, [C.WEIGHTS])      # a crash mid-load must not look complete
            total = sum(t.numel() * t.element_size() for t in weights.values())
            report("weights", 0, total)
            if cfg.random_weights:
                init_random(weights, self.mc, cfg.seed, progress=lambda done: report("weights", done, total))
            else:
                load_weights(cfg.model, weights, progress=lambda done: report("weights", done, total))
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            if journal is not None:
                journal.commit({C.WEIGHTS: fp.encode()})
        self.weights_loaded = not weights_matched
        self.timings["weights_s"] = time.perf_counter() - t2
        if any(status[n] == "created" for n, _, _ in kspecs):
            for t in kv:          # fresh CUDA memory is undefined: start from zeros (once, at creation)
                t.zero_()
        self.model = Model(self.mc, weights, kv, self.device, max_positions=cfg.max_model_len)
        self.blocks = BlockManager(cfg.num_blocks, cfg.block_size)
        eos = self.mc.eos_token_id
        eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        self.scheduler = Scheduler(self.blocks, cfg.max_num_seqs, cfg.max_batched_tokens, cfg.max_model_len, eos)
        self.committer = C.Committer(journal)
        t3 = time.perf_counter()
        self.recovery_notes: list[str] = []
        self.restored: list[Sequence] = []
        # log-probabilities of sampled tokens not yet published: rid -> {output index: (lp, top)}
        self._logprobs: dict[str, dict[int, tuple]] = {}
        if journal is not None:
            report("restore")
            self._restore(journal, fp, kspecs)
        self.timings["restore_s"] = time.perf_counter() - t3
        self.steps = 0
        self._arrivals = max([s.arrival for s in self.restored], default=-1) + 1
        self._gone: list[str] = []
        self._added: list[Sequence] = []     # admitted since the last commit (not yet scheduled)
        # Step N's commit is snapshotted at its end (cheap compares), encoded by step N+1 right
        # after launching its forward and sent from a helper thread while that forward runs;
        # its tokens are returned (published) only once it landed, and blocks freed by step N
        # become reusable only then (BlockManager epochs).
        self._inflight = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="serve-commit") if journal is not None else \
            _Immediate()
        if cfg.fault is not None:
            self.model.mid_hook = self._mid_forward
        self._prefill_step = False
        self.tokens_generated = 0
        self.graphs = None
        use = cfg.cuda_graphs if cfg.cuda_graphs is not None else self.device.type == "cuda"
        if use and self.device.type == "cuda" and (self.dtype == torch.float64 or
                                                   not hasattr(torch.cuda, "CUDAGraph")):
            use = False       # float64 attention runs the (host-driven) reference path
        if use:
            from . import attention
            if self.device.type == "cuda" and attention.triton is None:
                log.warning("no Triton: decode steps run eagerly")
            else:
                self.graphs = DecodeGraphs(self.model, cfg.max_num_seqs, -(-cfg.max_model_len // cfg.block_size) + 1,
                                           self.device, capture=self.device.type == "cuda")
        # host seconds per phase, summed over steps (bench/serve_throughput.py reports them)
        self.step_times = dict.fromkeys(("schedule", "prepare_inputs", "forward", "commit_build", "sample",
                                         "finish", "commit_prepare", "commit_wait"), 0.0)
        self.step_counts = {"graph": 0, "eager": 0}
        self.timings["init_s"] = time.perf_counter() - t0

    # ------------------------------------------------------------------ recovery
    def _restore(self, journal, fp: str, kspecs) -> None:
        layout = C.layout_record({"fp": fp, "kv": [list(s[1]) for s in kspecs[:1]], "layers": len(kspecs),
                                  "dtype": self.cfg.dtype})
        old = journal.get(C.LAYOUT)
        seqs, problems = C.read_sequences(journal)
        kv_matched = all(self.bind_status[n] == "matched" for n, _, _ in kspecs)
        why = ""
        if old != layout:
            why = "the KV layout or the weights changed since the commit" if old else "no layout record"
        elif not kv_matched:
            why = "the KV cache memory is new (the daemon lost it)"
        elif self.weights_loaded:
            why = "the weights had to be loaded again"
        notes = problems + C.restore_kv(seqs, self.blocks, kv_valid=not why, why=why)
        for n in notes:
            log.warning("%s", n)
        self.recovery_notes = notes
        for s in seqs:
            self.scheduler.seqs[s.rid] = s
        # A dropped (damaged) record must not linger; the new layout goes in the same commit.
        bad = [k for k in journal.get_many(prefix=C.P + "req/") if k[len(C.P + "req/"):] not in self.scheduler.seqs]
        journal.commit({C.LAYOUT: layout}, bad)
        self.committer.adopt(seqs)
        if why and seqs:
            self.committer.commit(seqs)      # their KV is gone: say so durably before any step
        self.restored = seqs

    # ------------------------------------------------------------------ requests
    def add_request(self, rid: str, prompt_ids, params: SamplingParams, output_ids=()) -> list[tuple]:
        """Queue a request (``output_ids``: tokens a client already received, to continue
        after them).  Returns events if it is already complete."""
        if params.seed is None and not params.greedy:
            params.seed = random.getrandbits(62)
        bad = [t for t in list(prompt_ids) + list(output_ids) if not 0 <= int(t) < self.mc.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} outside the vocabulary (size {self.mc.vocab_size})")
        seq = Sequence(rid, [int(t) for t in prompt_ids], params, output_ids=[int(t) for t in output_ids],
                       arrival=self._arrivals)
        if seq.output_ids:
            last, p = seq.output_ids[-1], params
            reason = None
            if last in p.stop_token_ids or (not p.ignore_eos and last in self.scheduler.eos_token_ids):
                reason = "stop"
            elif len(seq.output_ids) >= p.max_tokens:
                reason = "length"
            if reason:
                return [(rid, len(seq.output_ids), [], reason)]
        self.scheduler.add(seq)
        self._added.append(seq)
        self._arrivals += 1
        return []

    def readd(self, rid: str, prompt_ids, params: SamplingParams, output_ids) -> list[tuple]:
        """Replace a request's history with the tokens the client actually received
        (after a replay disagreed with them): its KV is dropped and recomputed."""
        if self.scheduler.abort(rid) is not None:
            self.committer.forget(rid)
        self._drop_unpublished(rid)
        self._logprobs.pop(rid, None)
        return self.add_request(rid, prompt_ids, params, output_ids)

    def _drop_unpublished(self, rid: str) -> None:
        if self._inflight is not None:
            self._inflight[2] = [e for e in self._inflight[2] if e[0] != rid]

    def abort(self, rid: str) -> None:
        if self.scheduler.abort(rid) is not None:
            self._gone.append(rid)
        self._drop_unpublished(rid)
        self._logprobs.pop(rid, None)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def load(self) -> dict:
        """What the scheduler holds now: requests running (holding KV) and waiting, and the
        KV blocks in use (blocks released by a step count until its commit lands)."""
        running = sum(s.status is Status.RUNNING for s in self.scheduler.seqs.values())
        return {"running": running, "waiting": len(self.scheduler.seqs) - running,
                "kv_blocks_used": self.blocks.num_blocks - self.blocks.num_free, "kv_blocks": self.blocks.num_blocks,
                "preemptions": self.scheduler.preemptions}

    def take_logprobs(self, events) -> list[list]:
        """The log-probabilities of the tokens in ``events`` (published ones), as
        ``[[rid, index, logprob, [[id, logprob], ...]], ...]``; they are forgotten here."""
        out = []
        for rid, i, ids, _ in events:
            held = self._logprobs.get(rid)
            if held is None:
                continue
            for k in range(i, i + len(ids)):
                if k in held:
                    lp, top = held.pop(k)
                    out.append([rid, k, lp, top])
            if not held:
                del self._logprobs[rid]
        return out

    # ------------------------------------------------------------------ stepping
    def _fault(self, phase: str) -> None:
        f = self.cfg.fault
        if f is not None and f[1] == phase and (f[0] == self.steps or (phase.startswith("mid_") and
                                                                      self.steps >= f[0])):
            os.kill(os.getpid(), signal.SIGKILL)

    def _mid_forward(self) -> None:
        self._fault("mid_prefill" if self._prefill_step else "mid_decode")
        f = self.cfg.fault
        if f is not None and f[1] == "mid_prefill" and self.steps >= f[0] + 2:
            os.kill(os.getpid(), signal.SIGKILL)     # no prefill came: die mid-decode instead

    def _on_device(self) -> None:
        """Make this engine's GPU the thread's current device: Triton kernels and graph capture
        run on the current device, which others may have changed (a migration's copies to the
        old GPU, another engine in the process) — seen on two H200s after cuda:0 -> cuda:1."""
        if self.device.type == "cuda" and torch.cuda.current_device() != self.device.index:
            torch.cuda.set_device(self.device)

    def capture_graphs(self) -> dict | None:
        """Capture every decode batch size now (otherwise each is captured at its first use);
        returns the graphs' statistics (count, capture seconds, pool and buffer bytes)."""
        if self.graphs is None:
            return None
        self._on_device()
        self.graphs.capture_all()
        return dict(self.graphs.stats)

    def _decode_graph(self, work: list[Work]):
        """Logits of a decode-only step from the graph, or None (eager)."""
        g = self.graphs
        if g is None or self.steps < self.cfg.graph_after_steps or not all(w.n == 1 and w.sample for w in work):
            return None
        tables = [w.seq.block_table for w in work]
        if not g.fits(len(work), max(map(len, tables))):
            return None
        bs = self.cfg.block_size
        ids, pos, slots = [], [], []
        for w in work:
            p, t = w.start, w.seq.block_table
            ids.append(w.seq.token(p))
            pos.append(p)
            slots.append(t[p // bs] * bs + p % bs)
        t0 = time.perf_counter()
        h = g.run(ids, pos, slots, tables)
        logits = self.model.head(h)
        self.step_times["prepare_inputs"] += t0 - self._t_mark
        self._t_mark = time.perf_counter()
        self.step_times["forward"] += self._t_mark - t0
        self.step_counts["graph"] += 1
        return logits

    def _prepare(self, work: list[Work]):
        bs, dev = self.cfg.block_size, self.device
        ids, pos, slots, tseq, rows = [], [], [], [], []
        q_starts, q_lens, ctx, tables = [], [], [], []
        for b, w in enumerate(work):
            s = w.seq
            q_starts.append(len(ids))
            ids += s.tokens(w.start, w.start + w.n)
            r = range(w.start, w.start + w.n)
            pos += r
            t = s.block_table
            slots += [t[p // bs] * bs + p % bs for p in r]
            tseq += [b] * w.n
            q_lens.append(w.n)
            ctx.append(w.start + w.n)
            tables.append(t)
            if w.sample:
                rows.append(len(ids) - 1)
        width = max(len(t) for t in tables)
        bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        meta = AttnMeta(torch.tensor(pos, dtype=torch.long).to(dev, non_blocking=True),
                        torch.tensor(slots, dtype=torch.long).to(dev, non_blocking=True),
                        torch.tensor(tseq, dtype=torch.int32).to(dev, non_blocking=True),
                        bt.to(dev, non_blocking=True), q_starts, q_lens, ctx, tables)
        return torch.tensor(ids, dtype=torch.long).to(dev), meta, torch.tensor(rows, dtype=torch.long).to(dev)

    def step(self) -> list[tuple]:
        """One batched step.  Returns events ``(rid, index_of_first_new_token, new_ids, finish_reason)``."""
        self._fault("between_steps")
        self._on_device()
        st, clock = self.step_times, time.perf_counter
        t0 = clock()
        work = self.scheduler.schedule()
        self._t_mark = t1 = clock()
        st["schedule"] += t1 - t0
        sampled: dict[str, int] = {}
        if not work:
            self._send_commit()
        else:
            self._prefill_step = any(w.n > 1 or not w.sample for w in work)
            logits = self._decode_graph(work)
            if logits is None:
                ids, meta, rows = self._prepare(work)
                t2 = clock()
                logits = self.model.forward(ids, meta, rows)
                self._t_mark = clock()
                st["prepare_inputs"] += t2 - t1
                st["forward"] += self._t_mark - t2
                self.step_counts["eager"] += 1
            self._send_commit()              # the previous step's, encoded while the GPU works
            sw = [w for w in work if w.sample]
            if sw:
                toks = sample(logits, [w.seq.params for w in sw], [len(w.seq.output_ids) for w in sw])
                sampled = {w.seq.rid: t for w, t in zip(sw, toks)}
                want = [b for b, w in enumerate(sw) if w.seq.params.logprobs is not None]
                if want:
                    lps = token_logprobs(logits[want], [toks[b] for b in want],
                                         [sw[b].seq.params.logprobs for b in want])
                    for b, lp in zip(want, lps):
                        self._logprobs.setdefault(sw[b].seq.rid, {})[len(sw[b].seq.output_ids)] = lp
        t3 = clock()
        st["sample"] += t3 - self._t_mark       # includes waiting for the GPU (the .tolist())
        grown, finished = self.scheduler.finish_step(work, sampled)
        self._fault("before_commit")
        t4 = clock()
        st["finish"] += t4 - t3
        # only sequences this step touched can have changed (plus new and preempted ones)
        snap = None
        if self.committer.journal is not None:
            live, seen = self.scheduler.seqs, set()
            touched = [q for q in [w.seq for w in work] + self.scheduler.preempted + self._added
                       if live.get(q.rid) is q and not (id(q) in seen or seen.add(id(q)))]
            snap = self.committer.snapshot(touched, self._gone + [s.rid for s in finished])
        self._added = []
        self._gone = []
        epoch = self.blocks.epoch
        self.blocks.epoch += 1
        events = [(s.rid, len(s.output_ids) - 1, [s.output_ids[-1]], s.finish_reason) for s in grown]
        t5 = clock()
        st["commit_prepare"] += t5 - t4
        published = self._await_commit()        # the previous step's commit ran during this forward
        st["commit_wait"] += clock() - t5
        self._fault("after_commit")
        # [future, snapshot not yet sent, events it makes publishable, epoch]: sent by the
        # next step right after its forward is launched, awaited at that step's end
        self._inflight = [None, snap, events, epoch]
        if not self.scheduler.has_work():
            published += self._await_commit()   # nothing left to overlap with: land it now
        self.steps += 1
        self.tokens_generated += len(grown)
        return published

    def _send_commit(self) -> None:
        """Encode the pending step's snapshot and hand it to the commit thread."""
        inf = self._inflight
        if inf is None or inf[1] is None:
            return
        t = time.perf_counter()
        payload = self.committer.build(inf[1])
        inf[1] = None
        if payload is not None:
            inf[0] = self._pool.submit(self.committer.apply, *payload)
        self.step_times["commit_build"] += time.perf_counter() - t

    def _await_commit(self) -> list[tuple]:
        """Wait for the in-flight commit; then its blocks may be reused and its tokens published."""
        if self._inflight is None:
            return []
        self._send_commit()
        fut, _, events, epoch = self._inflight
        self._inflight = None
        if fut is not None:
            fut.result()             # a failed commit raises: the engine dies, nothing unsafe was published
        self.blocks.on_commit(epoch)
        return events

    def flush(self) -> list[tuple]:
        """Land the in-flight commit and return the tokens it makes publishable."""
        return self._await_commit()

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Offline convenience: run ``prompts`` to completion, return their output ids."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        rids = [f"gen-{self._arrivals + i}" for i in range(len(prompts))]
        out = {r: [] for r in rids}
        for r, p, sp in zip(rids, prompts, plist):
            for ev in self.add_request(r, p, SamplingParams(**sp.to_dict())):
                out[ev[0]] += ev[2]
        while self.has_work():
            for rid, _, toks, _ in self.step():
                out[rid] += toks
        return [out[r] for r in rids]
