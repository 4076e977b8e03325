"""What structured output costs a decode step: the grammar masks of B constrained rows
(``grammar_matchers.Grammars.bitmasks``: each matcher consumes its row's new token, then
llguidance computes the rows' bitmasks in parallel) and applying them to the logits
(``logit_adjust.adjust_logits``), per step, over a JSON reply of ~150 tokens under a schema
with nested objects, an array, enums, numbers and strings.

    python -m bench structured_masks --tokenizer DIR      # DIR/tokenizer.json; n = 3
    python -m bench structured_masks --tiny               # the tiny test tokenizer, n = 1

The run in docs/benchmarks.md used a Qwen vocabulary (151 643 byte-level BPE tokens + specials,
logits 151 936 wide): ``--from-tiktoken qwen.tiktoken`` converts Qwen's own tiktoken file (as
shipped in the ``dashscope`` wheel on PyPI) into a ``tokenizer.json`` with transformers'
``TikTokenConverter`` (needs ``tiktoken``), the machines having no access to the Hugging Face
Hub.  Masks are computed on the host; ``--device cuda`` applies them on the GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

from bench.common import write_result

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string"},
    "country": {"enum": ["France", "Italy", "Japan", "Peru"]},
    "population": {"type": "integer", "minimum": 0},
    "coordinates": {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                    "required": ["lat", "lon"], "additionalProperties": False},
    "landmarks": {"type": "array", "items": {"type": "object", "properties": {
        "name": {"type": "string"}, "kind": {"enum": ["museum", "park", "tower", "church"]},
        "visited": {"type": "boolean"}}, "required": ["name", "kind", "visited"], "additionalProperties": False}},
    "summary": {"type": "string"}},
    "required": ["city", "country", "population", "coordinates", "landmarks", "summary"], "additionalProperties": False}
REPLY = {"city": "Paris", "country": "France", "population": 2102650, "coordinates": {"lat": 48.8566, "lon": 2.3522},
         "landmarks": [{"name": "Eiffel Tower", "kind": "tower", "visited": True},
                       {"name": "Louvre", "kind": "museum", "visited": False},
                       {"name": "Jardin du Luxembourg", "kind": "park", "visited": True}],
         "summary": "The capital of France, on the Seine, known for its museums, its cafés and its long avenues."}
PAT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
       r"""|\s+(?!\S)|\s+""")


def qwen_tokenizer(tiktoken_file: str, out_dir: str) -> str:
    """Qwen's tiktoken ranks as a Hugging Face ``tokenizer.json`` in ``out_dir``."""
    from transformers.convert_slow_tokenizer import TikTokenConverter
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [f"<|extra_{i}|>" for i in range(205)]
    tok = TikTokenConverter(vocab_file=tiktoken_file, pattern=PAT, extra_special_tokens=specials).converted()
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    return out_dir


