"""What a streamed reply's text costs the frontend (CPU only): the text of a stream that grows a
token at a time, decoded whole at every step (the frontend before ``tokenizer.IncrementalText``)
against a window of new tokens at a time, for replies of 1 000 to 16 000 tokens, n runs each
(alternating), with the tiny models' byte-level BPE tokenizer (384 entries; a real vocabulary
decodes at a like cost per token).

    python -m bench stream_text            # n = 3
    python -m bench stream_text --tiny     # n = 1, up to 4 000 tokens

The frontend is one asyncio thread serving every stream, so what it spends on text per step is
what it can serve: at 64 streams a step, 1 ms of text each is 64 ms a step.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from bench.common import write_result

LENGTHS = (1000, 4000, 8000, 16000)
TEXT = ("The engine keeps every stream going after a crash; the daemon holds the weights and the KV cache. "
        "Café, naïve, 東京 and 🚀. ")


def _codec():
    from gpu_anchor.serve.tokenizer import Codec
    from gpu_anchor.testing.tiny import train_tokenizer
    d = tempfile.mkdtemp(prefix="stream-text-")
    train_tokenizer(384, f"{d}/tokenizer.json")
    return Codec(d, 384)


def _whole(codec, ids) -> float:
    out = []                      # as the frontend's request record grows
    t0 = time.perf_counter()
    for t in ids:
        out.append(t)
        codec.decode(out)
    return time.perf_counter() - t0


def _windows(codec, ids) -> float:
    from gpu_anchor.serve.tokenizer import IncrementalText
    inc, out = IncrementalText(codec), []
    t0 = time.perf_counter()
    for t in ids:
        out.append(t)
        inc.update(out)
    elapsed = time.perf_counter() - t0
    assert inc.update(ids) == codec.decode(ids)
    return elapsed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    n, lengths = (1, LENGTHS[:2]) if a.tiny else (a.repeat, LENGTHS)
    codec = _codec()
    base = codec.encode(TEXT)
    rows = {}
    for length in lengths:
        ids = (base * (length // len(base) + 1))[:length]
        runs = {"whole": [], "windows": []}
        for _ in range(n):
            runs["whole"].append(_whole(codec, ids))
            runs["windows"].append(_windows(codec, ids))
        row = {k: {"min": min(v), "median": statistics.median(v), "max": max(v)} for k, v in runs.items()}
        t0 = time.perf_counter()
        for _ in range(20):
            codec.decode(ids)
        row["whole_last_step_ms"] = (time.perf_counter() - t0) / 20 * 1e3
        row["speedup_median"] = row["whole"]["median"] / row["windows"]["median"]
        rows[str(length)] = row
        print(f"{length} tokens: whole {row['whole']['median']:.3f} s, windows {row['windows']['median']:.4f} s "
              f"({row['speedup_median']:.0f}x); the last step decoded whole: {row['whole_last_step_ms']:.2f} ms")
    print(write_result("stream_text" + ("_tiny" if a.tiny else ""), {"n": n, "tokens": rows}, a.out))
    return 0


def title(r: dict) -> str:
    return "Serving frontend: a streamed reply's text, decoded whole each step vs a window of new tokens (CPU)"


def render(r: dict) -> str:
    out = ["| reply (tokens) | whole each step, per stream | windows, per stream | speed-up (medians) | "
           "the last step, decoded whole | n |", "| --- | --- | --- | --- | --- | --- |"]
    for length, row in r["tokens"].items():
        w, i = row["whole"], row["windows"]
        out.append(f"| {int(length):,} | {w['median']:.3f} s [{w['min']:.3f}–{w['max']:.3f}] | "
                   f"{i['median'] * 1e3:.1f} ms [{i['min'] * 1e3:.1f}–{i['max'] * 1e3:.1f}] | "
                   f"{row['speedup_median']:.0f}× | {row['whole_last_step_ms']:.2f} ms | {r['n']} |")
    return "\n".join(out) + ("\n\nThe frontend decodes a stream's text at each step it sends (and for stop strings at "
                             "each token batch); `tokenizer.IncrementalText` decodes the new tokens with the few before "
                             "them, as vLLM does. The tokenizer is the tiny test models' byte-level BPE.")
