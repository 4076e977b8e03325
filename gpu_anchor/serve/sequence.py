"""Per-request bookkeeping (torch-free): what a sequence is, and how it is serialised.

A ``Sequence`` is the engine's view of one request: its prompt, the tokens generated
so far, the KV blocks that hold its cache (``block_table``) and how many of its tokens
already have their KV written (``num_computed``).  Everything here is plain data, so the
scheduler, the block manager and the commit protocol are unit-tested in milliseconds.
"""
from __future__ import annotations

import enum
import json
import struct
from array import array
from dataclasses import dataclass, field


class Status(enum.Enum):
    WAITING = "waiting"    # no KV (or KV dropped by preemption / recovery fallback)
    RUNNING = "running"    # holds blocks; prefill chunks or decode steps are scheduled
    FINISHED = "finished"


MAX_LOGPROBS = 20     # the most top log-probabilities a request may ask for per token (as vLLM's default)


_LATER = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "min_p": 0.0,
          "min_tokens": 0, "logit_bias": (), "prompt_logprobs": None, "grammar": None, "grammar_after": None,
          "lora": None}


@dataclass
class SamplingParams:
    """``temperature == 0`` is greedy.  ``seed`` drives a counter-based RNG: the random
    number used for output token ``i`` depends only on ``(seed, i)``, so the sampling
    state to persist is just the seed and the number of tokens already generated."""
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # None: no log-probabilities; k >= 0: the chosen token's and the k most likely ones'
    logprobs: int | None = None
    # OpenAI's, over the tokens generated so far: logit -= presence * (count > 0) + frequency * count
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM's (and transformers'), over the prompt's and the generated tokens: a positive logit is
    # divided by it, a negative one multiplied
    repetition_penalty: float = 1.0
    # after temperature, tokens less likely than min_p x the most likely one are dropped
    min_p: float = 0.0
    # the request cannot end (stop token ids, EOS) before this many tokens
    min_tokens: int = 0
    # ((token id, bias added to its logit), ...): a dict {id: bias} (ids as ints or strings) is taken too
    logit_bias: tuple = ()
    # None: none; k >= 0: each prompt token's log-probability (from the second on) and the k most likely
    prompt_logprobs: int | None = None
    # structured output: llguidance's grammar text (``structured_output``); the reply is constrained to it
    grammar: str | None = None
    # the grammar constrains only the tokens after this id's first occurrence in the reply (``</think>``)
    grammar_after: int | None = None
    # the LoRA adapter (its served name, ``lora.py``) this request's tokens go through; None: the base model
    lora: str | None = None

    def __post_init__(self) -> None:
        if int(self.max_tokens) < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0.0 <= float(self.temperature) <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < float(self.top_p) <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if int(self.top_k) < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not 0 <= int(v) <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {v}")
            setattr(self, name, None if v is None else int(v))
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= float(getattr(self, name)) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < float(self.repetition_penalty) <= 100.0:
            raise ValueError(f"repetition_penalty must be in (0, 100], got {self.repetition_penalty}")
        if not 0.0 <= float(self.min_p) <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 <= int(self.min_tokens) <= int(self.max_tokens):
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        pairs = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        self.logit_bias = tuple(sorted((int(t), float(v)) for t, v in pairs))
        bad = next(((t, v) for t, v in self.logit_bias if t < 0 or not -100.0 <= v <= 100.0), None)
        if bad is not None:
            raise ValueError(f"logit_bias: token {bad[0]} -> {bad[1]}: ids are >= 0, biases in [-100, 100]")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar):
            raise ValueError("grammar must be a non-empty string (llguidance's grammar text)")
        if self.grammar_after is not None and (self.grammar is None or int(self.grammar_after) < 0):
            raise ValueError(f"grammar_after ({self.grammar_after}) needs a grammar and a token id >= 0")
        if self.grammar_after is not None:
            self.grammar_after = int(self.grammar_after)
        if self.lora is not None and (not isinstance(self.lora, str) or not self.lora):
            raise ValueError(f"lora must be an adapter's name, got {self.lora!r}")
        self.min_p, self.min_tokens = float(self.min_p), int(self.min_tokens)
        self.presence_penalty, self.frequency_penalty = float(self.presence_penalty), float(self.frequency_penalty)
        self.repetition_penalty = float(self.repetition_penalty)
        self.max_tokens, self.top_k = int(self.max_tokens), int(self.top_k)
        self.temperature, self.top_p = float(self.temperature), float(self.top_p)
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)
        if self.seed is not None:
            self.seed = int(self.seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Its logits depend on the tokens so far (a penalty is set)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def to_dict(self) -> dict:
        d = {"max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
             "top_k": self.top_k, "seed": self.seed, "stop_token_ids": list(self.stop_token_ids),
             "ignore_eos": self.ignore_eos, "logprobs": self.logprobs}
        # the later fields only when set: a request record without them is what it was before them
        d.update((k, [list(x) for x in v] if k == "logit_bias" else v)
                 for k, v in ((k, getattr(self, k)) for k in _LATER) if v != _LATER[k])
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "SamplingParams":
        return cls(**d)


@dataclass
class Sequence:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0          # tokens (prompt + output) whose KV is written
    status: Status = Status.WAITING
    finish_reason: str | None = None
    arrival: int = 0               # admission order: keeps scheduling deterministic
    # prefix caching (prefix_cache.py): digests of its first blocks, this process's knowledge only
    digests: list = field(default_factory=list, repr=False, compare=False)
    cached_tokens: int = 0         # prompt tokens its admission found computed (prefix caching)

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError(f"request {self.rid}: the prompt is empty")

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token(self, i: int) -> int:
        p = len(self.prompt_ids)
        return self.prompt_ids[i] if i < p else self.output_ids[i - p]

    def tokens(self, start: int, end: int) -> list[int]:
        """Tokens ``[start, end)`` of prompt + output, without joining the two lists (a decode
        step asks for one token of a long history)."""
        p = len(self.prompt_ids)
        if end <= p:
            return self.prompt_ids[start:end]
        if start >= p:
            return self.output_ids[start - p:end - p]
        return self.prompt_ids[start:] + self.output_ids[:end - p]

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < self.num_tokens - 1

    def reset_kv(self) -> None:
        """Forget the KV (preemption or recovery fallback): it is recomputed from the tokens."""
        self.block_table = []
        self.num_computed = 0
        self.status = Status.WAITING


# ---------------------------------------------------------------- serialisation
# The per-step commit must stay small: the request (prompt, params) is written once at
# admission; each step rewrites only the small ``state`` record and the last, partial
# segment of the output tokens.
OUT_SEGMENT = 64


def pack_ints(xs) -> bytes:
    return array("i", xs).tobytes()


def unpack_ints(b: bytes) -> list[int]:
    a = array("i")
    a.frombytes(b)
    return a.tolist()


def request_record(seq: Sequence) -> bytes:
    head = json.dumps({"params": seq.params.to_dict(), "arrival": seq.arrival}).encode()
    return struct.pack("<I", len(head)) + head + pack_ints(seq.prompt_ids)


def parse_request(rid: str, blob: bytes) -> Sequence:
    (n,) = struct.unpack_from("<I", blob)
    head = json.loads(blob[4:4 + n])
    return Sequence(rid, unpack_ints(blob[4 + n:]), SamplingParams.from_dict(head["params"]),
                    arrival=int(head["arrival"]))


_STATUS = {Status.WAITING: 0, Status.RUNNING: 1, Status.FINISHED: 2}
_STATUSES = [Status.WAITING, Status.RUNNING, Status.FINISHED]
_HEAD = struct.Struct("<iii")


def pack_state(num_computed: int, n_out: int, status: Status) -> bytes:
    return _HEAD.pack(num_computed, n_out, _STATUS[status])


def state_record(seq: Sequence) -> bytes:
    """num_computed, #outputs, status (12 bytes).  The block table has its own record
    (``pack_ints(block_table)``), rewritten only when the table changes."""
    return pack_state(seq.num_computed, len(seq.output_ids), seq.status)


def parse_state(seq: Sequence, blob: bytes, table: bytes | None = None) -> int:
    """Apply a state record and the block-table record; returns the number of output
    tokens it claims.  (Journals written before the split carry the table after the
    12-byte head of the state record and have no table record.)"""
    num_computed, n_out, status = _HEAD.unpack_from(blob)
    seq.num_computed = num_computed
    seq.status = _STATUSES[status]
    seq.block_table = unpack_ints(table if table is not None else blob[12:])
    return n_out


def segment_keys(n_before: int, n_after: int) -> range:
    """Indices of output segments touched when outputs grow from n_before to n_after."""
    if n_after <= n_before:
        return range(0)
    return range(n_before // OUT_SEGMENT, (n_after - 1) // OUT_SEGMENT + 1)
