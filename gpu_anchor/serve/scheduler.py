"""Continuous batching with chunked prefill over the paged cache (torch-free).

Each step is a list of ``Work(seq, start, n, sample)``: ``n`` tokens of ``seq`` starting
at position ``start`` (= its ``num_computed``) get their KV written; if they reach the
sequence's last token, the step's logits for it are sampled.  Decode steps are the
case ``n == 1``.  The schedule is a pure function of the sequences' state, their arrival
order and ``decodes_only`` (set for a recovery's first step), so a recovered engine decides
as the one that crashed would have, but for that first step, which only decodes.

LoRA adapters: with ``lora_capacity`` slots, a waiting request is admitted only if its adapter
is one a running request uses or the running requests' adapters leave a slot free.  So the
adapters of the running requests always fit the slots (``lora_slots.Adapters.make_resident``).
The oldest request held back that way (*the held request*) lets younger ones pass, as vLLM's
scheduler does: those on the base model or on an adapter already running are admitted, those
needing a slot wait.  Only the ``max_num_seqs`` requests that arrived next after it may pass:
later ones wait behind it, so the running requests' adapters drain and the first slot freed is
the held request's.  Its wait is bounded by the longest of those passers, where vLLM's has no
bound under a steady stream of requests on the running adapters; and where first come, first
served alone (before 2026-12-06) ran 64 requests on four adapters with two slots two at a time.
The rule reads only the sequences' arrival order and adapters, as the rest of the schedule.

One input is not the sequences' state: with ``--max-cpu-loras`` an adapter whose tensors the host
dropped must have its files read before a step can take it (``lora_ready``, ``lora_host.py``), and
a waiting request on it is held, as above, until they are; so which step admits it depends on
how long its files take.  Nothing else does, and without that option nothing does.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import prefix_cache
from .block_manager import BlockManager
from .sequence import Sequence, Status


@dataclass
class Work:
    seq: Sequence
    start: int
    n: int
    sample: bool


# Prompt positions whose logits one step computes for prompt log-probabilities, at most: each
# is a float32 [vocabulary] row of logits, and so is its log-softmax: 512 x 152k x 4 B = 0.3 GB
# each, within what the KV sizing reserves beyond its activation estimate.
PROMPT_LOGPROB_ROWS = 512


def prompt_logprob_rows(seq: Sequence, n: int) -> int:
    """Of the ``n`` positions ``seq``'s next chunk computes, those whose logits give a prompt
    token's log-probability (position p gives token p + 1's, for p + 1 in the prompt)."""
    if seq.params.prompt_logprobs is None or seq.output_ids:
        return 0
    return max(0, min(seq.num_computed + n, len(seq.prompt_ids) - 1) - seq.num_computed)


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int = 64, max_batched_tokens: int = 2048,
                 max_model_len: int = 4096, eos_token_ids=()) -> None:
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_batched_tokens = max_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.seqs: dict[str, Sequence] = {}     # every unfinished sequence
        self.preemptions = 0
        self.preempted: list[Sequence] = []     # by the last schedule() (their KV state changed)
        self.prefix_queries = self.prefix_hits = 0   # prompt tokens admitted / found cached (prefix caching)
        self.cached_tokens: dict[str, int] = {}      # rid -> tokens found cached, until its first token
        self.lora_capacity = 0                       # adapter slots (0: no adapters, no limit)
        self.lora_pass_window = max_num_seqs         # arrivals that may pass a held request (0: none)
        self.lora_ready = None                       # adapter name -> whether its tensors are at hand (None: all are)

    # ------------------------------------------------------------------ admission
    def add(self, seq: Sequence) -> None:
        if seq.rid in self.seqs:
            raise ValueError(f"request {seq.rid} already exists")
        if seq.num_tokens >= self.max_model_len:
            raise ValueError(f"request {seq.rid}: {seq.num_tokens} tokens, max_model_len is {self.max_model_len}")
        if -(-(seq.num_tokens + 1) // self.blocks.block_size) > self.blocks.num_blocks:
            raise ValueError(f"request {seq.rid} cannot fit in the KV cache")
        self.seqs[seq.rid] = seq

    def abort(self, rid: str) -> Sequence | None:
        seq = self.seqs.pop(rid, None)
        self.cached_tokens.pop(rid, None)
        if seq is not None:
            self.blocks.release(seq.block_table)
            seq.status, seq.finish_reason = Status.FINISHED, "abort"
        return seq

    def has_work(self) -> bool:
        return bool(self.seqs)

    def _ordered(self, status: Status) -> list[Sequence]:
        return sorted((s for s in self.seqs.values() if s.status is status), key=lambda s: (s.arrival, s.rid))

    def _preempt_one(self, keep: Sequence, scheduled: set[str]) -> bool:
        """Free blocks for ``keep``: preempt the youngest running sequence not scheduled in this
        step, else ``keep`` itself if another one is running (a sequence already given work in
        this step is never preempted: its work would have no blocks).  False: ``keep`` runs
        alone."""
        victims = [s for s in self._ordered(Status.RUNNING) if s is not keep and s.rid not in scheduled]
        if not victims:
            if not scheduled:
                return False
            victims = [keep]
        v = victims[-1]          # youngest first: the oldest keep making progress
        self.blocks.release(v.block_table)
        v.reset_kv()
        self.preemptions += 1
        self.preempted.append(v)
        return True

    # ------------------------------------------------------------------ stepping
    def schedule(self, decodes_only: bool = False) -> list[Work]:
        """The next step's work.  ``decodes_only``: no prefill chunk or admission this step if
        any decode was scheduled (a recovery's first step: a decode-only step runs as a CUDA
        graph, so the open streams' next tokens are not held up by an eager mixed step)."""
        budget = self.max_batched_tokens
        work: list[Work] = []
        self.preempted = []
        running = self._ordered(Status.RUNNING)
        # 1. decodes, oldest first.  Out of blocks: preempt the youngest running sequence;
        #    its blocks are reusable only after this step's commit, so the step goes on
        #    without the sequences that need them.
        self._cache_full: list[Sequence] = []
        scheduled: set[str] = set()
        for seq in running:
            if seq.status is not Status.RUNNING or seq.in_prefill or budget < 1:
                continue
            if not self.blocks.can_grow(seq.block_table, seq.num_computed + 1):
                if not self.blocks.has_pending and not self._preempt_one(seq, scheduled):
                    self._cache_full.append(seq)      # alone and still too long for the cache
                continue
            self.blocks.grow(seq.rid, seq.block_table, seq.num_computed + 1)
            work.append(Work(seq, seq.num_computed, 1, True))
            prefix_cache.remember(self.blocks, seq, seq.num_computed, seq.num_computed + 1)
            scheduled.add(seq.rid)
            budget -= 1
        if decodes_only and work:
            return work
        # 2. prefill chunks: partly prefilled sequences first, then new admissions.
        n_running = sum(1 for s in self.seqs.values() if s.status is Status.RUNNING)
        rows = PROMPT_LOGPROB_ROWS          # prompt positions whose logits this step may compute
        candidates = [s for s in self._ordered(Status.RUNNING) if s.rid not in scheduled]
        candidates += self._ordered(Status.WAITING)
        adapters = self.running_adapters() if self.lora_capacity else set()   # no scan without adapters
        held = None              # the oldest waiting request whose adapter finds no slot
        for seq in candidates:
            if budget < 1:
                break
            if seq.status is Status.WAITING and n_running >= self.max_num_seqs:
                break
            if held is not None and seq.arrival - held.arrival > self.lora_pass_window:
                break            # past the passing window: the running adapters drain for the held one
            lora = seq.params.lora
            if (seq.status is Status.WAITING and self.lora_capacity and lora is not None and lora not in adapters
                    and len(adapters) >= self.lora_capacity):
                held = held or seq
                continue         # its adapter needs a slot that running requests' adapters hold
            if seq.status is Status.WAITING and lora is not None and self.lora_ready and not self.lora_ready(lora):
                held = held or seq
                continue         # its adapter's files are being read (lora_host.py): the others go on
            hits = prefix_cache.take(self.blocks, seq) if seq.status is Status.WAITING else None
            if seq.status is Status.WAITING and not self.blocks.can_take(hits or [], seq.num_tokens + 1):
                break            # admit only what fits whole: partial admissions thrash with preemption
            if seq.status is Status.WAITING and self.blocks.prefix_caching:
                self.prefix_queries += seq.num_tokens
                if hits:
                    self.blocks.share(seq.block_table, hits)
                    seq.num_computed = len(hits) * self.blocks.block_size
                    self.prefix_hits += seq.num_computed
                seq.cached_tokens = seq.num_computed
                if seq.num_computed and not seq.output_ids:
                    self.cached_tokens[seq.rid] = seq.num_computed
            n = min(seq.num_tokens - seq.num_computed, budget)
            wanted = prompt_logprob_rows(seq, n)
            if wanted > rows:                  # chunk it so that its rows fit (each is a [V] row of logits)
                n -= wanted - rows
                if n < 1:
                    continue
            if not self.blocks.can_grow(seq.block_table, seq.num_computed + n):
                free_slots = (len(seq.block_table) + self.blocks.num_free) * self.blocks.block_size
                n = min(n, free_slots - seq.num_computed)
                if n < 1:
                    break        # wait for blocks; admitting out of order would starve the oldest
            self.blocks.grow(seq.rid, seq.block_table, seq.num_computed + n)
            if seq.status is Status.WAITING:
                seq.status = Status.RUNNING
                n_running += 1
                if lora is not None:
                    adapters.add(lora)
            rows -= prompt_logprob_rows(seq, n)
            work.append(Work(seq, seq.num_computed, n, seq.num_computed + n == seq.num_tokens))
            prefix_cache.remember(self.blocks, seq, seq.num_computed, seq.num_computed + n)
            budget -= n
        return work

    def running_adapters(self) -> set[str]:
        """The LoRA adapters the running requests use (they hold slots)."""
        return {s.params.lora for s in self.seqs.values() if s.status is Status.RUNNING and s.params.lora is not None}

    def stop_reason(self, seq: Sequence) -> str | None:
        """Why ``seq`` is complete with its last output token, or None."""
        tok, p = seq.output_ids[-1], seq.params
        if len(seq.output_ids) >= p.min_tokens and (tok in p.stop_token_ids or
                                                     (not p.ignore_eos and tok in self.eos_token_ids)):
            return "stop"
        if len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def finish_step(self, work: list[Work], sampled: dict[str, int]) -> tuple[list[Sequence], list[Sequence]]:
        """Advance after a step's forward.  Returns (sequences that got a token, finished ones)."""
        grown, finished = [], []
        for seq in getattr(self, "_cache_full", []):
            seq.status, seq.finish_reason = Status.FINISHED, "length"
            self.blocks.release(seq.block_table)
            del self.seqs[seq.rid]
            finished.append(seq)
        self._cache_full = []
        for w in work:
            seq = w.seq
            seq.num_computed = w.start + w.n
            prefix_cache.remember(self.blocks, seq, w.start)
            if not w.sample:
                continue
            seq.output_ids.append(sampled[seq.rid])
            grown.append(seq)
            reason = self.stop_reason(seq)
            if reason:
                seq.status, seq.finish_reason = Status.FINISHED, reason
                self.blocks.release(seq.block_table)
                del self.seqs[seq.rid]
                finished.append(seq)
        return grown, finished
