"""Prefix caching: which blocks of a new request's prompt are already computed (torch-free).

vLLM's automatic prefix caching, on the crash-consistent block manager (``block_manager.py``
has the block states and why a crash cannot expose a reused block).  A block is named by the
digest of every token up to its end and of the LoRA adapter its tokens go through: BLAKE2b of
the previous block's digest, the adapter's (the digest of its tensors, ``lora.Adapter.digest``)
and the block's token ids, 128 bits (a chain,
so equal digests mean equal prefixes, with a collision odds of 2⁻⁶⁴ even after 2³² blocks).

The contract with the scheduler and the engine:

- ``take`` (admission of a sequence with no KV): the longest run of its first blocks whose
  digests are known becomes its table's head, and its ``num_computed`` starts after them.  At
  least its last token is computed (its logits are sampled), so a prompt that is cached whole
  still computes its last block.  A request asking for prompt log-probabilities takes nothing
  (each prompt position's logits are needed).
- ``remember`` (a step's work is scheduled): every block that the step fills is named, so a
  request admitted later, in the same step too, takes it.  Within a step that is safe: each
  layer stores every token's K/V before any token's attention reads the cache, so a request
  reading a shared block in the step that fills it reads what the step wrote.  A block is named
  once the step that fills it is scheduled, never before (the steps that run ahead, decodes
  only, name theirs when they complete).
- ``rebuild`` (recovery): the digests are not journaled; the live sequences' full, computed
  blocks are named again from their tokens.
- ``forget_from`` (a sequence's history taken back): digests past what stands are dropped,
  and the table lets go of blocks it would otherwise overwrite while shared.
"""
from __future__ import annotations

import hashlib
from array import array

from .block_manager import BlockManager


def digests(seq, n_blocks: int, block_size: int, adapters: dict | None = None) -> list[bytes]:
    """The digests of ``seq``'s first ``n_blocks`` blocks (kept on the sequence, extended as needed).
    ``adapters``: adapter name -> the digest of its tensors (``BlockManager.adapter_tags``)."""
    have = seq.digests
    h0 = len(have)
    if h0 < n_blocks:
        tokens = seq.tokens(h0 * block_size, n_blocks * block_size)
        lora = seq.params.lora
        prev = have[-1] if have else b"base\0" if lora is None else b"lora\0" + (adapters or {}).get(lora, lora.encode())
        for k in range(0, len(tokens), block_size):
            h = hashlib.blake2b(prev, digest_size=16)
            h.update(array("i", tokens[k:k + block_size]).tobytes())
            prev = h.digest()
            have.append(prev)
    return have[:n_blocks]


def take(blocks: BlockManager, seq) -> list[int] | None:
    """The cached blocks ``seq`` (no KV yet) can start from, or None when it takes none."""
    if not blocks.prefix_caching or seq.params.prompt_logprobs is not None:
        return None
    n = (seq.num_tokens - 1) // blocks.block_size
    hits = blocks.lookup(digests(seq, n, blocks.block_size, blocks.adapter_tags)) if n else []
    return hits or None


def remember(blocks: BlockManager, seq, start: int, end: int | None = None) -> None:
    """``seq``'s KV holds positions ``[0, end)`` (default ``seq.num_computed``) once the step that
    computes those from ``start`` on has run: name the blocks that are full then."""
    if blocks.prefix_caching:
        bs, full = blocks.block_size, (seq.num_computed if end is None else end) // blocks.block_size
        first = start // bs
        if full > first:
            for i, d in enumerate(digests(seq, full, bs, blocks.adapter_tags)[first:], first):
                blocks.register(seq.block_table[i], d)


def adapter_loaded(blocks: BlockManager, name: str, digest: str) -> None:
    """A LoRA adapter is served as ``name``: its blocks are named by its tensors' ``digest``, so
    blocks computed under another adapter of that name (unloaded, replaced) are never found."""
    blocks.adapter_tags[name] = bytes.fromhex(digest)


def rebuild(blocks: BlockManager, seqs) -> None:
    for s in seqs:
        remember(blocks, s, 0)


def forget_from(blocks: BlockManager, seq, start: int) -> int:
    """``seq`` will recompute from position ``start`` (its tokens from there may differ): where
    it may start instead (``BlockManager.writable_from``)."""
    del seq.digests[start // blocks.block_size:]
    return blocks.writable_from(seq.block_table, start)
