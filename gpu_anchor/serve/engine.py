"""The serving engine: anchored weights + paged KV, continuous batching, a commit per step.

    eng = Engine(EngineConfig(model="/models/qwen3", device="cuda:0"))
    eng.add_request("r1", prompt_ids, SamplingParams(max_tokens=64))
    while eng.has_work(): events = eng.step()

Step contract: ``schedule → forward (writes KV) → sample → commit → return events``.
With ``async_scheduling`` the next decode step's forward is launched before this step's tokens
are read (``async_step.py``); each ``step()`` still completes one step.
On CUDA, decode-only steps replay a captured CUDA graph (``cuda_graphs.py``; off with
``cuda_graphs=False``); prefill and mixed steps run the eager forward.
Tokens leave the engine only after the commit that contains them, so whatever a client
has seen is durable, and a crash costs at most the one uncommitted step.
Construction rebinds anchored memory and restores every committed sequence (the take-over:
``engine_takeover.py``); what a step samples is ``step_sampling.py``'s.
With ``tensor_parallel_size > 1`` this is rank 0 of an engine group (``tp.py``): it also
sends each step's plan to the other ranks, and its forward runs with theirs.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import signal
import time

import torch

from . import lora_slots, step_plan, step_sampling
from .anchor import Anchor
from .async_step import Launched, RunAhead
from .attention import step_inputs
from .cuda_graphs import decode_graphs
from .engine_config import EngineConfig
from .grammar_matchers import Grammars
from .model_runner import Model, check_window, eos_token_ids, load_config
from .engine_takeover import TakeOver
from .requests import Requests
from .scheduler import Work
from .sequence import SamplingParams
from .state import NotAttachable, bind_state
from .tp import LeaderSide, fault_due

log = logging.getLogger("gpu_anchor.serve")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def blas_library(cfg: EngineConfig) -> str | None:
    """The matmul library an engine of ``cfg`` sets on CUDA (None: torch's own choice)."""
    if cfg.blas_library == "auto":
        return "cublaslt" if cfg.max_num_seqs <= 64 else "cublas"   # explicit: the setting is process-wide
    if cfg.blas_library not in (None, "cublas", "cublaslt"):
        raise ValueError(f"blas_library must be auto, cublas, cublaslt or None, got {cfg.blas_library!r}")
    return cfg.blas_library


class Engine(Requests, TakeOver):
    def __init__(self, cfg: EngineConfig, progress=None, standby: bool = False, fence=None) -> None:
        """``progress(phase, done=None, total=None)``, if given, hears how the start-up goes:
        phases ``cuda_init``, ``group`` (tensor parallelism: the other ranks connect),
        ``bind`` (mapping or creating the anchored objects), ``weights`` (bytes loaded of
        the total; only when they are not already anchored), ``restore`` (reading the journal).

        ``standby=True`` builds a *hot standby* (``gpu-anchor serve --hot-standby``): it attaches
        to the live engine's namespace without writing anything that engine owns — the objects
        looked up, never created (``state.NotAttachable`` if any is missing or different, or the
        journal lacks the weights fingerprint or layout record), no journal key written, no weight
        loaded, no KV zeroed — builds the model on them and captures every decode graph now
        (capture writes no KV: its slots are -1).  ``take_over`` does the rest once the live
        engine is dead.  The ordinary constructor is the same code: bind, then ``take_over``.

        ``fence``: the server's ``step_fence.StepFence``, marked by every step of this engine
        from its take-over on, so that a successor can start before this process has exited."""
        t0 = time.perf_counter()
        self.fence = None
        if standby and cfg.tensor_parallel_size > 1:
            raise NotAttachable("a hot standby of a tensor-parallel engine group is not built (one engine only)")
        if standby:   # this engine's graphs exist before its first step: no eager steps first
            cfg = dataclasses.replace(cfg, graph_after_steps=0)
        self.cfg = cfg
        self.standby = standby
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
            blas = blas_library(cfg)
            if blas:
                torch.backends.cuda.preferred_blas_library(blas)
        self.timings["cuda_init_s"] = time.perf_counter() - t0
        self.mc = load_config(cfg.model)
        check_window(self.mc, cfg.max_model_len)
        self.grammars = Grammars(cfg.tokenizer or cfg.model, self.mc.vocab_size, eos_token_ids(self.mc, cfg.model))
        self.tp = None
        if cfg.tensor_parallel_size > 1:
            if cfg.rank != 0:
                raise ValueError("the Engine is rank 0 of its group; the other ranks run tp.serve_rank")
            report("group")
            self.tp = LeaderSide(cfg, self.device, self.mc.vocab_size)
        # ``Anchor`` is looked up here, at construction: the benchmarks' baselines replace it
        self.state = st = bind_state(cfg, self.mc, self.dtype, self.device, report, provider=Anchor, attach=standby)
        self.timings.update(st.timings)
        self.anchor = st.anchor
        self.weights_loaded = st.weights_loaded
        self.model = Model(self.mc, st.weights, st.kv, self.device, max_positions=cfg.max_model_len,
                           tp=self.tp.group if self.tp is not None else None, deterministic=cfg.deterministic,
                           packed=st.packed)
        self.model.lora = lora_slots.load_for(cfg, self.mc, st.weights, self.model, 0)
        self.lora_slots = self.model.lora.slots if self.model.lora is not None else {}
        self.adapter_records: dict[str, dict] = {}   # journal records of adapters it loaded again (take-over)
        if cfg.fault is not None:     # before any capture: with a hook, each graph is captured in two halves
            self.model.mid_hook = self._mid_forward
        self.steps = 0
        self.graphs = decode_graphs(cfg, self.model, self.device, self.dtype)
        if standby:
            t1 = time.perf_counter()
            self.capture_graphs()
            self.timings["standby_capture_s"] = time.perf_counter() - t1
            step_sampling.warm(self)
            t2 = time.perf_counter()
            if self.grammars.prepare():      # ~1 s for a 150 000-token vocabulary: not after the take-over
                self.timings["standby_grammar_vocab_s"] = time.perf_counter() - t2
            self.timings["standby_attach_s"] = time.perf_counter() - t0
            return
        self.take_over(progress, _t0=t0, fence=fence)

    # ------------------------------------------------------------------ stepping
    def _fault(self, phase: str) -> None:
        if fault_due(self.cfg.fault, phase, self.steps):
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
        if self.tp is not None:          # the graphs hold collectives: every rank captures with us
            self.tp.send({"t": "capture_all"})
        self.graphs.capture_all()
        return dict(self.graphs.stats)

    def close(self) -> None:
        """Land the last commit; a tensor-parallel group's other ranks exit (0)."""
        self.flush()
        if self.tp is not None:
            self.tp.close()
            self.tp = None

    def _mark_launching(self) -> None:
        if self.fence is not None:
            self.fence.launching()

    def _mark_launched(self) -> None:
        if self.fence is not None:       # the step's KV writes are all enqueued before this mark
            self.fence.launched_all(self._stream)

    def _decode_graph(self, work: list[Work], index: int, ahead_ids=None):
        """Logits of a decode-only step from the graph, or None (eager).  ``index``: the step's
        number; ``ahead_ids``: its input tokens on the device (a step launched ahead)."""
        g = self.graphs
        if g is None or index < self.cfg.graph_after_steps or not all(w.n == 1 and w.sample for w in work):
            return None
        tables = [w.seq.block_table for w in work]
        if not g.fits(len(work), max(map(len, tables))):
            return None
        ids, pos, slots = step_plan.decode_inputs(work, self.cfg.block_size, known=ahead_ids is None)
        adapters = step_plan.lora_slots(work, self.lora_slots)
        t0 = time.perf_counter()
        if self.tp is not None:
            self.tp.send({"t": "graph", "step": index, "prefill": False, "ids": ids, "pos": pos, "slots": slots,
                          "tables": tables, "lora": adapters})
        h = g.run(ids if ahead_ids is None else ahead_ids, pos, slots, tables,
                  around=(self._mark_launching, self._mark_launched), lora=adapters)
        logits = self.model.head(h)
        self.step_times["prepare_inputs"] += t0 - self._t_mark
        self._t_mark = time.perf_counter()
        self.step_times["forward"] += self._t_mark - t0
        self.step_counts["graph"] += 1
        return logits

    def step(self) -> list[tuple]:
        """One batched step.  Returns events ``(rid, index_of_first_new_token, new_ids, finish_reason)``.

        Each call completes one step: the one launched ahead by the previous call
        (``async_scheduling``), else one scheduled and launched now; before reading its
        tokens it launches the next decode step when that can run ahead (``async_step.py``)."""
        self._fault("between_steps")
        self._on_device()
        cur = self.run_ahead.take() if self.run_ahead is not None else None
        if cur is None:
            t0 = time.perf_counter()
            work = self.scheduler.schedule(decodes_only=self._urgent)
            if work and self.model.lora is not None and self.model.lora.host_capacity is not None:
                work = self._fetch_adapters(work)
            self._t_mark = t1 = time.perf_counter()
            self.step_times["schedule"] += t1 - t0
            if work:
                cur = self._launch(work, self.scheduler.preempted)
            elif self.model.lora is not None:
                self.model.lora.host.wait(0.01)     # held for an adapter's files alone: no spinning
        if cur is not None and self.run_ahead is not None:
            self.run_ahead.launch_next(cur)
        self.commits.send()                  # the previous step's, encoded while the GPU works
        self._fault("after_launch")
        return self._complete(cur)

    def _launch(self, work: list[Work], preempted, ahead_ids=None) -> Launched:
        """Enqueue a step's forward (it writes the KV) and its sampling; nothing waits for the
        device.  ``ahead_ids``: the step's input tokens on the device, for a step launched
        before the previous one's tokens were read (their positions and slots are on the host)."""
        st, clock = self.step_times, time.perf_counter
        index = self.steps + (ahead_ids is not None)
        self._prefill_step = prefill = any(w.n > 1 or not w.sample for w in work)
        if self.model.lora is not None:      # a parked adapter this step needs takes a slot now
            self._adapters_in_slots(work)
        # The step fence marks only the launch of the kernels that write the KV (the graph's
        # replay; the eager forward), not the inputs' preparation: an engine killed in between
        # leaves the marker short, and its successor then waits for its exit (~0.1 s on an H200).
        logits, plp = self._decode_graph(work, index, ahead_ids), None
        if logits is None:
            plan = step_plan.eager_plan(work, self.cfg.block_size, index, prefill, known=ahead_ids is None,
                                        lora=step_plan.lora_slots(work, self.lora_slots))
            parts = step_plan.prompt_rows(plan, work)
            if self.tp is not None:
                self.tp.send(plan)
            ids, meta, rows = step_inputs(plan, self.device)
            t2 = clock()
            st["prepare_inputs"] += t2 - self._t_mark
            self._mark_launching()
            logits = self.model.forward(ids if ahead_ids is None else ahead_ids, meta, rows)
            self._mark_launched()
            self._t_mark = clock()
            st["forward"] += self._t_mark - t2
            self.step_counts["eager"] += 1
            if parts:             # the prompt positions' rows come after the sampled ones
                n = sum(w.sample for w in work)
                logits, plp = logits[:n], (logits[n:], parts)
        self.step_counts["sync" if ahead_ids is None else "async"] += 1
        la = Launched(work, list(preempted), prefill, sw=[w for w in work if w.sample], ahead=ahead_ids is not None,
                      plp=plp)
        if la.sw:
            la.ids = step_sampling.draw(self, logits, la.sw, ahead_ids)
            if any(w.seq.params.logprobs is not None for w in la.sw):
                la.logits = logits            # the model's distribution, as vLLM reports it by default
            if self.run_ahead is not None:
                la.copy_to_host()
        elif self.device.type == "cuda":
            # nothing waits for this forward (no row sampled): its commit waits for it, so the
            # journal never counts KV that a kill left unwritten (on a tensor-parallel group,
            # this rank's work ends with collectives that need every rank's KV written first)
            la.done = torch.cuda.Event()
            la.done.record()
        st["sample"] += clock() - self._t_mark
        self._t_mark = clock()
        return la

    def _complete(self, la: Launched | None) -> list[tuple]:
        """Read a launched step's tokens (``la`` None: a step with no work), finish it, snapshot
        its commit, land the previous commit and return the tokens that one made publishable."""
        st, clock = self.step_times, time.perf_counter
        t3 = clock()
        live = self.scheduler.seqs
        # rows of sequences that finished, were aborted or rewound after ``la`` was launched (a
        # step launched ahead) are dropped here: their tokens are never appended, journaled, published
        work = [w for w in la.work if la.current(w, live)] if la is not None else []
        sampled: dict[str, int] = {}
        if la is not None and la.sw:
            toks = la.read()                 # waits for the GPU
            sw = [(b, w) for b, w in enumerate(la.sw) if la.current(w, live)]
            sampled = {w.seq.rid: toks[b] for b, w in sw}
            self.step_counts["discarded"] += len(la.sw) - len(sw)
            want = [(b, w) for b, w in sw if w.seq.params.logprobs is not None]
            if want:
                lps = step_sampling.chosen_logprobs(la.logits, [b for b, _ in want], [toks[b] for b, _ in want],
                                                    [w.seq.params.logprobs for _, w in want])
                for (_, w), lp in zip(want, lps):
                    self._logprobs.setdefault(w.seq.rid, {})[len(w.seq.output_ids)] = lp
        if la is not None and la.plp is not None:
            self._hold_prompt_logprobs(la, live)
        t4 = clock()
        st["sample"] += t4 - t3
        grown, finished = self.scheduler.finish_step(work, sampled)
        if (finished or self._gone) and self.grammars.held():
            self.grammars.forget(live)
        self._fault("before_commit")
        t5 = clock()
        st["finish"] += t5 - t4
        # only sequences this step touched can have changed (plus new and preempted ones)
        snap = None
        if self.committer.journal is not None:
            seen = set()
            touched = [q for q in [w.seq for w in work] + (la.preempted if la is not None else []) + self._added
                       if live.get(q.rid) is q and not (id(q) in seen or seen.add(id(q)))]
            snap = self.committer.snapshot(touched, self._gone + [s.rid for s in finished], self.blocks.take_records())
        self._added = []
        self._gone = []
        epoch = self.blocks.epoch
        self.blocks.epoch += 1
        events = [(s.rid, len(s.output_ids) - 1, [s.output_ids[-1]], s.finish_reason) for s in grown]
        t6 = clock()
        st["commit_prepare"] += t6 - t5
        published = self.commits.land()         # the previous step's commit ran during this forward
        st["commit_wait"] += clock() - t6
        self._fault("after_commit")
        self.commits.hold(snap, events, epoch, la.done if la is not None else None)
        if not self.scheduler.has_work():
            if self.run_ahead is not None:
                self.run_ahead.drop()           # launched ahead, and every row of it finished
            published += self.commits.land()    # nothing left to overlap with: land it now
            self._record_cached()
        elif self._urgent:
            # a recovery's first step (this engine's first, or one that resumes a request from its
            # delivered tokens): its tokens are not held back a step
            published += self.commits.land()
        self._urgent = False
        self.steps += 1
        self.tokens_generated += len(grown)
        self._prefill_step = la is not None and la.prefill
        return published

    def _record_cached(self) -> None:
        """Record now the blocks that became cached when the last commit landed (no step follows
        to carry them: an idle engine's cache is found again after a restart)."""
        if self.blocks.recording and self.blocks.has_unrecorded:
            payload = self.committer.build(self.committer.snapshot([], (), self.blocks.take_records()))
            if payload is not None:
                self.commits.write_now(*payload)

    def flush(self) -> list[tuple]:
        """Complete a step launched ahead, land the in-flight commit and return the tokens they
        make publishable; no device work of this engine is left in flight after it."""
        events = []
        if self.run_ahead is not None:
            if self.run_ahead.pending is not None:
                events = self._complete(self.run_ahead.take())
            self.run_ahead.settle()
        return events + self.commits.land()

    def set_async_scheduling(self, on: bool) -> list[tuple]:
        """Turn asynchronous scheduling on or off between steps (the benchmark compares both on
        one engine); what was in flight is completed first: returns its events (``flush``)."""
        events = self.flush()
        self.cfg = dataclasses.replace(self.cfg, async_scheduling=on)
        self.run_ahead = RunAhead(self) if on and self.tp is None else None
        return events

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
            if self.failures:
                rid, why = self.failures[0]
                self.failures.clear()
                raise ValueError(f"request {rid}: {why}")
        return [out[r] for r in rids]
