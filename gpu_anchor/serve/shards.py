"""Which part of each weight a tensor-parallel rank holds (``--tensor-parallel-size N``).

Megatron-style sharding of a Llama / Qwen2 / Qwen3 decoder over ``N`` ranks, one device each:

| parameter | split | rank ``r`` holds | after the matmul |
| --- | --- | --- | --- |
| ``q_proj``, ``k_proj``, ``v_proj`` (+ biases) | column (dim 0, by head) | its heads | nothing: attention is per head |
| ``gate_proj``, ``up_proj`` | column (dim 0) | ``intermediate / N`` rows | nothing: SiLU·up is elementwise |
| ``o_proj``, ``down_proj`` | row (dim 1) | the matching input columns | all-reduce (sum) of the partial outputs |
| ``embed_tokens``, ``lm_head`` | vocabulary (dim 0) | tokens ``[r·c, (r+1)·c)``, ``c = ceil(V / N)`` | embedding: masked lookup + all-reduce; lm_head: all-gather of the logits |
| norms, ``q_norm`` / ``k_norm``, ``o_proj.bias`` | replicated | all of it | — |

LoRA adapters are cut as their projection is (``lora.shard``): a column-parallel one's ``B`` by
output rows, a row-parallel one's ``A`` by input columns, the other factor whole.

The KV cache follows the K/V projections: rank ``r`` keeps KV heads
``[r·Hkv/N, (r+1)·Hkv/N)`` and the query heads of their GQA groups, so attention needs no
communication.  A tied ``lm_head`` is the embedding shard itself.  Vocabulary-parallel
embeddings (vLLM's and Megatron's choice) keep the ranks' memory even — a replicated
151k × 5k embedding plus head would be 3 GiB per rank in bf16 — and the embedding's sum
is exact (each row comes from one rank; the others add zeros).

Requirements (checked at start, with the fix in the message): ``N`` divides the number of
attention heads, of KV heads and the MLP width.
"""
from __future__ import annotations

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")
VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


def check(mc, n: int) -> None:
    """Raise ``ValueError`` saying why a model cannot be split ``n`` ways."""
    if n < 1:
        raise ValueError(f"--tensor-parallel-size must be >= 1, got {n}")
    if n == 1:
        return
    for attr, what in (("num_attention_heads", "the query heads are split between the ranks"),
                       ("num_key_value_heads", "the KV cache is split by KV head"),
                       ("intermediate_size", "the MLP is split by its width")):
        v = getattr(mc, attr)
        if v % n:
            ok = [d for d in range(1, v + 1) if v % d == 0 and d <= 16]
            raise ValueError(f"--tensor-parallel-size {n}: {attr} {v} is not divisible by {n} ({what}); "
                             f"sizes that divide it: {', '.join(map(str, ok))}")
    if vocab_range(mc.vocab_size, n - 1, n)[0] >= mc.vocab_size:
        raise ValueError(f"--tensor-parallel-size {n}: vocab_size {mc.vocab_size} leaves the last rank no "
                         "vocabulary rows")


def vocab_range(vocab: int, rank: int, n: int) -> tuple[int, int]:
    """Token ids ``[lo, hi)`` whose embedding rows and logits rank ``rank`` holds."""
    c = -(-vocab // n)
    return min(rank * c, vocab), min((rank + 1) * c, vocab)


def split(name: str, shape: tuple, vocab: int, rank: int, n: int) -> tuple[int, int, int] | None:
    """``(dim, lo, hi)``: rank ``rank`` holds ``[lo, hi)`` of ``dim``; ``None``: replicated."""
    if n == 1:
        return None
    if name in VOCAB:
        return (0, *vocab_range(vocab, rank, n))
    parts = name.split(".")
    if len(parts) < 2:
        return None
    module, kind = parts[-2], parts[-1]
    if module in COLUMN and kind in ("weight", "bias"):
        dim = 0
    elif module in ROW and kind == "weight":
        dim = 1
    else:
        return None
    size = shape[dim] // n
    return dim, rank * size, (rank + 1) * size


def shard_specs(specs, vocab: int, rank: int, n: int) -> list[tuple[str, tuple, object]]:
    """The ``(name, shape, dtype)`` of rank ``rank``'s part of each full parameter."""
    out = []
    for name, shape, dtype in specs:
        s = split(name, shape, vocab, rank, n)
        if s is not None:
            dim, lo, hi = s
            shape = tuple(hi - lo if i == dim else d for i, d in enumerate(shape))
        out.append((name, tuple(shape), dtype))
    return out


def index(name: str, shape: tuple, vocab: int, rank: int, n: int):
    """The index that takes rank ``rank``'s part out of the full tensor (``None``: all of it)."""
    s = split(name, shape, vocab, rank, n)
    if s is None:
        return None
    dim, lo, hi = s
    return tuple(slice(lo, hi) if i == dim else slice(None) for i in range(len(shape)))
