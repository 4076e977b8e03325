"""What a launched step samples, and the kernels that takes, warmed before they are needed.

``draw`` turns a step's logits into its sampled ids on the device, in one place for the eager
and the graph path: the structured-output masks (``grammar_matchers``), the logit adjustments
(``logit_adjust``: min_tokens, logit_bias, penalties), then the draw (``sampling``, or its
batch-invariant form under ``--deterministic``); nothing waits for the device.
``chosen_logprobs`` reads the log-probabilities of the tokens once they are on the host.
``warm`` runs all of it once on scratch rows, so that a hot standby's first step after a
take-over loads no kernel (it took ~20 ms on the H200).
"""
from __future__ import annotations

import torch

from . import batch_invariant
from .grammar_matchers import words
from .logit_adjust import adjust_logits
from .sampling import sample_ids, token_logprobs
from .sequence import SamplingParams


def _sampler(deterministic: bool):
    return batch_invariant.sample_ids if deterministic else sample_ids


def draw(eng, logits: torch.Tensor, sw: list, ahead_ids=None) -> torch.Tensor:
    """The sampled ids of rows ``sw`` (work items, in the rows' order) of ``logits``;
    ``ahead_ids``: their input tokens on the device (a step launched before the previous
    step's tokens were read: penalties count them from there)."""
    params = [w.seq.params for w in sw]
    # the output index each row's token takes: its position + 1 - the prompt's length
    index = [w.start + w.n - len(w.seq.prompt_ids) for w in sw]
    allowed = eng.grammars.bitmasks([w.seq for w in sw]) if any(p.grammar is not None for p in params) else None
    adjusted = adjust_logits(logits, params, [w.seq.prompt_ids for w in sw], [w.seq.output_ids for w in sw], index,
                             eng.scheduler.eos_token_ids, pending=ahead_ids, allowed=allowed)
    return _sampler(eng.cfg.deterministic)(adjusted, params, index)


def chosen_logprobs(logits: torch.Tensor, rows: list[int], toks: list[int], tops: list[int]) -> list:
    """The log-probability and the ``tops[i]`` most likely of token ``toks[i]`` of row ``rows[i]``."""
    return token_logprobs(logits[rows], toks, tops)


@torch.no_grad()
def warm(eng) -> None:
    """Run what a step runs outside its decode graph — the head (a cuBLAS call per batch size) and
    sampling (greedy, random, logit adjustments, structured-output masks, log-probabilities) —
    once on scratch rows (CUDA only)."""
    if eng.device.type != "cuda":
        return
    sizes = eng.graphs.sizes if eng.graphs is not None else [1]
    h = torch.zeros(max(sizes), eng.mc.hidden_size, dtype=eng.dtype, device=eng.device)
    rnd = SamplingParams(max_tokens=2, temperature=0.8, top_p=0.9, top_k=20, seed=1)
    sample = _sampler(eng.cfg.deterministic)
    for n in sizes:
        logits = eng.model.head(h[:n])
        sample(logits, [SamplingParams(max_tokens=2)] * n, [0] * n)
    sample(logits, [rnd if i % 2 else SamplingParams(max_tokens=2) for i in range(n)], [0] * n)
    adj = [SamplingParams(max_tokens=2, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2,
                          min_tokens=1, logit_bias={1: 1.0}, min_p=0.1, temperature=0.8, seed=1)]
    sample(adjust_logits(logits[:1], adj, [[0, 1]], [[1, 2]], [0], [0]), adj, [0])
    masks = torch.full((1, words(eng.mc.vocab_size)), -1, dtype=torch.int32)
    adjust_logits(logits[:1], [SamplingParams(grammar="-")], [[0]], [[]], [0], [0], allowed=([0], masks))
    token_logprobs(logits[:2], [0, 1], [0, 2])
    torch.cuda.synchronize(eng.device)
