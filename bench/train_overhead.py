"""Steady-state cost of AnchoredOptimizer vs plain PyTorch (same model, same warm process).

    python -m bench train_overhead [--tiny] [--device cuda:0] [--steps 10] [--batch 8 --seq 2048]
                                   [--progress device|journal] [--no-fused] [--torch-fused] [--rounds 2]
                                   [--lend-grad-bytes N] [--grads-in-place]
                                   [--profile K] [--host-forward K] [--out DIR]

Llama3.2-1B shape (transformers, bf16 weights, AdamW foreach, random tokens) on the GPU;
``--tiny`` runs the same architecture at toy size on the CPU.  Both models live in one
process; windows of ``--steps`` steps alternate plain / anchored ``--rounds`` times,
each window run as a training loop runs (no synchronisation inside it: forward,
backward, ``step()``, ``zero_grad()``, the losses read once at the end).  Step time =
window wall time / steps, median over the rounds.  Memory: the plain model alone first
(torch peak, with ``zero_grad(set_to_none=True)`` and with ``False``), then the anchored
window's torch peak above what was allocated when it began, plus the anchored bytes.
Protocol blocking per step = host time inside the protocol that the training loop
waits for: journal commits + waits on the device (``opt.stats``).  ``--no-fused``: the
undo copy + torch's update instead of the fused Adam kernel (``StepProtocolConfig.fused_update``);
the result records which one ran (``fused_update``, ``fused_steps``); ``--no-l2-hints``: that
kernel without its L2 eviction hints (``fused_adam.L2_HINTS``, recorded as ``l2_hints``).  ``--torch-fused``:
both models use ``AdamW(fused=True)`` (torch's own one-kernel update; other roundings than
foreach, so the anchored side runs the undo copy + that kernel).  ``--lend-grad-bytes N`` and
``--[no-]grads-in-place``: the anchored side's ``StepProtocolConfig.lend_grad_bytes`` and
``grads_in_place``; without them the optimizer's automatic choice, as a user gets it (on a GPU:
every gradient byte lendable, written in place).  The result records what ran and what was
named; the gradients written in place and copied home are recorded as ``grads_written``.  ``--profile K``: after the
timed windows, ``K`` more steps of each mode under ``torch.profiler``, their device time per
step by kind of kernel (matmuls, attention, the fused Adam/undo kernel, torch's optimizer
kernels, copies, fills, the rest) and the anchored step's difference from plain
``AdamW(fused=True)`` per kind: where the overhead goes.  Profiled steps are slower than timed
ones; they say where the time goes, not how much there is.  The setup's garbage is collected
before the first timed window (its first full pass would otherwise fall in whichever window first
made enough garbage to start one); the collector's time and full passes, and the caching
allocator's calls to the driver, are recorded by window.  ``--host-forward K``: then ``K`` steps of
each mode, their forward and ``step()`` calls each begun with the device idle, so that their host
time is their own (nothing to wait for): what the host spends that the device may end up waiting
for; then ``K`` anchored steps with those calls under cProfile, their Python functions by own time.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time


def _llama(tiny: bool, device: str, seed: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    kw = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
              num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
              rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=131072)
    if tiny:
        kw.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=2048)
    cfg = LlamaConfig(**kw)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device):
        return LlamaForCausalLM(cfg).to(torch.bfloat16)


class _GcClock:
    """Time the Python garbage collector runs, by generation (``gc.callbacks``): a pass over
    every object of a large process stalls the loop, and a median of windows hides it."""

    def __init__(self) -> None:
        self.ms, self.passes, self._t0 = [0.0, 0.0, 0.0], [0, 0, 0], 0.0
        gc.callbacks.append(self._tick)

    def _tick(self, phase, info) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.ms[info["generation"]] += 1e3 * (time.perf_counter() - self._t0)
            self.passes[info["generation"]] += 1

    def close(self) -> None:
        gc.callbacks.remove(self._tick)


_ALLOCATOR_COUNTS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")


def _allocator_counts(device) -> dict:
    """The caching allocator's counts of driver calls and retries (zeros off CUDA)."""
    import torch
    stats = torch.cuda.memory_stats(device) if str(device).startswith("cuda") else {}
    return {c: stats.get(c, 0) for c in _ALLOCATOR_COUNTS}


def _sync(device):
    import torch
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


