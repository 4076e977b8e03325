"""Paged KV block allocation, with prefix caching (torch-free).

Blocks released by a step are not reusable until that step is committed
(``release`` → ``pending`` → ``on_commit`` → free).  This is what keeps the KV of the
last committed state intact through a crash: an uncommitted step may only write to
blocks that are free in the committed state, or to slots past its own sequences'
committed ``num_computed`` — never over KV that a committed sequence still needs.

Prefix caching (``prefix_caching=True``; ``prefix_cache.py`` names the blocks): a block whose
every slot holds computed KV gets a digest of the tokens up to its end (and the LoRA adapter
they went through).  A new request whose first blocks' digests are known shares those blocks
instead of computing them again.  Each block is in exactly one state:

- *owned*: in the tables of ``refs[b]`` >= 1 sequences; a block with more than one owner, or
  with a digest, is never written again (``writable_from`` takes a sequence off such blocks
  before it recomputes their positions);
- *pending*: released by a step whose commit has not landed; still shareable by digest (no one
  writes it), reusable only after the commit;
- *cached*: free, digest kept, its KV intact: shareable, and the first to be reused (least
  recently released first) when no plain free block is left;
- *free*: no digest; handed out lowest id first.

Reusing a *cached* block overwrites KV that no sequence of the committed state owns (it left
through a committed release), so the crash rule above holds as it did without caching.

Cached blocks across a restart (``recording``: an anchored engine journals them, ``serve/pc/<b>``
in ``commit.py``): a block that becomes cached is *to record*; the next commit records its digest
(``take_records``) and it is *recorded* until the deletion of that record is durable.  The rule
that makes a record trustworthy: **no block is written while a record of it is in the journal or
on its way there** — before ``grow`` hands out a recorded block, or ``writable_from`` lets a table
rewrite one, ``unrecord`` (the engine's) commits the deletion of its record, and of the records of
the next least recently released cached blocks with it (up to ``UNRECORD_BATCH`` or a sixteenth of
the cached blocks: one journal round trip per that many reused blocks), and returns once it landed.  So a recovered engine trusts every
record of a block no committed table holds: its KV is what its digest names
(``adopt_records``); the live sequences' digests are named again from their tokens (``rebuild``).
"""
from __future__ import annotations

from collections import OrderedDict
from itertools import islice

# the records one ``unrecord`` deletes at most, the reused blocks' first: 256, or a sixteenth of the cached blocks
UNRECORD_BATCH = 256


class OutOfBlocks(RuntimeError):
    pass


