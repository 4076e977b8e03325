"""The per-step commit and the recovery read (the inference consistency protocol).

Journal keys (namespace of the engine's anchored objects):

- ``serve/layout``     KV layout + weights fingerprint the committed block tables refer to
- ``serve/weights``    fingerprint of the weights whose load completed (absent: load again)
- ``serve/req/<rid>``  prompt + sampling params, written once, in the step that admits it
- ``serve/st/<rid>``   num_computed, #outputs, status, block table   (rewritten when changed)
- ``serve/out/<rid>/<k>``  output tokens ``[64k, 64k+64)``           (only the last segment changes)

One ``journal.commit`` per step carries every change of that step, so the journal always
holds the state as of the end of some step: never a half-applied one.  See
``docs/serving.md`` for the state machine.
"""
from __future__ import annotations

import json
import logging

from .block_manager import BlockManager, InconsistentState
from .sequence import (OUT_SEGMENT, Sequence, Status, pack_ints, parse_request, parse_state, request_record,
                       segment_keys, state_record, unpack_ints)

log = logging.getLogger("gpu_anchor.serve")

P = "serve/"
LAYOUT, WEIGHTS = P + "layout", P + "weights"


def _req(rid):
    return f"{P}req/{rid}"


def _st(rid):
    return f"{P}st/{rid}"


def _out(rid, k):
    return f"{P}out/{rid}/{k}"


class Committer:
    """Turns the in-memory sequences into journal commits, sending only what changed."""

    def __init__(self, journal) -> None:
        self.journal = journal
        self._state: dict[str, bytes] = {}   # rid -> last committed state record
        self._nout: dict[str, int] = {}      # rid -> #outputs committed
        self.commits = 0
        self.bytes = 0

    def adopt(self, seqs) -> None:
        """After recovery: what the journal already holds for each sequence."""
        for s in seqs:
            self._state[s.rid] = state_record(s)
            self._nout[s.rid] = len(s.output_ids)

    def forget(self, rid: str) -> None:
        """The next commit writes this request from scratch (request, state, every segment)."""
        self._state.pop(rid, None)
        self._nout.pop(rid, None)

    def commit(self, live, gone=()) -> None:
        """``live``: every unfinished sequence; ``gone``: rids finished or aborted since the last commit."""
        payload = self.prepare(live, gone)
        if payload is not None:
            self.apply(*payload)

    def prepare(self, live, gone=()):
        """Build the commit of the current state: ``(puts, deletes)``, or ``None`` if nothing
        changed.  Updates the record caches as if it landed: apply it (in order) or die."""
        if self.journal is None:
            return None
        puts: dict[str, bytes] = {}
        deletes: list[str] = []
        for seq in live:
            rid = seq.rid
            if rid not in self._nout:
                puts[_req(rid)] = request_record(seq)
                n0 = 0
            else:
                n0 = self._nout[rid]
            st = state_record(seq)
            if st != self._state.get(rid):
                puts[_st(rid)] = st
                self._state[rid] = st
            for k in segment_keys(n0, len(seq.output_ids)):
                puts[_out(rid, k)] = pack_ints(seq.output_ids[k * OUT_SEGMENT:(k + 1) * OUT_SEGMENT])
            self._nout[rid] = len(seq.output_ids)
        for rid in gone:
            if rid not in self._nout:
                continue
            deletes += [_req(rid), _st(rid)]
            deletes += [_out(rid, k) for k in range(-(-self._nout.pop(rid) // OUT_SEGMENT))]
            self._state.pop(rid, None)
        if not puts and not deletes:
            return None
        return puts, deletes

    def apply(self, puts, deletes) -> None:
        """One atomic journal commit (safe to run on a helper thread)."""
        self.journal.commit(puts, deletes)
        self.commits += 1
        self.bytes += sum(len(k) + len(v) for k, v in puts.items())


def read_sequences(journal) -> tuple[list[Sequence], list[str]]:
    """The committed sequences, oldest first, and a list of problems found (each dropped
    record is named; a dropped request is re-sent by the frontend with its tokens)."""
    raw = journal.get_many(prefix=P)
    problems: list[str] = []
    seqs: list[Sequence] = []
    for key, blob in raw.items():
        if not key.startswith(P + "req/"):
            continue
        rid = key[len(P + "req/"):]
        try:
            seq = parse_request(rid, blob)
            st = raw.get(_st(rid))
            if st is None:
                raise ValueError("no state record")
            n_out = parse_state(seq, st)
            out: list[int] = []
            for k in range(-(-n_out // OUT_SEGMENT)):
                out += unpack_ints(raw[_out(rid, k)])
            if len(out) < n_out:
                raise ValueError(f"{len(out)} output tokens stored, {n_out} claimed")
            seq.output_ids = out[:n_out]
        except Exception as e:   # a damaged record: never guess
            problems.append(f"request {rid}: {e}")
            continue
        seqs.append(seq)
    seqs.sort(key=lambda s: (s.arrival, s.rid))
    return seqs, problems


def restore_kv(seqs: list[Sequence], blocks: BlockManager, kv_valid: bool, why: str = "") -> list[str]:
    """Give the committed block tables back to the block manager, or fall back.

    With ``kv_valid`` the sequences keep their KV (``num_computed`` tokens) and resume;
    otherwise — or if any table is inconsistent — every sequence drops its KV and its
    prompt + generated tokens are prefilled again.  Returns messages for the log.
    """
    notes = []
    if kv_valid:
        try:
            for s in seqs:
                if s.status is Status.WAITING and (s.block_table or s.num_computed):
                    raise InconsistentState(f"{s.rid}: waiting but holds KV")
                if not 0 <= s.num_computed <= s.num_tokens - 1:
                    raise InconsistentState(f"{s.rid}: num_computed {s.num_computed} of {s.num_tokens} tokens")
                if len(s.block_table) * blocks.block_size < s.num_computed:
                    raise InconsistentState(f"{s.rid}: {len(s.block_table)} blocks for {s.num_computed} tokens")
            blocks.adopt({s.rid: s.block_table for s in seqs})
            return notes
        except InconsistentState as e:
            why = f"committed block tables are inconsistent ({e})"
    if seqs:
        notes.append(f"anchored KV state unusable: {why}; recomputing the prefill of {len(seqs)} request(s)")
    for s in seqs:
        s.reset_kv()
    blocks.adopt({})
    return notes


def layout_record(d: dict) -> bytes:
    return json.dumps(d, sort_keys=True).encode()