class _Window:
    """Runs ``steps`` training steps back to back; the same tokens for both models."""

    def __init__(self, device, batch, seq, vocab):
        import torch
        g = torch.Generator().manual_seed(0)
        self.tokens = [torch.randint(0, vocab, (batch, seq), generator=g).to(device) for _ in range(2)]
        self.device = device

    def run(self, model, opt, steps, first, set_to_none=True):
        """Returns (seconds per step, host seconds in step() per step, losses); ``self.last``:
        the same window's host seconds per step in the forward and backward calls and, on CUDA,
        how far the host ran ahead of the device at each step's start (``host_lead_ms``)."""
        import torch
        cuda = str(self.device).startswith("cuda")
        _sync(self.device)
        losses, in_step, in_fwd, in_bwd, marks = [], 0.0, 0.0, 0.0, []
        t0 = time.perf_counter()
        for i in range(first, first + steps):
            x = self.tokens[i % 2]
            t1 = time.perf_counter()
            if cuda:     # the device reaches this event when it starts the step's work
                marks.append((t1, torch.cuda.Event(enable_timing=True)))
                marks[-1][1].record()
            loss = model(input_ids=x, labels=x).loss
            t2 = time.perf_counter()
            loss.backward()
            t3 = time.perf_counter()
            opt.step()
            in_fwd, in_bwd, in_step = in_fwd + t2 - t1, in_bwd + t3 - t2, in_step + time.perf_counter() - t3
            opt.zero_grad(set_to_none=set_to_none)
            losses.append(loss.detach())
        _sync(self.device)
        wall = time.perf_counter() - t0
        # The window starts with the device idle, so the first event runs as soon as it is
        # recorded: the device's time of each later one, less the host's when it recorded it, is
        # how much work the host had queued ahead then (about 0: the host was what the device
        # waited for).
        self.last = {"host_fwd_s": in_fwd / steps, "host_bwd_s": in_bwd / steps}
        if marks:
            h0, e0 = marks[0]
            self.last["host_lead_ms"] = [e0.elapsed_time(e) - 1e3 * (h - h0) for h, e in marks]
        return wall / steps, in_step / steps, [float(x) for x in losses]

    def host_forward(self, model, opt, steps, first, set_to_none=True, profilers=(None, None)):
        """Milliseconds of host time in each step's forward, backward and ``step()`` calls, each
        begun with the device idle: their own cost on the host (a call that launches more work
        than the launch queue holds also waits for the device there).  With
        ``cProfile.Profile`` objects (forward, step), those calls run under them (and their
        times count the profiler's overhead).  Returns (forward ms, step ms, backward ms)."""
        fwd, stp, bwd = [], [], []
        for i in range(first, first + steps):
            x = self.tokens[i % 2]
            ms, loss = self._timed(lambda: model(input_ids=x, labels=x).loss, profilers[0])
            fwd.append(ms)
            bwd.append(self._timed(loss.backward, None)[0])
            stp.append(self._timed(opt.step, profilers[1])[0])
            opt.zero_grad(set_to_none=set_to_none)
        return fwd, stp, bwd

    def _timed(self, call, profiler):
        """(host ms, result) of ``call()`` begun with the device idle, under ``profiler`` if any."""
        _sync(self.device)
        t0 = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        out = call()
        if profiler is not None:
            profiler.disable()
        return 1e3 * (time.perf_counter() - t0), out


def _host_profile(win, model, opt, steps, first, top=25) -> tuple[list[dict], list[dict]]:
    """The Python functions of ``steps`` forwards and, apart, of their ``step()`` calls, by their
    own host time (cProfile), per step."""
    import cProfile
    import pstats
    profs = (cProfile.Profile(), cProfile.Profile())
    win.host_forward(model, opt, steps, first, profilers=profs)

    def rows(prof):
        out = [{"function": f"{os.path.basename(f)}:{line}({name})", "calls_per_step": nc / steps,
                "own_ms_per_step": 1e3 * tt / steps, "cum_ms_per_step": 1e3 * ct / steps}
               for (f, line, name), (_, nc, tt, ct, _) in pstats.Stats(prof).stats.items()]
        return sorted(out, key=lambda r: -r["own_ms_per_step"])[:top]
    return rows(profs[0]), rows(profs[1])


