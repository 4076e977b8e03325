"""Where a training step's memory peak is, plain PyTorch and anchored (gradient lending on or off).

    python -m bench train_peak [--tiny] [--batch 4 --seq 1024] [--lend-grad-bytes N] [--[no-]grads-in-place]
                               [--out DIR]

The Llama3.2-1B shape of ``bench train_overhead`` (bf16, AdamW, random tokens).  After three
warm-up steps, one step of each side runs under ``torch.cuda.memory._record_memory_history``:
the largest total the allocator held above what was allocated when the step began, the event at
which it came, and the blocks alive there grouped by the Python line that allocated them
(autograd's own frames left out; a block the backward engine made has no Python line and is
listed as "backward").  Anchored memory (parameters, gradients, optimizer state, undo) is the
daemon's and not in these totals.  With lending (on a GPU by default; ``--lend-grad-bytes`` sets
it) the lending plan too: the gradient areas, the candidates and their sizes, those chosen, the
bytes lent.  This is what to read before choosing a lending budget: a lent byte lowers the peak
only if its tensor is alive there.
On a CPU (``--tiny``) the allocator keeps no history: the plan alone.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import tempfile

BACKWARD = "backward"


def _site(frames: list[dict], depth: int = 2) -> str:
    kept = [f for f in frames if f.get("filename", "").endswith(".py") and "torch/autograd" not in f["filename"]]
    if not kept:
        return BACKWARD
    return " < ".join(f"{os.path.basename(f['filename'])}:{f['line']}:{f['name']}" for f in kept[:depth])


def analyse(trace: list[dict], top: int = 20) -> dict:
    """The peak of one device trace of the allocator (``_snapshot()["device_traces"][i]``):
    bytes above the start, its event, and the blocks alive there (largest first, and by site)."""
    live: dict[int, dict] = {}
    total = peak = 0
    at, alive = -1, {}
    for i, ev in enumerate(trace):
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev
            total += ev["size"]
        elif ev["action"] == "free_completed" and ev["addr"] in live:
            total -= live.pop(ev["addr"])["size"]
        if total > peak:
            peak, at, alive = total, i, dict(live)
    blocks = sorted(alive.values(), key=lambda e: -e["size"])
    by_site: collections.Counter = collections.Counter()
    for ev in blocks:
        by_site[_site(ev.get("frames", []))] += ev["size"]
    return {"peak_bytes": peak, "peak_event": at, "events": len(trace), "alive_blocks": len(blocks),
            "peak_site": _site(trace[at].get("frames", []), 4) if at >= 0 else None,
            "alive_by_site_mib": {k: round(v / 2**20, 1) for k, v in by_site.most_common(top)},
            "largest_alive_mib": [{"mib": round(e["size"] / 2**20, 1), "site": _site(e.get("frames", []), 4)}
                                  for e in blocks[:top]]}


def _history(step, device: str) -> dict | None:
    """``step()`` once under the allocator's history (CUDA); None on a CPU."""
    import torch
    if not device.startswith("cuda"):
        step()
        return None
    torch.cuda.synchronize(device)
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python", context="alloc")
    try:
        step()
        torch.cuda.synchronize(device)
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    index = torch.device(device).index or 0
    return analyse(snap["device_traces"][index])


