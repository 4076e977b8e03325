"""``checkpoint_stall``'s section of docs/benchmarks.md (``python -m bench report``): the
checkpoint rows against stop-the-world, the targets and their verdicts, the tracker's overhead,
restore and migration."""
from __future__ import annotations


def title(r: dict) -> str:
    what = "1B Llama + AdamW" if r.get("workload", "mlp") != "mlp" else "MLP + Adam"
    return f"Concurrent checkpoint: stall as the job sees it, tracker overhead, restore ({what}, {r.get('device', '?')})"


def _fmt(v) -> str:
    if v is None:
        return "—"
    return f"{v * 1e3:.1f} ms" if abs(v) < 1 else f"{v:.2f} s"


def _cell(st) -> str:
    """median (min–max) of a stats dict; a bare number (results before n ≥ 3) as itself."""
    if st is None:
        return "—"
    if not isinstance(st, dict):
        return f"{_fmt(st)} (n=1)"
    if st["n"] < 3:
        return f"{_fmt(st['median'])} (n={st['n']})"
    return f"{_fmt(st['median'])} ({_fmt(st['min'])}–{_fmt(st['max'])})"


def _ratio(st) -> str:
    """A stats dict of ratios to the plain step, as percent over it."""
    return (f"{100 * (st['median'] - 1):+.1f} % ({100 * (st['min'] - 1):+.1f} to {100 * (st['max'] - 1):+.1f})")


def _paired(ck: dict) -> bool:
    return any(x.get("extra_definition") == "paired" for x in ck.values() if isinstance(x, dict))


NAMES = {"stw": "stop-the-world (copy all to host, then resume)", "cow": "gpu-anchor soft copy-on-write",
         "device": "gpu-anchor device-side snapshot (clone on the GPU, drain later)",
         "recopy": "gpu-anchor soft recopy", "dcp": "`torch.distributed.checkpoint.async_save`",
         "dcp_async_save": "`torch.distributed.checkpoint.async_save`",
         "none": "no checkpoint: the A/A control (the same steps and pauses)"}


