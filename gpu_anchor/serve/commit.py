"""The per-step commit, its one-step-deep pipeline and the recovery read (the inference
consistency protocol).

Journal keys (namespace of the engine's anchored objects):

- ``serve/layout``     KV layout + weights fingerprint the committed block tables refer to
- ``serve/weights``    fingerprint of the weights whose load completed (absent: load again)
- ``serve/req/<rid>``  prompt + sampling params, written once, in the step that admits it
- ``serve/st/<rid>``   num_computed, #outputs, status (12 bytes)     (rewritten when changed)
- ``serve/bt/<rid>``   the block table, int32s                       (rewritten when it changed:
                       a decode step adds a block every ``block_size`` tokens)
- ``serve/out/<rid>/<k>``  output tokens ``[64k, 64k+64)``           (only the last segment changes)
- ``serve/lora/<name>`` a served LoRA adapter: path, slot, digest (``lora.py``), written before
                       any request on it can be journaled, deleted when it is unloaded
- ``serve/pc/<block>`` a cached block's digest (16 bytes) and when it was recorded (u64): written
                       in the commit after the block became cached, deleted (and landed) before
                       the block is written again (``block_manager.py``, "Cached blocks across a restart")

One ``journal.commit`` per step carries every change of that step, so the journal always
holds the state as of the end of some step: never a half-applied one.  See
``docs/serving.md`` for the state machine.
"""
from __future__ import annotations

import json
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor

from . import prefix_cache
from .block_manager import BlockManager, InconsistentState
from .sequence import (OUT_SEGMENT, Sequence, Status, pack_ints, pack_state, parse_request, parse_state,
                       request_record, segment_keys, unpack_ints)

log = logging.getLogger("gpu_anchor.serve")

P = "serve/"
LAYOUT, WEIGHTS = P + "layout", P + "weights"
LORA = P + "lora/"
PC = P + "pc/"


def _req(rid):
    return f"{P}req/{rid}"


def _st(rid):
    return f"{P}st/{rid}"


def _bt(rid):
    return f"{P}bt/{rid}"


def _out(rid, k):
    return f"{P}out/{rid}/{k}"


