"""An engine's take-over: from bound state to serving (``Engine.take_over``).

Every engine goes through it: a fresh one right after binding the anchored weights and KV cache
(``Engine.__init__``), a hot standby once the live engine is dead.  It builds the block manager
and the scheduler, reads the journal, restores every committed sequence (its KV reused when
every rank can vouch for it, else recomputed: ``commit.restore_kv``), commits the new layout in
one atomic step with whatever it had to drop, and registers with the step fence.  Split from
``engine.py`` (the step loop) as a mixin of ``Engine``: it sets the attributes the steps use.
"""
from __future__ import annotations

import logging
import os
import time

import torch

from . import commit as C
from . import lora, lora_slots, prefix_cache
from .async_step import RunAhead
from .block_manager import BlockManager
from .model_runner import eos_token_ids
from .scheduler import Scheduler
from .sequence import Sequence, Status

log = logging.getLogger("gpu_anchor.serve")


class TakeOver:
    def take_over(self, progress=None, _t0: float | None = None, fence=None) -> None:
        """Become the serving engine: judge the anchored KV by the journal as it is now, restore
        every committed sequence, and set up the scheduler and the commit pipeline.  The
        constructor calls it; a hot standby (``standby=True``) calls it at take-over, once the
        engine it replaces is dead (never before: the dead engine's queued kernels could still
        write KV).  Raises ``NotAttachable`` if the namespace changed under the standby since it
        attached (the weights fingerprint is gone or another): build an ordinary engine then.
        ``fence``: see the constructor; the engine before this one must be quiet by then
        (``StepFence.quiesce``): this engine's marks start from the page's present count."""
        t0 = time.perf_counter() if _t0 is None else _t0
        cfg, st = self.cfg, self.state
        report = progress or (lambda phase, done=None, total=None: None)
        if self.standby:
            st.recheck()
            self.standby = False
            # what the standby did before the fault is not part of this take-over's time
            self.timings = {k if k.startswith("standby_") else "standby_" + k: v for k, v in self.timings.items()}
            self.timings["recheck_s"] = time.perf_counter() - t0
        self.blocks = BlockManager(cfg.num_blocks, cfg.block_size, cfg.prefix_caching)
        self._name_adapters()
        eos = eos_token_ids(self.mc, cfg.model)
        self.scheduler = Scheduler(self.blocks, cfg.max_num_seqs, cfg.max_batched_tokens, cfg.max_model_len, eos)
        ads = self.model.lora
        self.scheduler.lora_capacity = ads.capacity if ads is not None else 0
        if ads is not None and ads.host_capacity is not None:    # adapters on disk: read before admitted
            self.scheduler.lora_ready = ads.ready
        journal = st.journal
        self.committer = C.Committer(journal)
        self.step_times = dict.fromkeys(("schedule", "prepare_inputs", "forward", "commit_build", "sample",
                                         "finish", "commit_prepare", "commit_wait"), 0.0)
        self.commits = C.Pipeline(self.committer, self.blocks, self.step_times)
        # cached blocks recorded in the journal, so that a restarted engine finds them again
        self.blocks.recording = journal is not None and cfg.prefix_caching
        self.blocks.unrecord = self.commits.unrecord
        t3 = time.perf_counter()
        self.recovery_notes: list[str] = []
        self.restored: list[Sequence] = []
        # log-probabilities of sampled tokens not yet published: rid -> {output index: (lp, top)}
        self._logprobs: dict[str, dict[int, tuple]] = {}
        # prompt log-probabilities, sent with the first token: rid -> (prompt length, {position: (lp, top)})
        self._prompt_lps: dict[str, tuple[int, dict]] = {}
        why = st.kv_problem() if journal is not None else ""
        if self.tp is not None:     # every rank's answer, before anything is decided
            t4 = time.perf_counter()
            why = self.tp.agree(why)
            self.timings["tp_agree_s"] = time.perf_counter() - t4     # waiting for the other ranks
            self.timings["tp_ranks_init_s"] = self.tp.slowest_s
        if journal is not None:
            report("restore")
            self._restore(journal, why)
        if self.tp is not None:     # the decision is committed: the other ranks may record their layout
            self.tp.send({"t": "go", "lora": lora_slots.runtime_table(self.model.lora)})
        self.timings["restore_s"] = time.perf_counter() - t3
        self._arrivals = max([s.arrival for s in self.restored], default=-1) + 1
        self._gone: list[str] = []
        self._added: list[Sequence] = []     # admitted or rewound since the last commit
        self.failures: list[tuple[str, str]] = []      # (request, why) ended by the engine, not yet told
        self._urgent = True       # the next step lands its commit at once (see ``step``)
        self._prefill_step = False
        self.tokens_generated = 0
        # steps launched by their graph / eagerly; synchronously (scheduled after the previous
        # step's tokens were read) / asynchronously (launched ahead of that read: async_step.py) a
        # step launched ahead; ``discarded``: rows launched ahead whose sequence had finished (dropped)
        self.step_counts = {"graph": 0, "eager": 0, "sync": 0, "async": 0, "discarded": 0}
        # asynchronous scheduling: on by default on CUDA without tensor parallelism
        run_ahead = cfg.async_scheduling if cfg.async_scheduling is not None else \
            (self.device.type == "cuda" and self.tp is None)
        self.run_ahead = RunAhead(self) if run_ahead and self.tp is None else None
        if cfg.async_scheduling and self.tp is not None:
            log.warning("asynchronous scheduling is not built for tensor parallelism: every step runs synchronously")
        # A request that wants log-probabilities resumes one token back: its last committed token
        # may never have reached the client, and the journal keeps no log-probabilities, so the
        # first step samples it again with them (the step runs anyway: no prefill, and no round
        # trip to the frontend for the token).  A client that has it sees it replayed (compared).
        for s in self.restored:
            if s.params.logprobs is not None and s.output_ids:
                self._rewind(s, s.output_ids[:-1])
        if fence is not None and self.tp is None:
            t5 = time.perf_counter()
            self._on_device()
            fence.register_device() if self.device.type == "cuda" else fence.host_only()
            # this thread and the commit thread are the writers the supervisor watches
            fence.hold_writer(0)
            self.commits.start(lambda: fence.hold_writer(1))
            self.timings["fence_s"] = time.perf_counter() - t5
            self.fence = fence
            self._stream = torch.cuda.current_stream(self.device).cuda_stream if self.device.type == "cuda" else None
        self.timings["init_s" if _t0 is not None else "take_over_s"] = time.perf_counter() - t0

    # ------------------------------------------------------------------ recovery
    def _restore(self, journal, why: str) -> None:
        """Restore the committed sequences; ``why``: the reason (of any rank) not to trust the
        anchored KV, "" if every rank can."""
        bad: list[str] = []       # the damaged requests' records, removed below
        seqs, problems = C.read_sequences(journal, bad)
        changed, adapter_puts, adapter_deletes = self._restore_adapters(journal, problems)
        served = self.model.lora.served if self.model.lora is not None else {}
        unserved = [s for s in seqs if s.params.lora is not None
                    and (s.params.lora not in served or s.params.lora in changed)]
        for s in unserved:      # a journal of a server that served other adapters: never the wrong weights
            problems.append(f"request {s.rid}: LoRA adapter {s.params.lora!r} "
                            + changed.get(s.params.lora, "is not served by this engine"))
            bad.append(C.P + "req/" + s.rid)
        gone = {s.rid for s in unserved}
        held: set = set()       # adapters the running restored requests hold slots for, oldest first
        for s in sorted((s for s in seqs if s.rid not in gone and s.params.lora is not None
                         and s.status is Status.RUNNING), key=lambda s: (s.arrival, s.rid)):
            if s.params.lora in held or len(held) < self.scheduler.lora_capacity:
                held.add(s.params.lora)
                continue
            problems.append(f"request {s.rid}: LoRA adapter {s.params.lora!r} needs a slot, and the "
                            f"{self.scheduler.lora_capacity} of --max-loras hold the older requests' adapters")
            bad.append(C.P + "req/" + s.rid)
            gone.add(s.rid)
        seqs = [s for s in seqs if s.rid not in gone]
        dropped = C.restore_kv(seqs, self.blocks, kv_valid=not why, why=why)
        # the previous engines' cached blocks: trusted only where their tables' KV is (none dropped)
        records, damaged, self.committer.pc_clock = C.read_cached(journal.get_many(prefix=C.PC))
        stale = self.blocks.adopt_records(records) if not why and not dropped else [b for b, _ in records]
        bad += damaged + [C.PC + str(b) for b in stale]
        if self.blocks.num_cached:
            log.info("%d cached block(s) of the previous engine found again (prefix cache)", self.blocks.num_cached)
        notes = problems + dropped
        for n in notes:
            log.warning("%s", n)
        self.recovery_notes = notes
        for s in seqs:
            self.scheduler.seqs[s.rid] = s
        # One atomic commit: the new layout, a dropped (damaged) record's removal and, if the
        # KV is gone, every sequence without it.  Were the layout committed first, a crash
        # before the rest would leave it vouching for a KV cache no step ever wrote.
        self.committer.adopt(seqs)
        puts, deletes = {C.LAYOUT: self.state.layout, **adapter_puts}, bad + adapter_deletes
        if dropped:
            reset = self.committer.prepare(seqs)
            if reset is not None:
                puts.update(reset[0])
                deletes = deletes + reset[1]
        self.committer.apply(puts, deletes)
        self.restored = seqs

    def _restore_adapters(self, journal, problems: list[str]) -> tuple[dict, dict, list]:
        """Serve again the LoRA adapters the journal says were loaded while serving (read from
        their paths, into their slots, unless a hot standby loaded them ahead:
        ``follow_adapters``), and compare every journaled adapter's digest with the one served
        now.  Returns ``({name: why its requests' KV cannot be trusted}, the adapter records to
        write, the stale ones to delete)``, committed with the restored layout."""
        ads = self.model.lora
        records, changed = lora.parse_records(journal.get_many(prefix=C.LORA), C.LORA)
        problems += [f"LoRA adapter {name!r} {why}" for name, why in changed.items()]
        changed.update(self._follow_records(records, retry=True))
        for name, r in records.items():
            if ads is not None and name in ads.served and ads.served[name][1] != r["digest"]:
                changed[name] = (f"is not what its requests' KV was computed with: the tensors at "
                                 f"{ads.served[name][0]} changed since (digest {r['digest'][:12]}, now "
                                 f"{ads.served[name][1][:12]})")
        self._name_adapters()
        served = ads.served if ads is not None else {}
        return (changed, {C.LORA + n: ads.record(n) for n in served},
                [C.LORA + n for n in [*records, *changed] if n not in served])

    def follow_adapters(self) -> None:
        """A hot standby, while it waits: load the adapters the live engine loaded while serving
        since the standby was built (and drop those it unloaded), from the journal's records, so
        that its take-over reads no adapter file.  Best effort: a failure is logged, and the
        take-over tries again."""
        journal = self.state.journal
        if journal is None or self.model.lora is None or not self.cfg.runtime_lora:
            return
        records, _ = lora.parse_records(journal.get_many(prefix=C.LORA), C.LORA)
        for name, why in self._follow_records(records, retry=False).items():
            log.warning("hot standby %d: LoRA adapter %r %s", os.getpid(), name, why)

    def _follow_records(self, records: dict, retry: bool) -> dict:
        """Make the adapters loaded while serving match the journal's ``records``: one whose
        record is gone or replaced since it was loaded goes, one with a record is loaded into
        its slot (``retry``: also one whose load failed before).  Returns ``{name: why}`` for
        those that could not be loaded."""
        ads, failed = self.model.lora, {}
        if ads is None or not self.cfg.runtime_lora:
            return failed       # another server's adapters: their requests are not served here
        seen = self.adapter_records
        for name, (_, _, runtime) in list(ads.served.items()):
            if runtime and records.get(name) != seen.get(name, records.get(name)):
                ads.remove(name)
        for name, r in records.items():
            if not r["runtime"] or name in ads.served or (seen.get(name) == r and not retry):
                continue
            seen[name] = r
            try:
                ads.serve(lora.read_for(self.cfg, self.mc, self.state.weights, name, r["path"], 0),
                          slot=r["slot"] if r["slot"] >= 0 else None, runtime=True)
                log.info("LoRA adapter %r (loaded while serving) read again from %s", name, r["path"])
            except Exception as e:      # noqa: BLE001 — unreadable now: its requests are recomputed, named
                failed[name] = f"(loaded while serving from {r['path']}) could not be loaded again: {e}"
        return failed

    def _name_adapters(self) -> None:
        """The prefix cache names a served adapter's blocks by its digest (``prefix_cache``)."""
        for name, (_, digest, _) in (self.model.lora.served if self.model.lora is not None else {}).items():
            prefix_cache.adapter_loaded(self.blocks, name, digest)
