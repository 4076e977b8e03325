"""Model shapes used by the benchmarks: real architectures, random weights.

    python -m bench models [--tiny]      # the table of shapes, parameters and state bytes

Training: Llama3.2-1B, Qwen3-1.7B, Llama3.2-3B.  Inference: Qwen3-8B/14B/32B.  The
configs copy the published ``config.json`` figures that decide compute and memory
(hidden size, layers, heads, KV heads, head dim, MLP width, vocabulary, tied
embeddings); weights are random, tokens synthetic.  ``tiny=True`` keeps the
architecture and shrinks every dimension so the CPU smoke test runs in seconds.
"""
from __future__ import annotations

import argparse
import contextlib

_LLAMA = dict(model_type="llama", rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=131072)
_QWEN3 = dict(model_type="qwen3", rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=40960)

SHAPES: dict[str, dict] = {
    "llama3.2-1b": dict(_LLAMA, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                        num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                        tie_word_embeddings=True),
    "qwen3-1.7b": dict(_QWEN3, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                       tie_word_embeddings=True),
    "llama3.2-3b": dict(_LLAMA, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                        num_attention_heads=24, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                        tie_word_embeddings=True),
    "qwen3-8b": dict(_QWEN3, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     tie_word_embeddings=False),
    "qwen3-14b": dict(_QWEN3, hidden_size=5120, intermediate_size=17408, num_hidden_layers=40,
                      num_attention_heads=40, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                      tie_word_embeddings=False),
    "qwen3-32b": dict(_QWEN3, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                      num_attention_heads=64, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                      tie_word_embeddings=False),
}
TRAIN = ["llama3.2-1b", "qwen3-1.7b", "llama3.2-3b"]
SERVE = ["qwen3-8b", "qwen3-14b", "qwen3-32b"]
_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=2048)


def add_shape_args(ap, default: str = "qwen3-8b") -> None:
    """``--model --layers --device --dtype``: the serving benchmarks' model shape (random weights)."""
    ap.add_argument("--model", default=default, help="a bench.models shape (random weights)")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None, help="default bfloat16 on CUDA, float32 on the CPU")


def add_run_args(ap, rounds: int = 3) -> None:
    """``--rounds --tiny --out``: the serving benchmarks' repetitions, smoke size and results folder."""
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default=None)


def result_name(base: str, device: str, tiny: bool) -> str:
    """``base``, ``_cpu`` when run on the CPU at full size, ``_tiny`` at the smoke size."""
    return base + ("_cpu" if device == "cpu" and not tiny else "") + ("_tiny" if tiny else "")


def device_and_dtype(a) -> tuple[str, str]:
    """``(device, dtype)`` of ``add_shape_args``' options: ``--device`` or the default one, and
    ``--dtype`` or bfloat16 on CUDA, float32 elsewhere."""
    from bench.common import default_device
    device = default_device(a.device)
    return device, a.dtype or ("bfloat16" if device.startswith("cuda") else "float32")


def config(name: str, tiny: bool = False, layers: int | None = None):
    """A ``transformers`` config for shape ``name`` (``tiny``: same architecture, toy sizes;
    ``layers``: that many decoder layers, every other dimension unchanged)."""
    if name not in SHAPES:
        raise ValueError(f"unknown model shape {name!r}; known: {', '.join(SHAPES)}")
    from transformers import AutoConfig
    kw = dict(SHAPES[name])
    if tiny:
        kw.update(_TINY)
    if layers is not None:
        kw["num_hidden_layers"] = layers
    kind = kw.pop("model_type")
    cfg = AutoConfig.for_model(kind, **kw)
    cfg._attn_implementation = "sdpa"
    return cfg


@contextlib.contextmanager
def _no_init():
    """Skip weight initialisation (restores overwrite every weight anyway)."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers
        from transformers.modeling_utils import no_init_weights
    with no_init_weights():
        yield


def build(name: str, device: str, dtype=None, tiny: bool = False, init: bool = True, seed: int = 0,
          layers: int | None = None):
    """A causal LM of shape ``name`` on ``device`` (default dtype bf16).

    ``init=False`` allocates without running initialisation kernels: use it when a
    restore will overwrite every parameter (the fair restart path for every method).
    Non-persistent buffers (rotary frequencies) are computed either way.
    """
    import torch
    from transformers import AutoModelForCausalLM
    dtype = dtype or torch.bfloat16
    cfg = config(name, tiny, layers)
    torch.manual_seed(seed)
    ctx = contextlib.nullcontext() if init else _no_init()
    with ctx, torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    if not init:
        model.tie_weights()  # transformers ties inside init_weights, which no_init_weights skips
    return model


def param_count(name: str, tiny: bool = False) -> int:
    """Parameters of shape ``name`` (tied embeddings counted once), without building it."""
    c = SHAPES[name] | (_TINY if tiny else {})
    h, i, n, v = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    q = c["num_attention_heads"] * c["head_dim"]
    kv = c["num_key_value_heads"] * c["head_dim"]
    attn = h * q + 2 * h * kv + q * h + (2 * c["head_dim"] if c["model_type"] == "qwen3" else 0)
    layer = attn + 3 * h * i + 2 * h
    emb = v * h * (1 if c["tie_word_embeddings"] else 2)
    return n * layer + emb + h


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench models", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="toy sizes; also builds each model to check the count")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    rows = []
    for name in SHAPES:
        n = param_count(name, args.tiny)
        row = {"model": name, "params": n, "bf16_weights_gib": n * 2 / 2**30,
               "bf16_adamw_state_gib": n * 8 / 2**30}  # weights + grads + two moments, bf16
        if args.tiny:
            m = build(name, "cpu", tiny=True)
            built = sum(p.numel() for p in m.parameters())
            if built != n:
                raise SystemExit(f"{name}: built {built} parameters, formula says {n}")
        rows.append(row)
        print(f"{name:12s} {n / 1e9:7.3f} B params  {row['bf16_weights_gib']:7.2f} GiB bf16 weights")
    from bench.common import write_result
    write_result("models_tiny" if args.tiny else "models",
                 {"title": "Model shapes (random weights)", "rows": rows}, args.out)
    return 0


def render(result: dict) -> str:
    lines = ["| model | parameters | bf16 weights (GiB) | weights+grads+AdamW, bf16 (GiB) |", "| --- | --- | --- | --- |"]
    for r in result["rows"]:
        n = f"{r['params'] / 1e9:.3f} B" if r["params"] >= 1e7 else f"{r['params']:,}"
        lines.append(f"| {r['model']} | {n} | {r['bf16_weights_gib']:.3g} | {r['bf16_adamw_state_gib']:.3g} |")
    return "\n".join(lines)