class Committer:
    """Turns the in-memory sequences into journal commits, sending only what changed."""

    def __init__(self, journal) -> None:
        self.journal = journal
        self._head: dict[str, tuple] = {}    # rid -> last committed (num_computed, #outputs, status)
        self._table: dict[str, list] = {}    # rid -> last committed block table
        self._nout: dict[str, int] = {}      # rid -> #outputs committed
        self._keys: dict[str, tuple] = {}    # rid -> its journal keys (st, bt, out prefix)
        self.commits = 0
        self.bytes = 0
        self.pc_clock = 0       # the order cached blocks were recorded in (read back by ``read_cached``)

    def adopt(self, seqs) -> None:
        """After recovery: what the journal already holds for each sequence (its state and
        table records are rewritten the first time it changes: that also upgrades a record
        of the older single-record format)."""
        for s in seqs:
            self._nout[s.rid] = len(s.output_ids)

    def forget(self, rid: str) -> None:
        """The next commit writes this request from scratch (request, state, every segment)."""
        self._head.pop(rid, None)
        self._table.pop(rid, None)
        self._nout.pop(rid, None)

    def rewind(self, rid: str, n: int) -> None:
        """Only the first ``n`` output tokens of ``rid`` stand as committed: the next commit
        rewrites its output segments from there (its outputs were replaced after that)."""
        if rid in self._nout:
            self._nout[rid] = min(self._nout[rid], n)

    def commit(self, live, gone=()) -> None:
        """``live``: every unfinished sequence that may have changed since the last commit;
        ``gone``: rids finished or aborted since the last commit."""
        payload = self.prepare(live, gone)
        if payload is not None:
            self.apply(*payload)

    def prepare(self, live, gone=()):
        """Build the commit of the current state: ``(puts, deletes)``, or ``None`` if nothing
        changed (``build(snapshot(...))``)."""
        return self.build(self.snapshot(live, gone))

    def snapshot(self, live, gone=(), cached=()):
        """What changed since the last snapshot, cheaply (compares, no encoding): the part of
        a commit that must run at the end of the step.  Updates the record caches as if the
        commit landed: build and apply every snapshot, in order, or die.

        ``live`` need only hold the sequences that may have changed (the engine passes the
        step's scheduled, preempted and newly added ones); the others' records stand.  The
        snapshot stays valid while the sequences move on: it copies the changed block table
        (a later step may clear it) and keeps only a prefix length of the output ids, which
        are append-only.  ``cached``: ``(block, digest)`` of blocks to record
        (``BlockManager.take_records``)."""
        if self.journal is None:
            return None
        rows = []
        heads, tables, nout = self._head, self._table, self._nout
        for seq in live:
            rid = seq.rid
            n = len(seq.output_ids)
            n0 = nout.get(rid)
            new = n0 is None
            if new:
                n0 = 0
            head = (seq.num_computed, n, seq.status)
            if head == heads.get(rid):
                head = None
            else:
                heads[rid] = head
            table = seq.block_table
            if table == tables.get(rid):
                table = None
            else:
                table = tables[rid] = table.copy()
            nout[rid] = n
            if new or head is not None or table is not None or n != n0:
                rows.append((seq if new else None, rid, head, table, seq.output_ids, n0, n))
        deletes: list[str] = []
        for rid in gone:
            if rid not in nout:
                continue
            deletes += [_req(rid), _st(rid), _bt(rid)]
            deletes += [_out(rid, k) for k in range(-(-nout.pop(rid) // OUT_SEGMENT))]
            heads.pop(rid, None)
            tables.pop(rid, None)
            self._keys.pop(rid, None)
        pcs = []
        for b, d in cached:
            self.pc_clock += 1
            pcs.append((b, d, self.pc_clock))
        if not rows and not deletes and not pcs:
            return None
        return rows, deletes, pcs

    def build(self, snap):
        """Encode a snapshot into ``(puts, deletes)`` (the engine runs this while the next
        step's forward is on the GPU); ``None`` for an empty snapshot."""
        if snap is None:
            return None
        rows, deletes, pcs = snap
        puts: dict[str, bytes] = {PC + str(b): d + t.to_bytes(8, "little") for b, d, t in pcs}
        keys = self._keys
        for seq, rid, head, table, out, n0, n in rows:
            if seq is not None:
                puts[_req(rid)] = request_record(seq)
            kk = keys.get(rid)
            if kk is None:
                kk = keys[rid] = (_st(rid), _bt(rid), _out(rid, ""))
            if head is not None:
                puts[kk[0]] = pack_state(*head)
            if table is not None:
                puts[kk[1]] = pack_ints(table)
            for k in segment_keys(n0, n):
                puts[kk[2] + str(k)] = pack_ints(out[k * OUT_SEGMENT:min((k + 1) * OUT_SEGMENT, n)])
        return puts, deletes

    def apply(self, puts, deletes) -> None:
        """One atomic journal commit (safe to run on a helper thread)."""
        self.journal.commit(puts, deletes)
        self.commits += 1
        self.bytes += sum(len(k) + len(v) for k, v in puts.items())


class _Immediate:
    """Runs 'submitted' work at once (no journal: nothing to overlap)."""

    def submit(self, fn, *args) -> Future:
        f: Future = Future()
        f.set_result(fn(*args))
        return f


class Pipeline:
    """The engine's commits, pipelined one step deep.  Step N's commit is snapshotted at its end
    (``hold``: cheap compares), encoded by the step after it right after launching its forward
    and sent from a helper thread while that forward runs (``send``), and awaited at that
    step's end (``land``): only then are step N's tokens returned for publishing, and the
    blocks step N released reusable (``BlockManager`` epochs).  ``times``: the engine's host
    seconds per phase (``commit_build`` is added here)."""

    def __init__(self, committer: Committer, blocks: BlockManager, times: dict) -> None:
        self.committer, self.blocks, self.times = committer, blocks, times
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="serve-commit") if committer.journal is not None \
            else _Immediate()
        # [future, snapshot not yet sent, events it makes publishable, epoch, device work to wait for]
        self._held = None
        self.unrecords, self.unrecord_s = 0, 0.0       # ``unrecord`` calls and the seconds they waited

    def start(self, initializer) -> None:
        """Run ``initializer`` on the commit thread, started now (else the thread starts at the
        first commit), or on the caller's thread when commits run there (no journal)."""
        if isinstance(self._pool, _Immediate):
            initializer()
            return
        self._pool.shutdown(wait=True)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="serve-commit", initializer=initializer)
        self._pool.submit(lambda: None).result()

    def hold(self, snap, events: list[tuple], epoch: int, done=None) -> None:
        """Step ``epoch``'s commit (``Committer.snapshot``) and the events it makes publishable;
        ``done``: an event its KV writes end with, when no sampling waited for them."""
        self._held = [None, snap, events, epoch, done]

    def send(self) -> None:
        """Encode the held snapshot and hand it to the commit thread."""
        h = self._held
        if h is None or h[1] is None:
            return
        t = time.perf_counter()
        payload = self.committer.build(h[1])
        h[1] = None
        if payload is not None:
            h[0] = self._pool.submit(self._apply_after, h[4], *payload)
        self.times["commit_build"] += time.perf_counter() - t

    def write_now(self, puts, deletes=()) -> None:
        """Commit ``puts`` and ``deletes`` after every commit handed to the commit thread so far,
        and return once it landed (between steps: a LoRA adapter's record)."""
        if self.committer.journal is not None:
            self._pool.submit(self.committer.apply, puts, list(deletes)).result()

    def unrecord(self, blocks) -> None:
        """Delete the records of cached ``blocks`` (``BlockManager.unrecord``): the held commit
        (which may carry some of them) is sent first, and this returns once the deletion landed."""
        t = time.perf_counter()
        self.send()
        self.write_now({}, [PC + str(b) for b in blocks])
        self.unrecords += 1
        self.unrecord_s += time.perf_counter() - t

    def _apply_after(self, done, puts, deletes) -> None:
        if done is not None:
            done.synchronize()
        self.committer.apply(puts, deletes)

    def land(self) -> list[tuple]:
        """Wait for the held commit; then its blocks may be reused and its tokens published."""
        if self._held is None:
            return []
        self.send()
        fut, _, events, epoch, _ = self._held
        self._held = None
        if fut is not None:
            fut.result()             # a failed commit raises: the engine dies, nothing unsafe was published
        self.blocks.on_commit(epoch)
        return events

    def drop_unpublished(self, rid: str) -> None:
        """``rid`` was aborted or replaced: its held tokens are not published."""
        if self._held is not None:
            self._held[2] = [e for e in self._held[2] if e[0] != rid]


def read_sequences(journal, damaged: list[str] | None = None) -> tuple[list[Sequence], list[str]]:
    """The committed sequences, oldest first, and a list of problems found (each dropped
    record is named; a dropped request is re-sent by the frontend with its tokens).
    ``damaged``, if given, gets the key of each dropped request record (one journal read)."""
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
            n_out = parse_state(seq, st, raw.get(_bt(rid)))
            out: list[int] = []
            for k in range(-(-n_out // OUT_SEGMENT)):
                out += unpack_ints(raw[_out(rid, k)])
            if len(out) < n_out:
                raise ValueError(f"{len(out)} output tokens stored, {n_out} claimed")
            seq.output_ids = out[:n_out]
        except Exception as e:   # a damaged record: never guess
            problems.append(f"request {rid}: {e}")
            if damaged is not None:
                damaged.append(key)
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
            blocks.adopt({s.rid: s.block_table for s in seqs},
                         shared_below={s.rid: s.num_computed // blocks.block_size for s in seqs})
            prefix_cache.rebuild(blocks, seqs)
            return notes
        except InconsistentState as e:
            why = f"committed block tables are inconsistent ({e})"
    if seqs:
        notes.append(f"anchored KV state unusable: {why}; recomputing the prefill of {len(seqs)} request(s)")
    for s in seqs:
        s.reset_kv()
    blocks.adopt({})
    return notes


def read_cached(raw: dict) -> tuple[list[tuple[int, bytes]], list[str], int]:
    """The records of cached blocks among journal entries ``raw`` (``serve/...``), in the order
    they were recorded, the keys of damaged ones, and the last record's order (``pc_clock``)."""
    out, damaged = [], []
    for key, blob in raw.items():
        if key.startswith(PC):
            try:
                b = int(key[len(PC):])
            except ValueError:
                b = None
            if b is None or len(blob) != 24:
                damaged.append(key)
            else:
                out.append((int.from_bytes(blob[16:], "little"), b, bytes(blob[:16])))
    out.sort()
    return [(b, d) for _, b, d in out], damaged, out[-1][0] if out else 0


def layout_record(d: dict) -> bytes:
    return json.dumps(d, sort_keys=True).encode()
