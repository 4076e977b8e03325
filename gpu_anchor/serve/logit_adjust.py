"""The logits a row is drawn from: the grammar, ``min_tokens``, ``logit_bias`` and the penalties, in vLLM v1's order.

``sampling.sample_ids`` then applies temperature, ``min_p``, top-k and top-p to them.  For row
``b``, with ``i`` the output index its token takes, ``n_t`` the count of token ``t`` in the
tokens generated so far and ``seen_t`` whether ``t`` is in the prompt or among them:

0. structured output: the tokens the row's grammar refuses get ``-inf`` (``allowed``, a bitmask
   from ``grammar_matchers``);
1. ``min_tokens``: while ``i < min_tokens``, the row's stop token ids and (unless
   ``ignore_eos``) the model's EOS ids get ``-inf``: the request cannot end before it;
2. ``logit_bias``: ``logit[t] += bias[t]`` (OpenAI's, ids as the tokenizer's);
3. ``repetition_penalty`` (vLLM's and transformers'): where ``seen_t``, a positive logit is
   divided by it and any other multiplied by it;
4. ``logit -= frequency_penalty * n_t + presence_penalty * (n_t > 0)`` (OpenAI's).

Every step is elementwise on the row (counts are exact integers), so a row's logits depend on
that row alone, as ``sample`` needs for a draw that does not depend on the batch, and a
recomputed step (after a crash) gets the same ones.  The arithmetic is in float32, or float64
for float64 logits; rows that adjust nothing keep their logits bit for bit.  Only the
penalties read the generated tokens themselves.  A step launched ahead of the host's read of
the previous token (``async_step``) passes that token, still on the device, as ``pending``: it
is counted with the host's; ``min_tokens`` needs only ``i``, which is known ahead.
"""
from __future__ import annotations

import torch

from .attention import to_device
from .sequence import SamplingParams


def adjusts(p: SamplingParams) -> bool:
    return p.penalized or bool(p.logit_bias) or p.min_tokens > 0 or p.grammar is not None


_BYTE_BITS: dict = {}


def _bits(masks: torch.Tensor, V: int) -> torch.Tensor:
    """int32 bitmask rows [R, ceil(V / 32)] (bit ``t % 32`` of word ``t // 32``: token ``t``) as
    bool [R, V]: each byte looked up in a 256 x 8 table (little-endian words, as on x86 and CUDA)."""
    table = _BYTE_BITS.get(masks.device)
    if table is None:
        table = _BYTE_BITS[masks.device] = ((torch.arange(256).unsqueeze(-1) >> torch.arange(8)) & 1).bool().to(
            masks.device)
    return table[masks.contiguous().view(torch.uint8).long()].reshape(masks.shape[0], -1)[:, :V]


def _padded(rows: list[list[int]], fill: int) -> torch.Tensor:
    """``rows`` as one [R, max(len, 1)] int64 tensor, padded with ``fill``."""
    out = torch.full((len(rows), max(1, max(map(len, rows)))), fill, dtype=torch.long)
    for r, ids in enumerate(rows):
        if ids:
            out[r, :len(ids)] = torch.tensor(ids, dtype=torch.long)
    return out


def adjust_logits(logits: torch.Tensor, params: list[SamplingParams], prompts: list, outputs: list,
                  indices: list[int], eos_ids=(), pending: torch.Tensor | None = None, allowed=None) -> torch.Tensor:
    """The logits of ``params[b]``'s row ``b`` after steps 0-4 (the module's docstring);
    ``logits`` itself when no row adjusts anything (it is never written: a CUDA graph's output
    buffer is not ours).  ``indices[b]``: the output index row ``b``'s token takes.
    ``pending[b]`` (on the device): row ``b``'s last generated token, not yet in ``outputs[b]``
    (a step launched ahead), or None.  ``allowed``: ``(rows, masks)`` from
    ``grammar_matchers.Grammars.bitmasks``, or None."""
    rows = [b for b, p in enumerate(params) if adjusts(p)]
    if not rows:
        return logits
    dev, V = logits.device, logits.shape[-1]
    x = logits.to(torch.promote_types(logits.dtype, torch.float32), copy=True)
    idx = to_device(torch.tensor(rows, dtype=torch.long), dev)
    y = x.index_select(0, idx)
    ps = [params[b] for b in rows]
    if allowed is not None:
        at = {b: r for r, b in enumerate(rows)}
        sel = to_device(torch.tensor([at[b] for b in allowed[0]], dtype=torch.long), dev)
        refused = ~_bits(to_device(allowed[1], dev), V)
        y.index_copy_(0, sel, y.index_select(0, sel).masked_fill(refused, float("-inf")))
    banned = [list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_ids))
              if indices[b] < p.min_tokens else [] for b, p in zip(rows, ps)]
    if any(banned):
        mask = torch.zeros(len(rows), V + 1, dtype=torch.bool, device=dev)
        mask.scatter_(1, to_device(_padded(banned, V), dev), True)
        y = y.masked_fill(mask[:, :V], float("-inf"))
    if any(p.logit_bias for p in ps):
        bias = torch.zeros(len(rows), V + 1, dtype=x.dtype)
        for r, p in enumerate(ps):
            for t, v in p.logit_bias:
                bias[r, t] = v
        y = y + to_device(bias[:, :V], dev)
    if any(p.penalized for p in ps):
        y = _penalize(y, ps, [prompts[b] for b in rows], [outputs[b] for b in rows],
                      None if pending is None else pending.index_select(0, idx))
    x.index_copy_(0, idx, y)
    return x


def _penalize(y: torch.Tensor, ps: list[SamplingParams], prompts: list, outputs: list, pending) -> torch.Tensor:
    dev, (R, V) = y.device, y.shape
    out = to_device(_padded(outputs, V), dev)         # padding: column V, cut off below
    if pending is not None:
        out = torch.cat([out, pending.to(out.dtype)[:, None]], dim=1)
    counts = torch.zeros(R, V + 1, dtype=torch.int32, device=dev)
    counts.scatter_add_(1, out, torch.ones_like(out, dtype=torch.int32))
    counts = counts[:, :V]
    f = to_device(torch.tensor([(p.repetition_penalty, p.frequency_penalty, p.presence_penalty) for p in ps],
                               dtype=y.dtype), dev)
    if any(p.repetition_penalty != 1.0 for p in ps):
        seen = torch.zeros(R, V + 1, dtype=torch.bool, device=dev)
        seen.scatter_(1, to_device(_padded(prompts, V), dev), True)
        seen = seen[:, :V] | (counts > 0)
        rep = f[:, 0:1]
        y = torch.where(seen, torch.where(y > 0, y / rep, y * rep), y)
    return y - f[:, 1:2] * counts.to(y.dtype) - f[:, 2:3] * (counts > 0).to(y.dtype)
