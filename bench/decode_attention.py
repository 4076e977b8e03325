"""The decode step's attention alone: the split-KV Triton kernels over the paged KV cache, with
the partials merged in the split kernel's last program (``attention.MERGE_IN_SPLIT``, the
default) against the separate combine kernel.

    python -m bench decode_attention [--tiny] [--device cuda:0] [--reps 20] [--shapes 32x320,64x320,...]
                                     [--table-keys 32768]
    python -m bench decode_attention --sweep 256x32p1024w4s2,...     # the kernel's launch constants

Qwen3-8B's heads (32 query, 8 KV, head size 128, bf16, blocks of 16 tokens): for each shape
``TxC`` — T decode tokens, each with C tokens of context in blocks scattered through the cache —
36 layers (36 distinct caches, so none is served from the 50 MB L2) in one CUDA graph; the figure
is the median of ``--reps`` replays (CUDA events).  KV bandwidth = live K/V bytes / time.  Each
variant is replayed 20 more times and compared with its first output bit for bit (a merge that
read a partial before it was written would differ), and the two variants' outputs are compared
(the same merge code in another launch: equal bit for bit).  ``--table-keys K``: block tables K
keys wide whatever the context, as an engine's ``--max-model-len`` makes them (the kernel's
grid and partials are sized by the table's width).  ``--tiny``: two small shapes on the CPU
through the reference path (no Triton there), a smoke run of the code.

``--sweep KEYSxCHUNKpPROGRAMSwWARPSsSTAGES[cCAP],...`` (CUDA): the same shapes with the split
kernel's constants (``attention.SPLIT_KEYS``, ``CHUNK``, ``PROGRAMS``, ``WARPS``, ``STAGES``, and
with ``cCAP`` ``MAX_SPLITS``, the cap on a token's splits and the partials' rows) set to each
variant in turn, the merge in the kernel; each variant's output is compared with the
first variant's (another split or chunk size reduces in another order; another program count
gives the same bits).  Result ``decode_attention_sweep``.
"""
from __future__ import annotations

import argparse
import re

from bench.common import default_device, write_result
from bench.decode_gemm import _timer

HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 32, 8, 128, 16, 36


def _case(device: str, tokens: int, ctx: int, layers: int, heads: int, kv_heads: int, d: int, dtype,
          table_keys: int | None = None):
    """``tokens`` decode tokens with ``ctx`` keys each, block tables ``table_keys`` keys wide (an
    engine's ``max_model_len``; default: as wide as the context), padded with block 0."""
    import torch
    from gpu_anchor.serve.attention import AttnMeta
    per = -(-ctx // BLOCK)
    nb = tokens * per + 1
    g = torch.Generator(device=device).manual_seed(0)
    caches = [torch.randn(2, nb, BLOCK, kv_heads, d, device=device, dtype=dtype, generator=g) for _ in range(layers)]
    tables = torch.randperm(nb - 1, device=device, generator=g)[: tokens * per].to(torch.int32).view(tokens, per)
    host = tables.tolist()
    width = -(-(table_keys or ctx) // BLOCK)
    tables = torch.nn.functional.pad(tables, (0, width - per))
    meta = AttnMeta(torch.full((tokens,), ctx - 1, dtype=torch.long, device=device),
                    torch.full((tokens,), -1, dtype=torch.long, device=device),
                    torch.arange(tokens, dtype=torch.int32, device=device), tables.contiguous(),
                    list(range(tokens)), [1] * tokens, [ctx] * tokens, host)
    q = torch.randn(tokens, heads, d, device=device, dtype=dtype, generator=g)
    return caches, meta, q


def measure(device: str, shapes: list[tuple[int, int]], reps: int, layers: int, heads: int, kv_heads: int,
            d: int, dtype, table_keys: int | None = None) -> dict:
    import torch
    from gpu_anchor.serve import attention as A
    run = _timer(device, reps)
    cuda = device.startswith("cuda") and A.triton is not None
    variants = {"merge_in_split": True, "combine_kernel": False} if cuda else {"reference": None}
    out = {}
    for tokens, ctx in shapes:
        caches, meta, q = _case(device, tokens, ctx, layers, heads, kv_heads, d, dtype, table_keys)
        kv = layers * tokens * ctx * 2 * kv_heads * d * q.element_size()
        row, first = {}, {}
        for name, merge in variants.items():
            fn = A.attend_reference if merge is None else A.attend_triton
            if merge is not None:
                A.MERGE_IN_SPLIT = merge
            try:
                t = run(lambda: [fn(q, c, meta, d ** -0.5) for c in caches])
                first[name] = [fn(q, c, meta, d ** -0.5) for c in caches]
                again = all(all(torch.equal(fn(q, c, meta, d ** -0.5), o) for c, o in zip(caches, first[name]))
                            for _ in range(20 if merge is not None else 1))
            finally:
                A.MERGE_IN_SPLIT = True
            row[name] = {"ms": t * 1e3, "kv_tb_per_s": kv / t / 1e12, "repeats_bit_for_bit": again}
        if len(first) == 2:
            a, b = first.values()
            row["max_abs_difference"] = max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b))
            row["merge_over_combine"] = row["merge_in_split"]["ms"] / row["combine_kernel"]["ms"]
        out[f"{tokens}x{ctx}"] = row
        print(f"{tokens:4d} tokens x {ctx:5d} context  " + "  ".join(
            f"{k} {v['ms']:.3f} ms ({v['kv_tb_per_s']:.2f} TB/s)" for k, v in row.items() if isinstance(v, dict)),
            flush=True)
        caches = None   # this shape's 36 caches freed before the next
    return out


