"""Paged KV block allocation (torch-free).

Blocks released by a step are not reusable until that step is committed
(``release`` → ``pending`` → ``on_commit`` → free).  This is what keeps the KV of the
last committed state intact through a crash: an uncommitted step may only write to
blocks that are free in the committed state, or to slots past its own sequences'
committed ``num_computed`` — never over KV that a committed sequence still needs.
"""
from __future__ import annotations


class OutOfBlocks(RuntimeError):
    pass


class InconsistentState(ValueError):
    pass


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        # LIFO free list, lowest ids first out: deterministic allocation.
        self._free = list(range(num_blocks - 1, -1, -1))
        self._owner: dict[int, str] = {}
        self._pending: list[tuple[int, int]] = []   # (epoch released in, block)
        self.epoch = 0       # the engine bumps it per step; a commit of epoch E frees releases <= E

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def blocks_needed(self, table_len: int, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - table_len)

    def can_grow(self, table: list[int], num_tokens: int) -> bool:
        return self.blocks_needed(len(table), num_tokens) <= len(self._free)

    def grow(self, rid: str, table: list[int], num_tokens: int) -> None:
        """Extend ``table`` in place so it covers ``num_tokens`` slots."""
        need = self.blocks_needed(len(table), num_tokens)
        if need > len(self._free):
            raise OutOfBlocks(f"{rid} needs {need} blocks, {len(self._free)} free")
        for _ in range(need):
            b = self._free.pop()
            self._owner[b] = rid
            table.append(b)

    def release(self, table: list[int]) -> None:
        """Give blocks back; they become allocatable after the next commit."""
        for b in table:
            self._owner.pop(b, None)
            self._pending.append((self.epoch, b))
        table.clear()

    def on_commit(self, epoch: int | None = None) -> None:
        """The commit covering releases up to ``epoch`` (default: all) has landed."""
        if self._pending:
            done = [b for e, b in self._pending if epoch is None or e <= epoch]
            self._pending = [(e, b) for e, b in self._pending if not (epoch is None or e <= epoch)]
            self._free.extend(done)
            self._free.sort(reverse=True)

    def adopt(self, tables: dict[str, list[int]]) -> None:
        """Rebuild ownership from committed block tables (recovery).  Raises
        ``InconsistentState`` on out-of-range or doubly owned blocks."""
        owner: dict[int, str] = {}
        for rid, table in tables.items():
            for b in table:
                if not 0 <= b < self.num_blocks:
                    raise InconsistentState(f"{rid}: block {b} outside 0..{self.num_blocks - 1}")
                if b in owner:
                    raise InconsistentState(f"block {b} owned by both {owner[b]} and {rid}")
                owner[b] = rid
        self._owner = owner
        self._pending = []
        self._free = sorted((b for b in range(self.num_blocks) if b not in owner), reverse=True)

    def check(self) -> None:
        """Invariant: every block is exactly one of owned, pending, free."""
        seen = list(self._owner) + [b for _, b in self._pending] + self._free
        if sorted(seen) != list(range(self.num_blocks)):
            raise InconsistentState("block accounting broken")