def _kinds():
    """Kinds of kernel in a training step; first match wins."""
    from bench.step_profile import ATTENTION, MATMUL
    return (("fused Adam + undo (Triton)", r"adam_ring|adam_undo"),
            ("optimizer (torch)", r"adam|multi_tensor_apply|_foreach_(add|mul|lerp|addcmul|addcdiv|sqrt|div)"),
            ("attention", ATTENTION), ("matmul", MATMUL), ("copies", r"copy|memcpy"),
            ("fills and zeroing", r"fill|memset|zero"))


def kind(name: str) -> str:
    from bench.step_profile import first_match
    return first_match(name, _kinds(), "other (norms, elementwise, embedding, loss)")


def _profile(win, modes, steps, first, device) -> dict:
    """``steps`` profiled steps of each mode: per step wall time, device time and its kinds."""
    from torch.profiler import ProfilerActivity, profile

    from bench.step_profile import by_category, by_kernel
    cuda = device.startswith("cuda")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    out = {}
    for mode, (m, o, to_none) in modes.items():
        with profile(activities=acts) as prof:
            t, _, _ = win.run(m, o, steps, first, set_to_none=to_none)
        rows = by_kernel(prof, steps, cuda)
        kinds = by_category(rows, kind)
        out[mode] = {"wall_ms_per_step": 1e3 * t, "busy_ms_per_step": sum(kinds.values()),
                     "kernels_per_step": sum(c for _, _, c in rows),
                     "clock": "device" if cuda else "cpu (aten self time)", "by_kind_ms": kinds,
                     "top": [{"name": n[:160], "ms_per_step": ms, "calls_per_step": c, "kind": kind(n)}
                             for n, ms, c in rows[:20]]}
    ref = out.get("plain_fused") or out.get("plain")
    a = out["anchored"]
    out["anchored_minus_" + ("plain_fused" if "plain_fused" in out else "plain") + "_ms"] = {
        k: a["by_kind_ms"].get(k, 0.0) - ref["by_kind_ms"].get(k, 0.0)
        for k in sorted(set(a["by_kind_ms"]) | set(ref["by_kind_ms"]))} | {
        "busy": a["busy_ms_per_step"] - ref["busy_ms_per_step"], "wall": a["wall_ms_per_step"] - ref["wall_ms_per_step"],
        "kernels": a["kernels_per_step"] - ref["kernels_per_step"]}
    return out


def _peak(device):
    import torch
    return torch.cuda.max_memory_allocated(device) if device.startswith("cuda") else None