VARIANT = re.compile(r"(\d+)x(\d+)p(\d+)w(\d+)s(\d+)(?:c(\d+))?")
CONSTANTS = ("SPLIT_KEYS", "CHUNK", "PROGRAMS", "WARPS", "STAGES", "MAX_SPLITS")


def sweep(device: str, shapes: list[tuple[int, int]], reps: int, variants: list[str], layers: int, heads: int,
          kv_heads: int, d: int, dtype, table_keys: int | None = None) -> dict:
    """Each shape under each variant of the split kernel's constants (see the module docstring)."""
    from gpu_anchor.serve import attention as A
    run = _timer(device, reps)
    kept = [getattr(A, c) for c in CONSTANTS]
    out = {}
    try:
        for tokens, ctx in shapes:
            caches, meta, q = _case(device, tokens, ctx, layers, heads, kv_heads, d, dtype, table_keys)
            kv = layers * tokens * ctx * 2 * kv_heads * d * q.element_size()
            row, first = {}, None
            for v in variants:
                for c, x, k in zip(CONSTANTS, VARIANT.fullmatch(v).groups(), kept):
                    setattr(A, c, k if x is None else int(x))     # no cap given: the module's
                t = run(lambda: [A.attend_triton(q, c, meta, d ** -0.5) for c in caches])
                o = [A.attend_triton(q, c, meta, d ** -0.5) for c in caches[:4]]
                first = first or o
                row[v] = {"ms": t * 1e3, "kv_tb_per_s": kv / t / 1e12, "over_first": None,
                          "max_abs_difference": max((a.float() - b.float()).abs().max().item() for a, b in zip(o, first))}
            for v in variants:
                row[v]["over_first"] = row[v]["ms"] / row[variants[0]]["ms"]
            out[f"{tokens}x{ctx}"] = row
            print(f"{tokens:4d} x {ctx:5d}  " + "  ".join(f"{v} {x['ms']:.3f}" for v, x in row.items()), flush=True)
            caches = None
    finally:
        for c, x in zip(CONSTANTS, kept):
            setattr(A, c, x)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench decode_attention", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--device", default=None)
    ap.add_argument("--shapes", default="32x320,64x320,128x320,64x1024,128x1024",
                    help="TOKENSxCONTEXT, comma-separated")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--table-keys", type=int, default=None, metavar="KEYS",
                    help="block tables this many keys wide, as an engine's --max-model-len makes them "
                         "(default: as wide as each shape's context)")
    ap.add_argument("--sweep", default=None, metavar="KEYSxCHUNKpPROGRAMSwWARPSsSTAGES,...",
                    help="time each variant of the split kernel's constants instead (CUDA; the first is the reference)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import torch
    try:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",") if s]
    except ValueError:
        ap.error(f"--shapes: TOKENSxCONTEXT pairs such as 64x320, got {args.shapes!r}")
    if not shapes or any(len(s) != 2 or min(s) < 1 for s in shapes):
        ap.error(f"--shapes: TOKENSxCONTEXT pairs of positive numbers, got {args.shapes!r}")
    if args.tiny:
        device, layers, heads, kv_heads, d, dtype, shapes = "cpu", 2, 4, 2, 32, torch.float32, [(2, 40), (3, 17)]
    else:
        device, layers, heads, kv_heads, d, dtype = default_device(args.device), LAYERS, HEADS, KV_HEADS, HEAD_DIM, torch.bfloat16
    if args.table_keys is not None and args.table_keys < max(c for _, c in shapes):
        ap.error(f"--table-keys {args.table_keys}: a block table holds its context, so at least the longest "
                 f"context of --shapes ({max(c for _, c in shapes)})")
    if args.sweep is not None:
        variants = [v for v in args.sweep.split(",") if v]
        bad = [v for v in variants if not VARIANT.fullmatch(v)]
        if bad or not variants:
            ap.error(f"--sweep: variants such as 256x32p1024w4s2 (keys per split x chunk, programs, warps, "
                     f"stages), got {bad or args.sweep!r}")
        # the kernel's tile shapes: powers of two, a chunk at least one 16-wide dot, whole chunks a split
        def fits(keys, chunk, programs, warps, stages, cap=None):
            return (all(n > 0 and not n & (n - 1) for n in (chunk, warps)) and chunk >= 16 and keys >= chunk
                    and keys % chunk == 0 and programs >= 1 and stages >= 1 and (cap is None or int(cap) >= 1))
        bad = [v for v in variants if not fits(*(int(x) if x is not None else None
                                                 for x in VARIANT.fullmatch(v).groups()))]
        if bad:
            ap.error(f"--sweep: chunk and warps must be powers of two, the chunk at least 16, the keys per split "
                     f"a multiple of the chunk, programs, stages and the split cap at least 1, got {bad}")
        from gpu_anchor.serve import attention as A
        if args.tiny or not device.startswith("cuda") or A.triton is None:
            ap.error("--sweep times the Triton kernel: it needs a CUDA device with Triton")
        res = sweep(device, shapes, args.reps, variants, layers, heads, kv_heads, d, dtype, args.table_keys)
        path = write_result("decode_attention_sweep", {"device": device, "layers": layers, "heads": heads,
                                                       "kv_heads": kv_heads, "head_dim": d, "block_size": BLOCK,
                                                       "dtype": str(dtype).replace("torch.", ""), "variants": variants,
                                                       "table_keys": args.table_keys, "sweep": res}, args.out)
        print(f"wrote {path}")
        return 0
    res = measure(device, shapes, args.reps, layers, heads, kv_heads, d, dtype, args.table_keys)
    path = write_result("decode_attention" + ("_tiny" if args.tiny else ""),
                        {"device": device, "layers": layers, "heads": heads, "kv_heads": kv_heads, "head_dim": d,
                         "block_size": BLOCK, "dtype": str(dtype).replace("torch.", ""),
                         "table_keys": args.table_keys, "results": res}, args.out)
    print(f"wrote {path}")
    return 0


