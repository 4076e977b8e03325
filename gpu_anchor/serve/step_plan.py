"""A step's inputs as host lists, from the scheduler's work (torch-free bookkeeping).

Token ``p`` of a sequence lives in KV slot ``table[p // block_size] * block_size + p %
block_size``.  A decode-only step that replays a CUDA graph needs each sequence's token,
position and slot (``decode_inputs``; its block tables go as they are); an eager step needs the
plan ``attention.step_inputs`` turns into tensors (``eager_plan``), which is also what rank 0
sends the other ranks of a tensor-parallel group.
"""
from __future__ import annotations


def decode_inputs(work, block_size: int, known: bool = True) -> tuple[list[int], list[int], list[int]]:
    """``(ids, positions, slots)`` of a decode step: one token per sequence (``w.n == 1``).
    ``known=False``: a step launched ahead of the previous one's read (``async_step.py``), whose
    tokens are not on the host yet: ``ids`` are zeros, the engine copies the real ones on the device."""
    ids, pos, slots = [], [], []
    for w in work:
        p, t = w.start, w.seq.block_table
        ids.append(w.seq.token(p) if known else 0)
        pos.append(p)
        slots.append(t[p // block_size] * block_size + p % block_size)
    return ids, pos, slots


def prompt_rows(plan: dict, work) -> list[tuple]:
    """Append to ``plan["rows"]`` (after the sampled ones) the tokens whose logits give prompt
    log-probabilities — position p gives prompt token p + 1's, for sequences that ask for them
    and have no output yet — and return ``[(work item, first position, count)]`` in that order."""
    parts = []
    for b, w in enumerate(work):
        s = w.seq
        if s.params.prompt_logprobs is None or s.output_ids:
            continue
        hi = min(w.start + w.n, len(s.prompt_ids) - 1)
        if hi > w.start:
            plan["rows"] += range(plan["q_starts"][b], plan["q_starts"][b] + hi - w.start)
            parts.append((w, w.start, hi - w.start))
    return parts


def lora_slots(work, slots: dict | None) -> list[int] | None:
    """Each sequence's LoRA adapter slot (-1: the base model), or None when the engine serves no
    adapter or no sequence of the step has one (the forward then skips the adapters' terms)."""
    if not slots:
        return None
    out = [slots[w.seq.params.lora] if w.seq.params.lora is not None else -1 for w in work]
    return out if any(s >= 0 for s in out) else None


def eager_plan(work, block_size: int, step: int, prefill: bool, known: bool = True,
               lora: list[int] | None = None) -> dict:
    """An eager step's plan: per token ``ids``, ``pos``, ``slots``, ``tseq`` (its row of the
    block tables); per sequence ``q_starts``, ``q_lens``, ``ctx`` (keys its last token sees),
    ``tables``; ``rows``: the tokens whose logits are sampled; ``lora``: each token's adapter
    slot, from ``lora`` (one per sequence: ``lora_slots``).  ``known``: as ``decode_inputs``."""
    ids, pos, slots, tseq, rows = [], [], [], [], []
    q_starts, q_lens, ctx, tables = [], [], [], []
    for b, w in enumerate(work):
        s = w.seq
        q_starts.append(len(ids))
        ids += s.tokens(w.start, w.start + w.n) if known else [0] * w.n
        r = range(w.start, w.start + w.n)
        pos += r
        t = s.block_table
        slots += [t[p // block_size] * block_size + p % block_size for p in r]
        tseq += [b] * w.n
        q_lens.append(w.n)
        ctx.append(w.start + w.n)
        tables.append(t)
        if w.sample:
            rows.append(len(ids) - 1)
    plan = {"t": "eager", "step": step, "prefill": prefill, "ids": ids, "pos": pos, "slots": slots, "tseq": tseq,
            "q_starts": q_starts, "q_lens": q_lens, "ctx": ctx, "tables": tables, "rows": rows}
    if lora is not None:
        plan["lora"] = [lora[b] for b in tseq]
    return plan
