"""``serve_throughput``'s section of docs/benchmarks.md (``python -m bench report``): the
throughput and host-time tables, then ``serve_decode``'s roofline, start-up and profile parts."""
from __future__ import annotations

from bench import serve_decode as D

# the engine's host phases of a step, as its step timer names them
PHASES = ("schedule", "prepare_inputs", "forward", "commit_build", "sample", "finish", "commit_prepare",
          "commit_wait")


def render(r: dict) -> str:
    """Markdown for docs/benchmarks.md (``python -m bench report``)."""
    tp = r.get("throughput", {})
    rows, extra = [], []
    if "summary" in tp:     # medians of alternating runs (this module's current format)
        sm, ratio = tp["summary"], tp["anchored_over_plain"]
        an, pl = sm["anchored"], sm["plain"]
        rows.append((f"Throughput, anchored vs the same engine without anchoring "
                     f"({'CUDA-graph decode' if tp.get('cuda_graphs') else 'eager'}; median of {an['n']} "
                     "alternating runs each)",
                     f"{an['median']:.0f} [{an['min']:.0f}–{an['max']:.0f}] vs {pl['median']:.0f} "
                     f"[{pl['min']:.0f}–{pl['max']:.0f}] tokens/s ({ratio:.3f}); outputs equal: "
                     f"{tp['anchored_and_plain_outputs_equal']}",
                     f"≥ 0.99 [paper 0.98]: {'met' if ratio >= 0.99 else 'MISSED'}"))
        eg = tp.get("eager")
        if eg:
            e = eg["summary"]
            rows.append(("Same engines, eager decode (graphs set aside)",
                         f"{e['anchored']['median']:.0f} vs {e['plain']['median']:.0f} tokens/s "
                         f"({eg['anchored_over_plain']:.3f}); graph decode {pl['median'] / e['plain']['median']:.2f}× "
                         f"eager; graph tokens equal to eager: {eg['graph_tokens_equal_to_eager']:.1%}", ""))
        ao = tp.get("async_over_sync")
        if ao:
            ms = tp["async_decode_step_ms"]
            rows.append(("Asynchronous scheduling (decode steps launched ahead of the previous step's read) vs "
                         "synchronous, same engines, alternating runs",
                         "; ".join(f"{k}: {sm[k + ', async']['median']:.0f} vs {sm[k]['median']:.0f} tokens/s "
                                   f"({r:.3f}), decode step {ms[k]['async']:.2f} vs {ms[k]['sync']:.2f} ms"
                                   for k, r in ao.items()), ""))
        names = [(k, v) for k, v in sm.items()] + ([(f"{k}, eager", v) for k, v in eg["summary"].items()]
                                                  if eg else [])
        extra += ["", "Host time per step (ms, median over runs; `sample` includes waiting for the GPU, "
                  "`commit build` runs while the forward is on the GPU):", "",
                  "| engine | wall | " + " | ".join(k.replace("_", " ") for k in PHASES) + " |",
                  "| --- | --- |" + " --- |" * len(PHASES)]
        extra += [f"| {n} | {v['wall_ms_per_step']:.2f} | " + " | ".join(f"{v['step_ms'][k]:.3f}" for k in PHASES)
                  + " |" for n, v in names]
        g = (tp.get("graphs") or {}).get("anchored")
        if g and g.get("graphs"):
            extra += ["", f"CUDA graphs (anchored engine): {g['graphs']} captured in {g['capture_s']:.2f} s; "
                      f"pool {g['pool_bytes'] / 2**20:.0f} MiB, static buffers {g['static_bytes'] / 2**10:.0f} KiB."]
    elif "best_tokens_per_s" in tp:   # results of the earlier best-of format
        t, ratio = tp["best_tokens_per_s"], tp["anchored_over_plain"]
        rows.append(("Throughput, anchored vs the same engine without anchoring (best of runs)",
                     f"{t['anchored']:.0f} vs {t['plain']:.0f} tokens/s ({ratio:.3f}); outputs equal: "
                     f"{tp['anchored_and_plain_outputs_equal']}",
                     f"≥ 0.99 [paper 0.98]: {'met' if ratio >= 0.99 else 'MISSED'}"))
    elif "error" in tp:
        rows.append(("Throughput", "failed: " + tp["error"].replace("|", "/").replace("\n", " "), ""))
    extra += D.render(r)
    mb = r.get("commit_microbench")
    if mb and "snapshot_us_per_step" in mb:
        extra += ["", f"Commit host cost for {mb['sequences']} decoding sequences (CPU micro-benchmark): snapshot "
                  f"{mb['snapshot_us_per_step']:.0f} µs per step on the critical path, encoding "
                  f"{mb['build_us_per_step']:.0f} µs overlapped with the forward, {mb['bytes_per_commit']:.0f} bytes "
                  "per commit."]
    hf = r.get("hf_generate_batch", {})
    if "runs" in hf:
        rows.append((f"vs transformers `generate_batch` (continuous batching), same requests, warmed on them, median "
                     f"of {hf['n']} runs",
                     f"{hf['median_tokens_per_s']:.0f} [{hf['min_tokens_per_s']:.0f}–{hf['max_tokens_per_s']:.0f}] "
                     f"tokens/s: anchored engine {r['anchored_over_generate_batch']:.2f}× (ratio of medians)", ""))
    elif "tokens_per_s" in hf:   # measured before issue 20: warmed on two short prompts, timed once
        rows.append(("vs transformers `generate_batch` (continuous batching), same requests (warmed on two 16-token "
                     "prompts, timed once: n = 1, not a headline)",
                     f"{hf['tokens_per_s']:.0f} tokens/s: anchored engine "
                     f"{r['anchored_over_generate_batch']:.2f}×", ""))
    for key, label in (("recovery_anchored", "gpu-anchor"), ("recovery_no_anchor", "same engine, no anchoring "
                                                                                    "(re-prefill)")):
        rec = r.get(key)
        if rec and rec.get("kill_to_first_resumed_token_s"):
            k = rec["kill_to_first_resumed_token_s"]
            n = k.get("n", 1)
            rows.append((f"SIGKILL → first resumed token on every open stream, {label}",
                         f"median {k['median']:.3f} s (min {k['min']:.3f}, max {k['max']:.3f}"
                         + (f"; medians of {n} kills" if n > 1 else "; one kill: n = 1, not a headline") + "); "
                         f"{rec['streams_resumed']}/{rec['streams']} streams, {rec['token_mismatches']} token "
                         "mismatches", ""))
    out = [f"Model: {r['model']}, {r['dtype']}; {r['requests']} concurrent requests, prompt {r['prompt_len']}, "
           f"max tokens {r['max_tokens']}.", "", "| figure | measured | target |", "| --- | --- | --- |"]
    out += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    out += extra
    b = r.get("recovery_anchored", {}).get("engine_breakdown_s")
    if b:
        out += ["", "Restarted engine, gpu-anchor (seconds): " + ", ".join(
            f"{k.removesuffix('_s').replace('_', ' ')} {v:.3f}" for k, v in b.items()
            if isinstance(v, (int, float)) and not k.endswith("_at")) + ".",     # not wall stamps, not phase dicts
                "",
                "Read with care: the first token a stream receives after the kill can be one the dead engine "
                "had committed but not yet sent (the new engine re-sends committed tokens at hello, after "
                f"`down` = {b.get('down_s', float('nan')):.3f} s). The first token *generated* by the new engine "
                f"comes after its first step ({b.get('first_step_s', float('nan')):.3f} s, which in a fresh "
                "process includes loading the attention kernel), i.e. about "
                f"{b.get('down_s', 0) + b.get('first_step_s', 0):.2f} s after the kill."]
    return "\n".join(out)