def _render_sweep(r: dict) -> str:
    vs = r["variants"]
    form = "KEYSxCHUNKpPROGRAMSwWARPSsSTAGES" if VARIANT.fullmatch(vs[0]) else "SPLITSxCHUNKwWARPSsSTAGES"
    out = [f"Variants of the split kernel's constants, {form} ({vs[0]} first, the reference); "
           f"{r['layers']} layers in one CUDA graph; ms (time / the first variant's){_tables(r)}.", "",
           "| tokens × context | " + " | ".join(vs) + " |", "| --- | " + " | ".join("---:" for _ in vs) + " |"]
    for shape, row in r["sweep"].items():
        out.append(f"| {shape.replace('x', ' × ')} | "
                   + " | ".join(f"{row[v]['ms']:.3f} ({row[v]['over_first']:.3f})" for v in vs) + " |")
    return "\n".join(out)


def _tables(r: dict) -> str:
    k = r.get("table_keys")
    return f"; block tables {k} keys wide (an engine's max_model_len)" if k else ""


def title(r: dict) -> str:
    if "sweep" in r:
        return f"Decode attention: the split kernel's launch constants ({r.get('device', '?')})"
    return f"Decode attention: merge in the split kernel vs a separate combine kernel ({r.get('device', '?')})"


def render(r: dict) -> str:
    if "sweep" in r:
        return _render_sweep(r)
    res = r["results"]
    names = [k for k in ("merge_in_split", "combine_kernel", "reference") if any(k in row for row in res.values())]
    out = [f"{r['layers']} layers of {r['heads']} query / {r['kv_heads']} KV heads of {r['head_dim']} ({r['dtype']}) "
           f"in one CUDA graph, median of the replays; KV bandwidth = live K/V bytes / time; \"repeats\" = 20 more "
           f"launches equal to the first bit for bit{_tables(r)}.", "",
           "| tokens × context | " + " | ".join(f"{n} (ms, KV TB/s, repeats)" for n in names)
           + " | merge / combine | max difference |",
           "| --- | " + " | ".join("---" for _ in names) + " | ---: | ---: |"]
    for shape, row in res.items():
        cells = [f"{row[n]['ms']:.3f}, {row[n]['kv_tb_per_s']:.2f}, {'yes' if row[n]['repeats_bit_for_bit'] else '**no**'}"
                 if n in row else "—" for n in names]
        ratio = f"{row['merge_over_combine']:.3f}" if "merge_over_combine" in row else "—"
        diff = f"{row['max_abs_difference']:.2g}" if "max_abs_difference" in row else "—"
        out.append(f"| {shape.replace('x', ' × ')} | " + " | ".join(cells) + f" | {ratio} | {diff} |")
    return "\n".join(out)
