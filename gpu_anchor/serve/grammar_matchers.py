"""Structured output, the engine's side: which tokens a constrained sequence may take next.

A request whose ``SamplingParams.grammar`` is set (llguidance's grammar text: a JSON schema, a
regular expression, a choice or a Lark grammar, made by ``structured_output`` from the request)
has an llguidance matcher here.  Before a step samples, ``bitmasks`` gives each constrained row
the tokens its grammar allows next, one bit per token id; ``logit_adjust`` sets every other
logit to ``-inf``.  Once the grammar is complete, only the model's EOS ids are allowed: the
reply ends there.

The contract:

- **A matcher's state is a function of the tokens.**  ``bitmasks`` first brings each matcher to
  its sequence's generated tokens: it consumes the ones it has not seen, and starts over when
  the history is not the one it consumed (a rewind, a resync to the client's tokens, an engine
  that replaced a killed one and has no matcher yet).  Nothing of it is journaled, and a step
  recomputed after a crash gets the mask the fault-free step got.
- **Reasoning first.**  With ``SamplingParams.grammar_after`` (the id of ``</think>``, set when
  the server has a reasoning parser and the prompt has not closed the reasoning), the tokens up
  to and including the first such id are free, and the grammar constrains those after it (as
  vLLM does).
- **Never silent.**  A token the grammar refuses (a client's resync to a reply the grammar does
  not accept) puts the matcher in its error state: the row may then take only EOS, and the
  engine logs the error once with the request's id.

The vocabulary is the tokenizer's ``tokenizer.json``, widened to the model's logits (ids past
the tokenizer's are never allowed).  llguidance builds it in 0.8-2 s for Qwen's 151 851 tokens,
holding the GIL (no thread can hide it): once per engine, at its first constrained request —
the engine's other streams wait that long once — or, for a hot standby, before its take-over.  Asynchronous scheduling does not run a step ahead of a
constrained row's last token (``async_step``): its mask needs that token.
"""
from __future__ import annotations

import functools
import logging
import os
import re
from collections import OrderedDict

log = logging.getLogger("gpu_anchor.serve")
PRISTINE = 64          # compiled grammars kept (the most recently used)
MIN_LLGUIDANCE = (1, 7)    # the first whose LLTokenizer takes a list of end-of-sequence tokens


@functools.lru_cache(maxsize=1)
def installed_llguidance() -> str | None:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("llguidance")
    except PackageNotFoundError:
        return None


def llguidance_problem() -> str | None:
    """Why the installed llguidance cannot serve structured output here (too old), or None."""
    v = installed_llguidance()
    if v is None:
        return None         # not installed: the import says so where it is needed
    if tuple(int(x) for x in re.findall(r"\d+", v)[:2]) < MIN_LLGUIDANCE:
        need = ".".join(map(str, MIN_LLGUIDANCE))
        return (f"structured output needs llguidance >= {need} on the server (llguidance {v} is installed): "
                f"pip install -U 'llguidance>={need}'")
    return None


def words(vocab_size: int) -> int:
    """32-bit words of one row's bitmask."""
    return (vocab_size + 31) // 32


class _Entry:
    """A sequence's matcher and what it consumed: ``seen``, the tokens from ``start`` on."""

    def __init__(self, matcher, grammar: str, start: int) -> None:
        self.matcher, self.grammar, self.start = matcher, grammar, start
        self.seen: list[int] = []
        self.src: list[int] | None = None     # the sequence's output list it last read
        self.told = False           # its error was logged

    def extends(self, outputs: list[int]) -> bool:
        """Do ``outputs`` hold what was consumed, then perhaps more?  The same list grown by
        appends (the steady case) is checked at its last consumed token; another list (a rewind,
        a resync, a re-added request) in full."""
        end = self.start + len(self.seen)
        if len(outputs) < end:
            return False
        if outputs is self.src:
            return not self.seen or outputs[end - 1] == self.seen[-1]
        return outputs[self.start:end] == self.seen