def render(r: dict) -> str:
    """Issue 8 / 20's targets: the checkpoint's cost to the job (extra wall time of the steps around it) and
    its host blocking, each ≤ 10 % of stop-the-world; the tracker ≤ 1 % of a step idle, ≤ 10 % in flight;
    restore to first step, on-demand vs full [PhoenixOS figures where the seed gives one]."""
    from bench.common import verdict
    ck, rs, base = r.get("checkpoint", {}), r.get("restore", {}), r.get("baseline_step_s")
    legacy = "reps" not in r  # written before the job-level protocol: one checkpoint per row
    nb = r.get("anchored_bytes", 0)
    size = f"{nb / 1e9:.1f} GB" if nb >= 1e9 else f"{nb / 1e6:.1f} MB"
    if r.get("workload", "mlp") == "mlp":
        what = f"an MLP + Adam, everything anchored: hidden {r['hidden']} × {r['layers']} layers, batch {r['batch']}"
    else:
        what = (f"{r['workload']} ({r.get('dtype')}), `anchor_module` + `AnchoredOptimizer(AdamW)` (weights, "
                f"gradients, moments, undo slots anchored), batch {r['batch']} × {r.get('seq')} tokens")
    out = [f"Workload: {what}; {size} anchored; step without a checkpoint {_cell(r.get('baseline_step', base))}. "
           f"One warm process and daemon for every row; disk writes run in a background thread in every row."
           + (" Written before repetitions and job-level windows were measured: n = 1 per row." if legacy else
              f" {r['reps']} repetitions per row: median (min–max). Job-level extra = wall time of the steps from "
              f"the one whose boundary starts the checkpoint to {r['trail']} steps after it completed, minus as "
              f"many steps without one" + (" at the mean step of that repetition's own controls (plain steps just "
                                           "before and just after it)" if _paired(ck) else "")
              + "; host blocking = time the job's thread was blocked."
              + (f" Between a repetition's disk write and its after-controls, {r['settle']} plain steps not counted "
                 "(the clock settles after the write's idle seconds)." if r.get("settle") else "")
              + (" The `none` row runs the same procedure with no checkpoint: its extra is the measurement's "
                 "noise." if "none" in ck else "")), ""]
    gc = r.get("gpu_clock") or {}
    if gc.get("plain_steps"):
        ps = gc["plain_steps"]
        lo, hi = min(s[1] for s in ps), max(s[1] for s in ps)
        clock = f"{lo:.0f} MHz throughout" if hi - lo < 1 else f"{lo:.0f}–{hi:.0f} MHz"
        out += [f"Plain steps took {_fmt(min(s[0] for s in ps))}–{_fmt(max(s[0] for s in ps))} (n = {len(ps)}), "
                f"with the SM clock (NVML, every 10 ms) at {clock}"
                + (f" (correlation of step time with clock {gc['correlation']:+.2f})" if gc.get("correlation") is not None else "")
                + (f", clock-event reasons: {', '.join(gc['reasons_seen'])}" if gc.get("reasons_seen") else ", no clock-event reason set")
                + ". Hence the paired extra; the extra against the pooled median of every plain step is in the last "
                  "column.", ""]
    ov = r.get("overhead")
    if ov:
        out += [f"Write-set tracker: {ov['plain_step_s']['n']} rounds of three back-to-back windows (plain, idle, "
                f"in flight); the overhead is each round's ratio to its own plain window, median (min to max).", "",
                "| write-set tracker | step | vs no tracker | target |", "| --- | ---: | ---: | --- |",
                f"| none (plain loop) | {_cell(ov['plain_step_s'])} | — | |",
                f"| idle: loop inside `with tracker:`, checkpointer idle | {_cell(ov['idle_step_s'])} | "
                f"{_ratio(ov['idle_vs_plain'])} | ≤ 1 % |",
                f"| in flight, tracking only (copies done, no copy traffic) | {_cell(ov['inflight_tracking_step_s'])} | "
                f"{_ratio(ov['inflight_tracking_vs_plain'])} | ≤ 10 % |"]
        cow = ck.get("cow", {}).get("inflight_step_ratio")
        if cow:
            out.append(f"| in flight, copy-on-write steps (copies, tracking, drain) | — | "
                       f"{100 * (cow['median'] - 1):+.1f} % ({100 * (cow['min'] - 1):+.1f} to "
                       f"{100 * (cow['max'] - 1):+.1f}) | ≤ 10 % |")
        out.append("")
    paired = _paired(ck)
    out += ["| checkpoint | job-level extra | vs stop-the-world | host blocking | vs stop-the-world | steps in flight "
            "| notes |" + (" extra vs the pooled median |" if paired else ""),
            "| --- | ---: | ---: | ---: | ---: | ---: | --- |" + (" ---: |" if paired else "")]
    for k in ("stw", "cow", "device", "recopy", "dcp", "dcp_async_save", "none"):
        x = ck.get(k)
        if x is None:
            continue
        if "error" in x:
            out.append(f"| {NAMES[k]} | — | — | — | — | — | failed: {x['error']} |")
            continue
        note = ""
        if k == "stw" and legacy:
            note = f"with the disk write: {_fmt(x.get('with_disk_write_s'))}"
        elif k in ("cow", "device", "recopy"):
            note = (f"of {x.get('objects', '?')} objects: {x.get('cow_foreground', 0)} copied before a write, "
                    f"{x.get('gpu_buffered', 0)} buffered on the device, {x.get('recopied', 0)} recopied; "
                    + ("validated" if x.get("valid") else "**not valid**")
                    + ("; host objects, so this row is soft copy-on-write" if k == "device" and r["device"] == "cpu" else ""))
        one = "1×" if k == "stw" else None
        ev = one or (f"{100 * x['extra_vs_stw']:.1f} %" if "extra_vs_stw" in x else "—")
        sv = one or (f"{100 * x['stall_vs_stw']:.1f} %" if "stall_vs_stw" in x else "—")
        steps = x.get("inflight_steps")
        steps = steps["median"] if isinstance(steps, dict) else steps
        out.append(f"| {NAMES[k]} | {_cell(x.get('extra_s'))} | {ev} | {_cell(x['stall_s'])} | {sv} | "
                   f"{'—' if steps is None else steps} | {note} |" + (f" {_cell(x.get('extra_pooled_s'))} |" if paired else ""))
    t = ["", "| target | measured | verdict |", "| --- | --- | --- |"]
    for k in ("cow", "device"):
        x = ck.get(k, {})
        if "extra_vs_stw" in x:  # judged on the worst repetition: noise must not pass it
            worst = x["extra_s"]["max"] / max(ck["stw"]["extra_s"]["median"], 1e-9)
            t.append(f"| {NAMES[k]}: job-level extra ≤ 10 % of stop-the-world's, every repetition (issue 20) | "
                     f"median {100 * x['extra_vs_stw']:.1f} %, worst {100 * worst:.1f} % "
                     f"({_fmt(x['extra_s']['median'])}, worst {_fmt(x['extra_s']['max'])}, vs "
                     f"{_fmt(ck['stw']['extra_s']['median'])}) | {verdict(worst <= 0.10)} |")
        if "stall_vs_stw" in x:
            st = x["stall_s"]["median"] if isinstance(x["stall_s"], dict) else x["stall_s"]
            sw = ck["stw"]["stall_s"]
            sw = sw["median"] if isinstance(sw, dict) else sw
            t.append(f"| {NAMES[k]}: host blocking ≤ 10 % of stop-the-world's (issue 8) | "
                     f"{100 * x['stall_vs_stw']:.1f} % ({_fmt(st)} vs {_fmt(sw)}) | {verdict(x['stall_vs_stw'] <= 0.10)} |")
    if ov:
        idle, fl = ov["idle_vs_plain"]["median"] - 1, ov["inflight_tracking_vs_plain"]["median"] - 1
        t.append(f"| tracker idle ≤ 1 % of a step (issue 20) | {100 * idle:+.1f} % | {verdict(idle <= 0.01)} |")
        t.append(f"| tracker in flight ≤ 10 % of a step (issue 20; tracking only) | {100 * fl:+.1f} % | "
                 f"{verdict(fl <= 0.10)} |")
    full, od = rs.get("full"), rs.get("on_demand")
    if full and od:
        t.append(f"| restore → first step, on-demand vs full (n=1) | {_fmt(od['time_to_first_step_s'])} vs "
                 f"{_fmt(full['time_to_first_step_s'])} (restore call {_fmt(od['restore_call_s'])} vs "
                 f"{_fmt(full['restore_call_s'])}; everything loaded after {_fmt(od.get('all_loaded_s'))}; "
                 f"{od.get('on_demand', 0)} objects loaded on demand, {od.get('background', 0)} in the background) "
                 f"[PhoenixOS: Llama2-13B full restore 6.2 s, 31× its time to first token; not this workload] | "
                 f"{'on-demand first' if od['time_to_first_step_s'] < full['time_to_first_step_s'] else '**on-demand not faster**'} |")
    mig = r.get("migration")
    if mig:
        if "live" in mig:
            t.append(f"| migration downtime {r['device']} → {mig['to']}, live vs stop-and-copy | "
                     f"{_fmt(mig['live']['downtime_s'])} vs {_fmt(mig['stop_and_copy_downtime_s'])} "
                     f"[PhoenixOS: 9.8 s → 2.3 s, Llama2-13B serving] | — |")
        else:
            t.append(f"| migration | not measured: {mig.get('skipped') or mig.get('error')} | — |")
    if "setup_s" in r:
        t += ["", f"One-time setup, not counted as stall: pinned host staging for the whole state and the dispatch "
                  f"path's first use {_fmt(r['setup_s'])} (`prepare()`, as a long-running job would)."]
    elif "staging_alloc_s" in r:
        t += ["", f"One-time setup, not counted as stall: pinned host staging for the whole state "
                  f"{_fmt(r['staging_alloc_s'])} (allocated once, as a long-running job would)."]
    if legacy and "tracker_idle_step_s" in r and base:
        t += ["", f"Tracker installed for the whole loop with nobody listening (`with tracker:` before it installed "
                  f"lazily): {_fmt(r['tracker_idle_step_s'])} per step, {100 * (r['tracker_idle_step_s'] / base - 1):+.1f} %."]
    return "\n".join(out + t)