def _reset_peak(device):
    import torch
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--device", default=None)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--progress", default=None, choices=["device", "journal"])
    ap.add_argument("--chunk-bytes", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=2, help="plain/anchored window pairs")
    ap.add_argument("--no-fused", action="store_true", help="undo copies + torch's update, not the fused kernel")
    ap.add_argument("--torch-fused", action="store_true", help="AdamW(fused=True) on both sides")
    ap.add_argument("--no-l2-hints", action="store_true",
                    help="the fused Adam kernel without its L2 eviction hints (fused_adam.L2_HINTS)")
    ap.add_argument("--lend-grad-bytes", type=int, default=None, metavar="N",
                    help="StepProtocolConfig.lend_grad_bytes: lend up to N bytes of the gradient buffers "
                         "to the forward's last saved activations (default: the optimizer's automatic choice)")
    ap.add_argument("--grads-in-place", action=argparse.BooleanOptionalAction, default=None,
                    help="StepProtocolConfig.grads_in_place: Linear layers write their weight gradients into the "
                         "anchored buffers, no copy home (default: the optimizer's automatic choice)")
    ap.add_argument("--profile", type=int, default=0, metavar="K",
                    help="then K profiled steps of each mode: device time by kind of kernel")
    ap.add_argument("--host-forward", type=int, default=0, metavar="K",
                    help="then K steps of each mode, each call after a synchronisation: the forward's and "
                         "step()'s own host time")
    ap.add_argument("--out", default=None, help="result directory (default bench/results)")
    args = ap.parse_args(argv)
    for flag in ("profile", "host_forward"):
        if getattr(args, flag) < 0:
            ap.error(f"--{flag.replace('_', '-')} takes a number of steps >= 0, got {getattr(args, flag)}")
    device = args.device or ("cpu" if args.tiny else "cuda:0")
    if args.tiny:
        args.batch, args.seq = min(args.batch, 2), min(args.seq, 64)

    import torch

    import gpu_anchor
    from gpu_anchor.client import control
    from gpu_anchor.train import AnchoredOptimizer, StepProtocolConfig, anchor_module, fused_adam

    hints = fused_adam.L2_HINTS
    fused_adam.L2_HINTS = hints and not args.no_l2_hints

    adamw = {"lr": 1e-5, **({"fused": True} if args.torch_fused else {})}
    tmp = tempfile.mkdtemp(prefix="ga-train-overhead-")
    sock = os.path.join(tmp, device.replace(":", "") + ".sock")
    daemon = control.start(device, sock)
    out = {"model": "llama3.2-1b" + (" (tiny)" if args.tiny else ""), "device": device,
           "dtype": "bfloat16", "optimizer": "AdamW (fused=True)" if args.torch_fused else "AdamW (foreach default)", "batch": args.batch, "seq": args.seq,
           "steps": args.steps, "warmup": args.warmup}
    try:
        if device.startswith("cuda"):
            out["gpu"] = torch.cuda.get_device_name(device)
        # ---- plain PyTorch alone: memory, both zero_grad flavours
        _reset_peak(device)
        plain = _llama(args.tiny, device, 0)
        vocab = plain.config.vocab_size
        out["params"] = sum(p.numel() for p in plain.parameters())
        win = _Window(device, args.batch, args.seq, vocab)
        popt = torch.optim.AdamW(plain.parameters(), **adamw)
        win.run(plain, popt, args.warmup + args.steps, 0, set_to_none=False)
        peak_keep = _peak(device)
        popt.zero_grad(set_to_none=True)
        _reset_peak(device)
        win.run(plain, popt, args.steps, 0)
        peak_none = _peak(device)
        # ---- the anchored twin (same seed: same initial weights), kept alongside
        client = gpu_anchor.connect(device, namespace="overhead", socket=sock)
        model = _llama(args.tiny, device, 0)
        anchor_module(model, client)
        with torch.no_grad():
            for a, b in zip(model.parameters(), plain.parameters()):
                b.copy_(a)                        # both continue from identical weights ...
        popt = torch.optim.AdamW(plain.parameters(), **adamw)    # ... and fresh optimizer state
        opt = AnchoredOptimizer(torch.optim.AdamW(model.parameters(), **adamw), model=model, client=client,
                                config=StepProtocolConfig(chunk_bytes=args.chunk_bytes, progress=args.progress,
                                                          fused_update=not args.no_fused,
                                                          lend_grad_bytes=args.lend_grad_bytes,
                                                          grads_in_place=args.grads_in_place))
        # the peak over the warm-up steps after the first (the first is where gradient lending
        # learns the forward; without lending it is the same measurement)
        win.run(model, opt, 1, 0)
        base = _reset_peak(device)
        win.run(model, opt, max(1, args.warmup - 1), 1)
        peak_a = _peak(device) - base if device.startswith("cuda") else None
        win.run(plain, popt, args.warmup, 0)
        modes = {"plain": (plain, popt, True), "anchored": (model, opt, True)}
        if device.startswith("cuda") and not args.torch_fused:
            # the fastest plain step torch offers: AdamW(fused=True), on a third copy of the model;
            # and the same on a fourth copy that keeps its gradients allocated between steps
            # (zero_grad(set_to_none=False)), as the anchored gradients are and DDP's buckets are
            for name, to_none in (("plain_fused", True), ("plain_fused_grads_kept", False)):
                twin = _llama(args.tiny, device, 0)
                modes[name] = (twin, torch.optim.AdamW(twin.parameters(), lr=adamw["lr"], fused=True), to_none)
                win.run(*modes[name][:2], args.warmup, 0, set_to_none=to_none)
        times = {k: [] for k in modes}
        host = {k: [] for k in modes}
        losses = {k: [] for k in modes}
        gc_ms = {k: [] for k in modes}          # per window: the collector's ms, and its full passes
        gc_full = {k: [] for k in modes}
        phases = {k: {"host_fwd_ms": [], "host_bwd_ms": [], "host_lead_ms_min": [], "host_lead_ms_median": []}
                  for k in modes}          # per window
        alloc = {k: {c: [] for c in _ALLOCATOR_COUNTS} for k in modes}    # per window: cudaMalloc calls ...
        before = dict(opt.stats)
        # The setup (four models built, Triton's compiles) leaves objects the collector has not
        # looked at yet; its next full pass walks them all, in whichever window comes first to
        # make enough garbage, so that pass is the setup's and goes before any timed window.
        gc.collect()
        clock = _GcClock()
        for r in range(args.rounds):
            for mode, (m, o, to_none) in modes.items():
                ms0, full0, a0 = sum(clock.ms), clock.passes[2], _allocator_counts(device)
                t, h, ls = win.run(m, o, args.steps, args.warmup + r * args.steps, set_to_none=to_none)
                a1 = _allocator_counts(device)
                times[mode].append(t)
                host[mode].append(h)
                losses[mode] += ls
                gc_ms[mode].append(sum(clock.ms) - ms0)
                gc_full[mode].append(clock.passes[2] - full0)
                for c in _ALLOCATOR_COUNTS:
                    alloc[mode][c].append(a1[c] - a0[c])
                phases[mode]["host_fwd_ms"].append(1e3 * win.last["host_fwd_s"])
                phases[mode]["host_bwd_ms"].append(1e3 * win.last["host_bwd_s"])
                lead = win.last.get("host_lead_ms", [])[1:]     # the first step starts level
                phases[mode]["host_lead_ms_min"].append(min(lead) if lead else None)
                phases[mode]["host_lead_ms_median"].append(statistics.median(lead) if lead else None)
        clock.close()
        n = opt.stats["steps"] - before["steps"]
        opt.flush()
        step_p, step_a = statistics.median(times["plain"]), statistics.median(times["anchored"])
        anchored = sum(o.nbytes for o in client.objects().values())
        commit_ms = 1000 * (opt.stats["commit_s"] - before["commit_s"]) / n
        wait_ms = 1000 * (opt.stats["wait_s"] - before["wait_s"]) / n
        out.update({
            "progress": opt.progress, "chunks": opt.num_chunks, "undo_bytes": opt.undo_bytes, "rounds": args.rounds,
            "fused_update": opt.stats["fused_steps"] - before["fused_steps"] == n and n > 0,
            "fused_steps": opt.stats["fused_steps"], "copy_steps": opt.stats["copy_steps"],
            "l2_hints": fused_adam.L2_HINTS,
            "fused_off_reason": opt.fused_reason,
            "undo_side_stream": (opt.progress == "device" and device.startswith("cuda") and not opt.stats["fused_steps"]
                                 and os.environ.get("GPU_ANCHOR_UNDO_STREAM", "1") != "0"),
            "step_s_plain": step_p, "step_s_anchored": step_a,
            "step_s_plain_windows": times["plain"], "step_s_anchored_windows": times["anchored"],
            "step_overhead_pct": 100 * (step_a - step_p) / step_p,
            **({"step_s_plain_fused": statistics.median(times["plain_fused"]),
                "step_s_plain_fused_windows": times["plain_fused"],
                "step_overhead_vs_fastest_plain_pct":
                    100 * (step_a - min(step_p, statistics.median(times["plain_fused"])))
                    / min(step_p, statistics.median(times["plain_fused"]))} if "plain_fused" in times else {}),
            **({"step_s_plain_fused_grads_kept": statistics.median(times["plain_fused_grads_kept"]),
                "step_s_plain_fused_grads_kept_windows": times["plain_fused_grads_kept"],
                "step_overhead_vs_plain_fused_grads_kept_pct":
                    100 * (step_a - statistics.median(times["plain_fused_grads_kept"]))
                    / statistics.median(times["plain_fused_grads_kept"])} if "plain_fused_grads_kept" in times else {}),
            "host_step_call_ms_plain": 1000 * statistics.median(host["plain"]),
            "host_step_call_ms_anchored": 1000 * statistics.median(host["anchored"]),
            "protocol_blocking_ms": commit_ms + wait_ms,
            "commits_per_step": (opt.stats["commits"] - before["commits"]) / n,
            "commit_ms_per_step": commit_ms, "host_wait_ms_per_step": wait_ms,
            "anchored_bytes": anchored,
            # what ran (opt.config: the automatic choice decided) and what the command named (None: nothing)
            "lend_grad_bytes": opt.config.lend_grad_bytes,
            "grads_in_place": opt.config.grads_in_place,
            "settings_named": {"lend_grad_bytes": args.lend_grad_bytes, "grads_in_place": args.grads_in_place},
            # gradients written in place and copied home, over the whole run (warm-up and profile included)
            "grads_written": dict(opt._grads.stats),
            **({"lent_bytes_last_step": opt.lender.stats["last_lent_bytes"],
                "lent_tensors_per_window": opt.lender.stats["lent_tensors"] / max(1, opt.lender.stats["windows"]),
                "lend_evicted_bytes": opt.lender.stats["evicted_bytes"],
                "lend_budget_final": opt.lender.budget} if opt.lender is not None else {}),
            "step_s_mean": {k: statistics.mean(v) for k, v in times.items()},
            # the same ratio over the mean of the windows: a window a pause of the garbage collector
            # lengthened counts here, not in the medians
            "step_overhead_vs_fastest_plain_mean_pct": 100 * (statistics.mean(times["anchored"]) / min(
                statistics.mean(v) for k, v in times.items() if k in ("plain", "plain_fused")) - 1),
            "gc_ms_per_step": {k: sum(v) / (args.rounds * args.steps) for k, v in gc_ms.items()},
            "gc_full_passes": {k: sum(v) for k, v in gc_full.items()},
            # by window, beside step_s_*_windows: tells a window the collector lengthened from one
            # that was slow for another reason
            "gc_ms_windows": gc_ms, "gc_full_passes_windows": gc_full, "gc_collected_before_rounds": True,
            # ... and by window, what the caching allocator asked of the driver: a window whose
            # blocks no longer fit the cache mallocs (or frees its cache and retries), and waits
            **({"allocator_windows": alloc} if device.startswith("cuda") else {}),
            # ... and the host's side by window: its seconds in the forward and backward calls, and
            # how far ahead of the device it was at the steps' starts (about 0: the device waited
            # for the host; None off CUDA)
            "host_windows": phases,
            "losses_plain": losses["plain"], "losses_anchored": losses["anchored"],
            "losses_identical": losses["plain"] == losses["anchored"], "chunk_bytes_set": args.chunk_bytes,
        })
        first = args.warmup + args.rounds * args.steps
        if args.profile:     # after the figures above: its steps must not count in the stats
            out["profile"] = _profile(win, modes, args.profile, first, device)
            first += args.profile
        if args.host_forward:
            timed = {mode: win.host_forward(m, o, args.host_forward, first, set_to_none=to_none)
                     for mode, (m, o, to_none) in modes.items()}
            out["host_forward_ms"] = {mode: t[0] for mode, t in timed.items()}
            out["host_step_ms"] = {mode: t[1] for mode, t in timed.items()}
            out["host_backward_ms"] = {mode: t[2] for mode, t in timed.items()}
            # then where the anchored forward's and step()'s host time goes, by Python function
            out["host_forward_profile_anchored"], out["host_step_profile_anchored"] = _host_profile(
                win, model, opt, args.host_forward, first + args.host_forward)
        if args.profile or args.host_forward:
            opt.flush()
        if peak_a is not None:
            out.update({"peak_bytes_plain": peak_none, "peak_bytes_plain_grads_kept": peak_keep,
                        "peak_bytes_anchored_torch": peak_a,
                        "extra_memory_pct": 100 * (peak_a + anchored - peak_none) / peak_none,
                        "extra_memory_pct_vs_grads_kept": 100 * (peak_a + anchored - peak_keep) / peak_keep,
                        "undo_pct_of_plain_peak": 100 * opt.undo_bytes / peak_none})
        client.drop_namespace()
    finally:
        fused_adam.L2_HINTS = hints
        control.stop(device, sock)
        daemon.wait(timeout=30)
    from bench.common import write_result
    print(json.dumps({k: v for k, v in out.items() if not k.startswith("losses_")}, indent=1))
    name = "train_overhead" + (f"_{args.progress}" if args.progress else "") + ("_nofused" if args.no_fused else "") + ("_torchfused" if args.torch_fused else "") + ("_nohints" if args.no_l2_hints else "") + (
        f"_chunk{max(1, round(args.chunk_bytes / 2**20))}m" if args.chunk_bytes else "") + (
        "_profile" if args.profile else "") + ("_hostfwd" if args.host_forward else "") + (
        f"_lend{round(args.lend_grad_bytes / 2**20)}m" if args.lend_grad_bytes else "") + (
        "_inplace" if args.grads_in_place else "_copied" if args.grads_in_place is False else "") + (
        "_tiny" if args.tiny else "")
    print(write_result(name, out, args.out))
    return 0


# ---------------------------------------------------------------- report
from bench.train_overhead_report import render, title  # noqa: E402,F401  (python -m bench report)


if __name__ == "__main__":
    sys.exit(main())