class Grammars:
    """The matchers of one engine's constrained sequences, by request id."""

    def __init__(self, tokenizer_dir: str | None, vocab_size: int, eos_ids) -> None:
        self.tokenizer_dir, self.vocab_size, self.eos_ids = tokenizer_dir, vocab_size, sorted(eos_ids)
        self._tok = self._executor = None
        self._m: dict[str, _Entry] = {}
        # a compiled matcher per grammar text, copied for each sequence (0.7 ms to compile Qwen's
        # JSON schema of bench/structured_masks.py, 2 us to copy): n choices compile it once
        self._pristine: OrderedDict[str, object] = OrderedDict()

    def _tokenizer(self):
        if self._tok is None:
            why = llguidance_problem()
            if why:
                raise ValueError(why)
            import llguidance
            path = os.path.join(self.tokenizer_dir, "tokenizer.json") if self.tokenizer_dir else None
            if path is None or not os.path.exists(path):
                raise ValueError("structured output needs the model's tokenizer.json (none in "
                                 f"{self.tokenizer_dir or 'the model directory'})")
            with open(path) as f:
                self._tok = llguidance.LLTokenizer(f.read(), n_vocab=self.vocab_size,
                                                   eos_token=self.eos_ids or None)
            self._executor = llguidance.LLExecutor()
        return self._tok

    def prepare(self) -> bool:
        """Build the vocabulary now if structured output can be served (llguidance installed, a
        tokenizer.json): a hot standby does it before its take-over.  Whether it was built."""
        try:
            self._tokenizer()
        except (ImportError, ValueError, OSError) as e:
            (log.warning if llguidance_problem() else log.info)("structured output's vocabulary not built ahead: %s", e)
            return False
        return True

    @staticmethod
    def _start(p, outputs: list[int]) -> int | None:
        """Where the constrained tokens begin in ``outputs``; None: not yet (the reasoning is open)."""
        if p.grammar_after is None:
            return 0
        try:
            return outputs.index(p.grammar_after) + 1
        except ValueError:
            return None

    def _new(self, grammar: str):
        m = self._pristine.get(grammar)
        if m is None:
            import llguidance
            m = self._pristine[grammar] = llguidance.LLMatcher(self._tokenizer(), grammar, log_level=0)
            if len(self._pristine) > PRISTINE:
                self._pristine.popitem(last=False)
        else:
            self._pristine.move_to_end(grammar)
        return m.deep_copy()

    def _matcher(self, rid: str, p, outputs: list[int], start: int):
        e = self._m.get(rid)
        if e is None or e.grammar != p.grammar or e.start != start or not e.extends(outputs):
            e = self._m[rid] = _Entry(self._new(p.grammar), p.grammar, start)   # a new request, or another history
        new = outputs[start + len(e.seen):]
        if new and not e.matcher.is_error():
            e.matcher.consume_tokens(new)
        e.seen += new
        e.src = outputs
        if e.matcher.is_error() and not e.told:
            e.told = True
            log.warning("request %s: its tokens left the grammar of its structured output (%s); it may only end",
                        rid, e.matcher.get_error())
        return e.matcher

    def bitmasks(self, seqs) -> tuple[list[int], object] | None:
        """``(rows, masks)`` for the constrained rows among ``seqs`` (a step's sampled
        sequences, in row order): ``masks`` an int32 [len(rows), words(V)] CPU tensor, bit
        ``t % 32`` of word ``t // 32`` set where token ``t`` is allowed; None when no row is
        constrained now."""
        todo = []
        for b, s in enumerate(seqs):
            p = s.params
            if p.grammar is None:
                continue
            start = self._start(p, s.output_ids)
            if start is not None:
                todo.append((b, self._matcher(s.rid, p, s.output_ids, start)))
        if not todo:
            return None
        import torch
        w = words(self.vocab_size)
        masks = torch.zeros(len(todo), w, dtype=torch.int32)
        live = [(m, k) for k, (_, m) in enumerate(todo) if not m.is_error()]
        if live:
            self._executor.unsafe_compute_mask_ptr(live, masks.data_ptr(), w * 4, len(todo))
        for k, (_, m) in enumerate(todo):
            if m.is_error():            # EOS only: the request ends (logged by _matcher)
                for t in self.eos_ids:
                    masks[k, t // 32] |= _bit(t % 32)
        return [b for b, _ in todo], masks

    def held(self) -> bool:
        return bool(self._m)

    def forget(self, live) -> None:
        """Drop the matchers of requests no longer in ``live`` (ids of unfinished requests)."""
        for rid in [r for r in self._m if r not in live]:
            del self._m[rid]


def _bit(i: int) -> int:
    """Bit ``i`` of an int32 word, as a signed value (bit 31 is the sign)."""
    return (1 << i) - (1 << 32 if i == 31 else 0)
