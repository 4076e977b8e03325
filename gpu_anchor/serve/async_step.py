"""Asynchronous scheduling: the next decode step is on the device before this one's tokens are read.

A synchronous step ends by reading its sampled tokens (the host waits for the GPU), then
finishes, commits and returns; the next step's forward is launched only after all that host
work, so the GPU idles through it (~1.1 ms of a 7.2 ms decode step on an H200, Qwen3-8B shape,
64 streams).  With ``EngineConfig(async_scheduling=True)`` (``--async-scheduling``), in steady
decode, step N+1 is planned and launched *before* the host reads step N's tokens:

- its input token of each sequence is step N's sampled token, still on the device: the graph's
  static input buffer (or the eager forward's ids) is filled by a device-to-device copy;
- its positions, KV slots and block tables are known on the host in advance: each sequence
  grows by exactly one token, so its slot (and a new block every ``block_size`` tokens) is
  allocated here, before step N's tokens are known;
- step N's sampled ids are copied to pinned host memory right after its sampling, with an
  event, so reading them waits for step N only, not for step N+1 queued behind it.

A sequence that finishes at step N (stop token, EOS, abort) has had one token too many computed
at N+1: ``Engine._complete`` keeps only the rows whose sequence is still live (the same
``Sequence`` object in the scheduler, its history not rewound in place by ``Engine.readd``
since), so that token is never appended, journaled, published or counted.  Rows that will
finish at N by length (``max_tokens``, ``max_model_len``) are known in advance and not computed
at all.  The discarded row's KV write is harmless: it lands at the
sequence's position ``num_computed`` of step N's commit (past everything any commit counts), in a
block of its own table; that table's blocks are released at N's completion and, like every
released block, reusable only once commit N has landed — after step N+1 was launched, so any
later writer of the block runs behind N+1 on the one stream.

The step's ordering and what two steps in flight mean for the commit and the step fence are in
docs/serving.md ("Asynchronous scheduling").  The next step runs synchronously (scheduled after
the read, as before) whenever running ahead is not simple to make right: the step just launched
has rows that are not sampled (prefill chunks), a request waits for admission or any unfinished
sequence is not in the step (a partial prefill, a preemption, a sequence the cache cannot hold),
the blocks for the next slots are not free (the synchronous scheduler preempts), log-probabilities
are asked for, a row's output is constrained by a grammar (its mask needs the token step N samples:
``grammar_matchers``), or tensor parallelism is on.  Penalties count every token generated, step N's
included: the step launched ahead counts it from the device (``logit_adjust``, ``pending``).
"""
from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field

import torch

from .attention import to_device
from .scheduler import Work


