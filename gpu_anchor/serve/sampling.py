"""Token sampling: greedy, temperature, top-k, top-p with a counter-based RNG.

The uniform number that picks output token ``i`` of a request is a pure function of
``(seed, i)``.  So a request's sampling state is (seed, #tokens generated): nothing
but the committed token count needs persisting, and a recomputed step draws the same
number it drew before the crash.  Each row is computed independently of the others
(sort, softmax, cumsum along the vocabulary), so the batch a request lands in does
not change its draw.
"""
from __future__ import annotations

import hashlib
import struct

import torch

from .sequence import SamplingParams


def uniform(seed: int, index: int) -> float:
    """A uniform number in [0, 1) determined by (seed, index): a hash, not a stream."""
    h = hashlib.blake2b(struct.pack("<qq", seed & 0x7FFFFFFFFFFFFFFF, index), digest_size=8).digest()
    return (int.from_bytes(h, "little") >> 11) * (1.0 / (1 << 53))


def sample(logits: torch.Tensor, params: list[SamplingParams], indices: list[int]) -> list[int]:
    """``logits`` [B, V]; ``indices[b]`` is the output index the row's token will take."""
    out = logits.argmax(dim=-1)
    rows = [b for b, p in enumerate(params) if not p.greedy]
    if rows:
        dev = logits.device
        x = logits[rows].float()
        temps = torch.tensor([params[b].temperature for b in rows], device=dev)
        x = x / temps[:, None]
        sx, si = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sx, dim=-1)
        V = x.shape[-1]
        rank = torch.arange(V, device=dev)[None, :]
        ks = torch.tensor([params[b].top_k or V for b in rows], device=dev)
        keep = rank < ks[:, None]
        ps = torch.tensor([params[b].top_p for b in rows], device=dev, dtype=probs.dtype)
        before = torch.cumsum(probs, dim=-1) - probs          # mass strictly above this token
        keep &= (before < ps[:, None]) | (rank == 0)
        probs = torch.where(keep, probs, torch.zeros((), device=dev, dtype=probs.dtype))
        cdf = torch.cumsum(probs, dim=-1)
        u = torch.tensor([uniform(params[b].seed or 0, indices[b]) for b in rows], device=dev, dtype=cdf.dtype)
        pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp_(max=V - 1)
        # searchsorted may land on a zero-probability tail entry only at the clamp; step back.
        chosen = torch.gather(si, 1, pick).squeeze(1)
        out[rows] = chosen
    return out.tolist()


def token_logprobs(logits: torch.Tensor, chosen: list[int], ks: list[int]) -> list[tuple[float, list]]:
    """Log-probabilities of the model's distribution (the raw logits, before temperature,
    top-k and top-p, as vLLM reports them by default): for each row ``b`` the chosen token's
    and the ``ks[b]`` most likely tokens' ``[[id, logprob], ...]``, most likely first."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    picked = lp.gather(1, torch.tensor(chosen, device=lp.device)[:, None]).squeeze(1).tolist()
    k = max(ks)
    if k == 0:
        return [(p, []) for p in picked]
    vals, ids = lp.topk(k, dim=-1)
    vals, ids = vals.tolist(), ids.tolist()
    return [(p, [[i, v] for i, v in zip(ids[b][:ks[b]], vals[b][:ks[b]])]) for b, p in enumerate(picked)]