def _run(tok_dir: str, vocab: int, eos: list[int], rows: int, ids: list[int], grammar: str, device: str) -> dict:
    import torch

    from gpu_anchor.serve.grammar_matchers import Grammars
    from gpu_anchor.serve.logit_adjust import adjust_logits
    from gpu_anchor.serve.sequence import SamplingParams, Sequence
    g = Grammars(tok_dir, vocab, eos)
    t0 = time.perf_counter()
    g._tokenizer()
    build = time.perf_counter() - t0
    params = SamplingParams(max_tokens=len(ids) + 1, grammar=grammar)
    seqs = [Sequence(f"r{b}", [1, 2, 3], params) for b in range(rows)]
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)).to(device)
    mask_s, apply_s = [], []
    for i in range(len(ids) + 1):
        t1 = time.perf_counter()
        allowed = g.bitmasks(seqs)
        t2 = time.perf_counter()
        out = adjust_logits(logits, [params] * rows, [s.prompt_ids for s in seqs], [s.output_ids for s in seqs],
                            [i] * rows, eos, allowed=allowed)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t3 = time.perf_counter()
        if i == len(ids):
            assert set(allowed[1][0].nonzero().flatten().tolist()) <= {t // 32 for t in eos}   # EOS only at the end
            break
        want = ids[i]
        assert (int(allowed[1][0, want // 32]) >> (want % 32)) & 1, f"step {i}: the reply's token refused"
        assert torch.isfinite(out[0, want]).item()
        mask_s.append(t2 - t1)
        apply_s.append(t3 - t2)
        for s in seqs:
            s.output_ids.append(want)
    return {"tokenizer_build_s": build, "first_step_ms": mask_s[0] * 1e3,
            "mask_ms": statistics.median(mask_s[1:]) * 1e3, "mask_mean_ms": statistics.fmean(mask_s[1:]) * 1e3,
            "apply_ms": statistics.median(apply_s[1:]) * 1e3}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", default=None, help="directory of tokenizer.json (default: the tiny test one)")
    ap.add_argument("--from-tiktoken", default=None, help="convert Qwen's tiktoken file into --tokenizer first")
    ap.add_argument("--label", default=None, help="where the tokenizer came from (recorded with the result)")
    ap.add_argument("--vocab-size", type=int, default=None, help="logits' width (default: the tokenizer's, "
                                                                 "151936 for --from-tiktoken)")
    ap.add_argument("--rows", default="1,8,32,64")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    from tokenizers import Tokenizer

    from gpu_anchor.serve import structured_output
    tok_dir, vocab = a.tokenizer, a.vocab_size
    if a.from_tiktoken:
        tok_dir = qwen_tokenizer(a.from_tiktoken, tok_dir or tempfile.mkdtemp(prefix="qwen-tok-"))
        vocab = vocab or 151936
    if a.tiny or tok_dir is None:
        from gpu_anchor.testing.tiny import train_tokenizer
        tok_dir = tempfile.mkdtemp(prefix="structured-masks-")
        train_tokenizer(384, os.path.join(tok_dir, "tokenizer.json"))
    tok = Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json"))
    vocab = vocab or tok.get_vocab_size()
    eos = [t for t in (tok.token_to_id(s) for s in ("<|endoftext|>", "<|im_end|>", "</s>")) if t is not None]
    ids = tok.encode(json.dumps(REPLY, ensure_ascii=False)).ids
    grammar = structured_output.grammar({"guided_json": SCHEMA})
    n, rows = (1, [1, 8]) if a.tiny else (a.repeat, [int(x) for x in a.rows.split(",")])
    out = {}
    for b in rows:
        runs = [_run(tok_dir, vocab, eos, b, ids, grammar, a.device) for _ in range(n)]
        row = {k: {"min": min(r[k] for r in runs), "median": statistics.median(r[k] for r in runs),
                   "max": max(r[k] for r in runs)} for k in runs[0]}
        out[str(b)] = row
        print(f"{b} rows: mask {row['mask_ms']['median']:.3f} ms/step, apply {row['apply_ms']['median']:.3f} ms/step, "
              f"first step {row['first_step_ms']['median']:.1f} ms, tokenizer {row['tokenizer_build_s']['median']:.2f} s")
    name = "structured_masks" + ("_cpu" if a.device == "cpu" else "") + ("_tiny" if a.tiny else "")
    print(write_result(name,
                       {"n": n, "vocab": vocab, "tokenizer": a.label or ("tiny test BPE" if a.tiny else tok_dir),
                        "tokenizer_entries": tok.get_vocab_size(), "reply_tokens": len(ids), "device": a.device,
                        "host_cpus": os.cpu_count(), "rows": out}, a.out))
    return 0


def title(r: dict) -> str:
    return f"Structured output: grammar masks and their application per decode step ({r['device']})"


def render(r: dict) -> str:
    lines = [f"Tokenizer: {r.get('tokenizer', '?')}. Vocabulary {r['tokenizer_entries']:,} tokens (logits "
             f"{r['vocab']:,} wide), a JSON reply of {r['reply_tokens']} tokens under a nested schema; masks on the host ({r['host_cpus']} CPUs), applied on "
             f"`{r['device']}`; n = {r['n']}, min–max in brackets.", "",
             "| constrained rows | mask per step (median step) | mask per step (mean) | apply per step | "
             "first step (new matchers) | tokenizer build (once per engine) |", "| --- | --- | --- | --- | --- | --- |"]
    for b, row in r["rows"].items():
        def cell(k, scale=1.0, fmt="{:.3f}"):
            v = row[k]
            return f"{fmt.format(v['median'] * scale)} [{fmt.format(v['min'] * scale)}–{fmt.format(v['max'] * scale)}]"
        lines.append(f"| {b} | {cell('mask_ms')} ms | {cell('mask_mean_ms')} ms | {cell('apply_ms')} ms | "
                     f"{cell('first_step_ms', fmt='{:.1f}')} ms | {cell('tokenizer_build_s', fmt='{:.2f}')} s |")
    if r.get("note"):
        lines += ["", r["note"]]
    return "\n".join(lines)