@dataclass
class Launched:
    """A step whose forward and sampling are enqueued on the device; its tokens are not read yet."""
    work: list[Work]
    preempted: list
    prefill: bool
    sw: list[Work] = field(default_factory=list)     # the rows sampled, in the order of ``ids``
    ids: torch.Tensor | None = None                  # their sampled ids, on the device
    logits: torch.Tensor | None = None               # kept only when some row asks for log-probabilities
    plp: tuple | None = None     # (logits of prompt positions, [(work item, first position, count)])
    done: object = None          # a CUDA event after the forward, for a step with no row sampled
    host: torch.Tensor | None = None                 # pinned copy of ``ids`` ...
    ready: object = None                             # ... complete once this event has
    ahead: bool = False          # launched before the previous step's tokens were read
    stale: set = field(default_factory=set)          # id() of sequences whose history changed since

    def current(self, w: Work, live: dict) -> bool:
        """Is row ``w`` still the sequence's next token?  Not once the sequence finished or was
        aborted (it left ``live``, or another request took its id) or was rewound (``stale``)."""
        return live.get(w.seq.rid) is w.seq and id(w.seq) not in self.stale

    def copy_to_host(self) -> None:
        """Start the copy of the sampled ids to the host now, before a later step is enqueued
        behind this one: ``read`` then waits for this step only."""
        if self.ids is not None and self.ids.is_cuda:
            self.host = torch.empty(self.ids.shape, dtype=self.ids.dtype, pin_memory=True)
            self.host.copy_(self.ids, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record()

    def read(self) -> list[int]:
        """The sampled ids (waits for this step's device work)."""
        if self.ready is not None:
            self.ready.synchronize()
            return self.host.tolist()
        return self.ids.tolist()

    def settle(self) -> None:
        """Wait until this step's device work is done (its tokens unread or discarded)."""
        if self.ready is not None:
            self.ready.synchronize()
        elif self.done is not None:
            self.done.synchronize()


class RunAhead:
    """The engine's asynchronous scheduling: at most one step launched ahead (``pending``)."""

    def __init__(self, eng) -> None:
        # a proxy, not a reference: the engine holds this object, and a cycle would keep a
        # dropped engine's device memory until Python's collector ran (the pre-warm's scratch
        # engine: 1.70 GB still allocated after it returned, on the H200)
        self.eng = weakref.proxy(eng)
        self.pending: Launched | None = None
        self._dropped: Launched | None = None     # launched, then every row of it finished

    def take(self) -> Launched | None:
        la, self.pending = self.pending, None
        return la

    def next_work(self, cur: Launched) -> list[Work] | None:
        """The decode step that follows ``cur`` (each sequence one token further), or None
        when it must be scheduled synchronously (the module's doc lists when)."""
        eng = self.eng
        if eng.tp is not None or not cur.sw or len(cur.sw) != len(cur.work):
            return None
        live, limit = eng.scheduler.seqs, eng.scheduler.max_model_len
        rows, ending = [], 0
        for b, w in enumerate(cur.sw):
            s = w.seq
            if not cur.current(w, live):
                continue                                  # aborted or rewound since ``cur`` was launched
            if s.params.logprobs is not None or s.params.grammar is not None:
                return None
            # after ``cur`` (whose token is not appended yet) the sequence has w.start + w.n + 1 tokens
            if len(s.output_ids) + 1 >= s.params.max_tokens or w.start + w.n + 1 >= limit:
                ending += 1                               # finishes at ``cur`` by length: no next row
                continue
            rows.append(b)
        if not rows or len(rows) + ending != len(live) or len(rows) > eng.scheduler.max_batched_tokens:
            return None                                  # someone waits, or runs outside this step
        blocks = eng.blocks
        need = sum(blocks.blocks_needed(len(cur.sw[b].seq.block_table), cur.sw[b].start + cur.sw[b].n + 1)
                   for b in rows)
        if need > blocks.num_free:
            return None                                  # the synchronous scheduler preempts
        self._rows = rows
        # the next token of each: position w.start + w.n (cur's last token), its slot allocated now
        return [Work(cur.sw[b].seq, cur.sw[b].start + cur.sw[b].n, 1, True) for b in rows]

    def launch_next(self, cur: Launched) -> None:
        """Launch the step after ``cur`` now, if it can run ahead (else the next ``Engine.step``
        schedules it after reading ``cur``)."""
        eng = self.eng
        t0 = time.perf_counter()
        work = self.next_work(cur)
        if work is None:
            eng.step_times["schedule"] += time.perf_counter() - t0
            return
        for w in work:           # the slot of position w.start (a new block every block_size tokens)
            eng.blocks.grow(w.seq.rid, w.seq.block_table, w.start + 1)
        ids = cur.ids
        if len(self._rows) != ids.shape[0]:
            ids = ids[to_device(torch.tensor(self._rows, dtype=torch.long), ids.device)]
        eng._t_mark = t1 = time.perf_counter()
        eng.step_times["schedule"] += t1 - t0
        self.pending = eng._launch(work, [], ahead_ids=ids)

    def forget(self, seq) -> None:
        """``seq``'s history was replaced in place (``Engine.readd``): its row of the step
        launched ahead computes a token of the old history; it is dropped at completion."""
        if self.pending is not None:
            self.pending.stale.add(id(seq))

    def drop(self) -> None:
        """Nothing is left to run: a step launched ahead now has no live row; forget it (its
        device work finishes on its own; ``settle`` waits for it)."""
        if self.pending is not None:
            self._dropped, self.pending = self.pending, None

    def settle(self) -> None:
        """No device work of a dropped step is left once this returns."""
        if self._dropped is not None:
            self._dropped.settle()
            self._dropped = None