def _plan(lender) -> dict:
    plan = lender.plan
    sizes, chosen = plan.sizes, sorted(plan.chosen or ())
    return {"areas_mib": [round((a.end - a.base) / 2**20, 1) for a in plan.ordered_areas()],
            "candidates": len(sizes), "candidate_mib": [round(n / 2**20, 1) for n in sizes],
            "chosen": chosen, "chosen_bytes": sum(sizes[k] for k in chosen),
            "lent_bytes_last_step": lender.stats["last_lent_bytes"], "held": sorted(plan.held),
            "budget": lender.budget}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--device", default=None)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--lend-grad-bytes", type=int, default=None, metavar="N",
                    help="default: the optimizer's automatic choice (every byte lendable on a GPU)")
    ap.add_argument("--grads-in-place", action=argparse.BooleanOptionalAction, default=None,
                    help="StepProtocolConfig.grads_in_place (default: the optimizer's automatic choice)")
    ap.add_argument("--out", default=None, help="result directory (default bench/results)")
    args = ap.parse_args(argv)
    device = args.device or ("cpu" if args.tiny else "cuda:0")
    if args.tiny:
        args.batch, args.seq = min(args.batch, 2), min(args.seq, 64)

    import torch

    import gpu_anchor
    from bench.common import write_result
    from bench.train_overhead import _llama, _Window
    from gpu_anchor.client import control
    from gpu_anchor.train import AnchoredOptimizer, StepProtocolConfig, anchor_module

    out = {"model": "llama3.2-1b" + (" (tiny)" if args.tiny else ""), "device": device, "batch": args.batch,
           "seq": args.seq}
    plain = _llama(args.tiny, device, 0)
    win = _Window(device, args.batch, args.seq, plain.config.vocab_size)
    popt = torch.optim.AdamW(plain.parameters(), lr=1e-5)
    win.run(plain, popt, 3, 0)
    out["plain"] = _history(lambda: win.run(plain, popt, 1, 3), device)
    plain = popt = None          # its memory back before the anchored side is built
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    tmp = tempfile.mkdtemp(prefix="ga-train-peak-")
    sock = os.path.join(tmp, device.replace(":", "") + ".sock")
    daemon = control.start(device, sock)
    try:
        client = gpu_anchor.connect(device, namespace="train-peak", socket=sock)
        model = _llama(args.tiny, device, 0)
        anchor_module(model, client)
        opt = AnchoredOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-5), model=model, client=client,
                                config=StepProtocolConfig(lend_grad_bytes=args.lend_grad_bytes,
                                                          grads_in_place=args.grads_in_place))
        out["lend_grad_bytes"], out["grads_in_place"] = opt.config.lend_grad_bytes, opt.config.grads_in_place
        win.run(model, opt, 3, 0)
        out["anchored"] = _history(lambda: win.run(model, opt, 1, 3), device)
        out["anchored_bytes"] = sum(o.nbytes for o in client.objects().values())
        if opt.lender is not None:
            out["lending"] = _plan(opt.lender)
        opt.flush()
        client.drop_namespace()
    finally:
        control.stop(device, sock)
        daemon.wait(timeout=30)
    if out["plain"] and out["anchored"]:
        out["peak_gb_plain_above_state"] = out["plain"]["peak_bytes"] / 1e9
        out["peak_gb_anchored_torch"] = out["anchored"]["peak_bytes"] / 1e9
    print(json.dumps({k: v for k, v in out.items() if k != "lending"}, indent=1)[:4000])
    name = "train_peak" + (f"_lend{round(args.lend_grad_bytes / 2**20)}m" if args.lend_grad_bytes else "") + (
        "_tiny" if args.tiny else "")
    print(write_result(name, out, args.out))
    return 0


def title(r: dict) -> str:
    return (f"Where the training step's memory peak is ({r.get('model')}, batch {r.get('batch')} × {r.get('seq')}"
            + (f", lending up to {r['lend_grad_bytes'] / 2**30:.2f} GiB" if r.get("lend_grad_bytes") else "") + ")")


def render(r: dict) -> str:
    out = []
    for side in ("plain", "anchored"):
        a = r.get(side)
        if not a:
            out.append(f"{side}: no allocator history on this device (CPU).")
            continue
        out += [f"**{side}**: peak {a['peak_bytes'] / 1e9:.2f} GB above the step's start (event {a['peak_event']} of "
                f"{a['events']}, at `{a['peak_site']}`); {a['alive_blocks']} blocks alive there, by site:", "",
                "| allocated at | MiB |", "| --- | ---: |"]
        out += [f"| `{k}` | {v:.1f} |" for k, v in a["alive_by_site_mib"].items()] + [""]
    p = r.get("lending")
    if p:
        out.append(f"Lending plan: areas {p['areas_mib']} MiB; {p['candidates']} candidates, {len(p['chosen'])} chosen "
                   f"({p['chosen_bytes'] / 2**30:.2f} GiB), {p['lent_bytes_last_step'] / 2**30:.2f} GiB lent in the "
                   f"last step; the largest candidates {sorted(p['candidate_mib'])[-3:]} MiB.")
    return "\n".join(out)