class InconsistentState(ValueError):
    pass


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.prefix_caching = prefix_caching
        # LIFO free list, lowest ids first out: deterministic allocation.
        self._free = list(range(num_blocks - 1, -1, -1))
        self.refs: dict[int, int] = {}                 # owned block -> number of tables holding it
        self._pending: dict[int, int] = {}             # block -> epoch it was released in
        self._cached: OrderedDict[int, None] = OrderedDict()   # free blocks with a digest, oldest first
        self._digest: dict[int, bytes] = {}            # block -> digest of the tokens up to its end
        self._block: dict[bytes, int] = {}             # digest -> block
        self.epoch = 0       # the engine bumps it per step; a commit of epoch E frees releases <= E
        self.adapter_tags: dict[str, bytes] = {}       # LoRA adapter name -> its tensors' digest
        # records of cached blocks (module docstring): ``unrecord(blocks)`` makes the deletion of
        # their records durable before it returns
        self.recording = False
        self.unrecord = None
        self._to_record: OrderedDict[int, None] = OrderedDict()  # cached, no record yet, oldest first
        self._recorded: set[int] = set()               # a record of it is in the journal or on its way
        self.unrecorded = 0                            # records deleted before their blocks were written

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._cached)

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def blocks_needed(self, table_len: int, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - table_len)

    def can_grow(self, table: list[int], num_tokens: int) -> bool:
        return self.blocks_needed(len(table), num_tokens) <= self.num_free

    def grow(self, rid: str, table: list[int], num_tokens: int) -> None:
        """Extend ``table`` in place so it covers ``num_tokens`` slots."""
        need = self.blocks_needed(len(table), num_tokens)
        if need > self.num_free:
            raise OutOfBlocks(f"{rid} needs {need} blocks, {self.num_free} free")
        new = []
        for _ in range(need):
            if self._free:
                b = self._free.pop()
            else:
                b, _ = self._cached.popitem(last=False)      # the least recently released
                self._forget(b)
            self.refs[b] = 1
            new.append(b)
        self._before_writing(new)
        table.extend(new)

    def release(self, table: list[int]) -> None:
        """Give blocks back; those no other table holds become reusable after the next commit."""
        for b in table:
            n = self.refs.pop(b, 0) - 1
            if n > 0:
                self.refs[b] = n
            else:
                self._pending[b] = self.epoch
        table.clear()

    def on_commit(self, epoch: int | None = None) -> None:
        """The commit covering releases up to ``epoch`` (default: all) has landed."""
        if self._pending:
            done = [b for b, e in self._pending.items() if epoch is None or e <= epoch]
            for b in done:
                del self._pending[b]
                if b in self._digest:
                    self._cached[b] = None
                    if self.recording and b not in self._recorded:
                        self._to_record[b] = None
                else:
                    self._free.append(b)
            self._free.sort(reverse=True)

    # ------------------------------------------------------------------ prefix caching
    def lookup(self, digests) -> list[int]:
        """The blocks holding the longest run of ``digests`` from the first (none if caching is off)."""
        out = []
        if self.prefix_caching:
            for d in digests:
                b = self._block.get(d)
                if b is None:
                    break
                out.append(b)
        return out

    def can_take(self, hits: list[int], num_tokens: int) -> bool:
        """Whether a table made of ``hits`` (``lookup``'s) can grow to ``num_tokens`` slots:
        the cached ones among them are no longer there to hand out."""
        taken = sum(1 for b in hits if b in self._cached)
        return self.blocks_needed(len(hits), num_tokens) <= self.num_free - taken

    def share(self, table: list[int], blocks: list[int]) -> None:
        """Append ``blocks`` (``lookup``'s answer) to ``table``, one more owner each."""
        for b in blocks:
            if b in self.refs:
                self.refs[b] += 1
            else:
                self.refs[b] = 1
                if self._pending.pop(b, None) is None:
                    del self._cached[b]
                    self._to_record.pop(b, None)    # owned again: recorded if it comes back cached
            table.append(b)

    def register(self, block: int, digest: bytes) -> None:
        """``block``'s slots all hold computed KV of the tokens ``digest`` names."""
        if self.prefix_caching and block not in self._digest and digest not in self._block:
            self._digest[block], self._block[digest] = digest, block

    def writable_from(self, table: list[int], start: int) -> int:
        """Before a sequence recomputes its positions from ``start`` on (a history taken back):
        where it may start so that it writes no block another table holds or a digest names.
        A block only this table holds loses its digest; from the first shared one on, the table
        lets go of its blocks and its positions are recomputed from that block's start."""
        kept = []
        for i in range(start // self.block_size, len(table)):
            b = table[i]
            if self.refs.get(b, 0) > 1:
                rest = table[i:]
                del table[i:]
                self.release(rest)
                self._before_writing(kept)
                return min(start, i * self.block_size)
            self._forget(b)
            kept.append(b)
        self._before_writing(kept)
        return start

    def _forget(self, b: int) -> None:
        d = self._digest.pop(b, None)
        if d is not None:
            del self._block[d]
        self._to_record.pop(b, None)

    def _before_writing(self, blocks: list[int]) -> None:
        """``blocks`` are about to be written: no record of theirs may stay in the journal (module
        docstring).  The deletion also takes the records of the next cached blocks in reuse order,
        up to ``UNRECORD_BATCH`` in all, so that the next reuses need no journal round trip."""
        hit = [b for b in blocks if b in self._recorded]
        if not hit:
            return
        room = min(UNRECORD_BATCH, len(self._cached) // 16) - len(hit)
        more = list(islice((b for b in self._cached if b in self._recorded), max(0, room)))
        self.unrecord(hit + more)
        self._recorded.difference_update(hit + more)
        self.unrecorded += len(hit) + len(more)

    # ------------------------------------------------------------------ records of cached blocks
    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def has_unrecorded(self) -> bool:
        return bool(self._to_record)

    def take_records(self) -> list[tuple[int, bytes]]:
        """The cached blocks to record in the next commit, oldest first, as ``(block, digest)``:
        recorded from now on (the commit carrying them is on its way)."""
        out = [(b, self._digest[b]) for b in self._to_record]
        self._recorded.update(b for b, _ in out)
        self._to_record.clear()
        return out

    def adopt_records(self, records: list[tuple[int, bytes]]) -> list[int]:
        """After ``adopt`` and ``rebuild`` (recovery): the committed records of cached blocks, in
        the order they were recorded.  A block no table holds becomes *cached* with its digest
        (its KV is what the digest names: module docstring); one a table holds stays recorded
        if its digest is the one its tokens give.  Returns the blocks whose records must be
        deleted (out of range, a digest known already, another digest than the tokens')."""
        stale = []
        for b, d in records:
            if not (self.recording and 0 <= b < self.num_blocks) or b in self._recorded:
                stale.append(b)
            elif b in self.refs:
                if self._digest.get(b) == d:
                    self._recorded.add(b)
                else:
                    stale.append(b)
            elif d in self._block:
                stale.append(b)
            else:
                self._free.remove(b)
                self._cached[b] = None
                self._digest[b], self._block[d] = d, b
                self._recorded.add(b)
        return stale

    # ------------------------------------------------------------------ recovery
    def adopt(self, tables: dict[str, list[int]], shared_below: dict[str, int] | None = None) -> None:
        """Rebuild ownership from committed block tables (recovery), with no digest known.
        ``shared_below``: per table, how many of its first blocks may be held by other tables
        too (its full, computed blocks, with prefix caching); any other block held twice
        raises ``InconsistentState``, as does one out of range."""
        holders: dict[int, list] = {}
        for rid, table in tables.items():
            below = (shared_below or {}).get(rid, 0) if self.prefix_caching else 0
            for i, b in enumerate(table):
                if not 0 <= b < self.num_blocks:
                    raise InconsistentState(f"{rid}: block {b} outside 0..{self.num_blocks - 1}")
                holders.setdefault(b, []).append((rid, i < below))
        for b, hs in holders.items():
            if len(hs) > 1 and not all(ok for _, ok in hs):
                raise InconsistentState(f"block {b} owned by both {hs[0][0]} and {hs[1][0]}")
        refs = {b: len(hs) for b, hs in holders.items()}
        self.refs = refs
        self._pending, self._cached, self._digest, self._block = {}, OrderedDict(), {}, {}
        self._to_record, self._recorded = OrderedDict(), set()
        self._free = sorted((b for b in range(self.num_blocks) if b not in refs), reverse=True)

    def check(self) -> None:
        """Invariant: every block is exactly one of owned, pending, cached, free; digests name
        owned, pending or cached blocks, one each."""
        seen = list(self.refs) + list(self._pending) + list(self._cached) + self._free
        if sorted(seen) != list(range(self.num_blocks)):
            raise InconsistentState("block accounting broken")
        if any(b in set(self._free) for b in self._digest) or \
                {self._block[d] for d in self._block} != set(self._digest) or \
                any(self._block[d] != b for b, d in self._digest.items()) or \
                any(b not in self._digest for b in self._cached) or any(n < 1 for n in self.refs.values()):
            raise InconsistentState("prefix-cache accounting broken")
        if any(b not in self._cached or b in self._recorded for b in self._to_record) or \
                any(b in set(self._free) for b in self._recorded):
            raise InconsistentState("prefix-cache record accounting broken")
