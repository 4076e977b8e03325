"""The restore and migration rows of ``checkpoint_stall`` (``python -m bench checkpoint_stall``):
restore to the first step, on-demand against full, from the checkpoint the stall rows wrote; and
the downtime of moving the job to another GPU, live (pre-copy, cut-over, on-demand) against
stop-and-copy."""
from __future__ import annotations

import os
import time


def _sync(device):
    import torch
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _restore(directory, device, args, mode):
    import gpu_anchor
    from gpu_anchor.checkpoint import restore as od
    from gpu_anchor.testing.workload import Job
    from gpu_anchor.checkpoint.writeset import WriteSetTracker
    from gpu_anchor.checkpoint import snapshot
    from gpu_anchor.checkpoint.format import latest_complete
    step = latest_complete(directory, 1)
    gpu_anchor.connect(device, namespace="job").drop_namespace()
    tracker = WriteSetTracker()
    t0 = time.perf_counter()
    if mode == "full":
        snapshot.restore(directory, step, 0)
        _sync(device)
        r = None
    else:
        r = od.OnDemandRestore(directory, tracker, step=step).start()
    t_restore = time.perf_counter() - t0
    # building the module (device-side init + binds that all match) is the same for both modes;
    # it overlaps the background loading of on-demand restore, as it would in a real restart
    t1 = time.perf_counter()
    job = Job(gpu_anchor.connect(device, namespace="job"), hidden=args.hidden, layers=args.layers, batch=args.batch)
    build = time.perf_counter() - t1
    t2 = time.perf_counter()
    with tracker:
        job.step(step + 1)
        _sync(device)
    first = time.perf_counter() - t2
    out = {"restore_call_s": t_restore, "build_s": build, "first_step_s": first,
           "time_to_first_step_s": time.perf_counter() - t0, "step": step}
    if r is not None:
        stats = r.wait()
        out.update(all_loaded_s=time.perf_counter() - t0 - build, on_demand=len(stats["on_demand"]),
                   background=len(stats["background"]))
    return out


def _steps(job, start: int, n: int, device: str) -> list[float]:
    """``n`` committed steps of a ``Job`` from step ``start``, each timed to a device sync."""
    times = []
    for s in range(start, start + n):
        t0 = time.perf_counter()
        job.step(s)
        job.commit(s)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times


def _migrate(args, dest: str, sock: str) -> dict:
    """Downtime of moving the job ``args.device`` → ``dest``: live (pre-copy + cut-over + on-demand)
    vs stop-and-copy (stop, bind at the destination, copy every object device to device)."""
    import torch
    import gpu_anchor
    from gpu_anchor.checkpoint.migrate import Migration
    from gpu_anchor.testing.workload import Job
    from gpu_anchor.checkpoint.writeset import WriteSetTracker
    from gpu_anchor.client import control
    path = os.path.join(sock, dest.replace(":", "") + ".sock")
    proc = control.start(dest, path)
    try:
        kw = dict(hidden=args.hidden, layers=args.layers, batch=args.batch)
        job = Job(gpu_anchor.connect(args.device, namespace="mig"), **kw)
        tracker = WriteSetTracker()
        _steps(job, 1, 2, args.device)
        m = Migration([job.client], tracker, {args.device: dest}, socket_paths={dest: path})
        m.start(2)
        step, inflight = 3, []
        with tracker:
            while not m.ready() and len(inflight) < args.inflight_steps:
                inflight += _steps(job, step, 1, args.device)
                step += 1
        restore = m.cutover(step - 1)
        t0 = time.perf_counter()
        with torch.cuda.device(torch.device(dest)), tracker:
            moved = Job(gpu_anchor.connect(dest, namespace="mig", socket=path), **kw)
            _steps(moved, step, 1, dest)
        first = time.perf_counter() - t0
        restore.wait()
        live = {"downtime_s": m.downtime_s, "first_step_after_cutover_s": first, "precopy_steps": len(inflight),
                "recopied": len(m.result.recopied), "objects": m.result.objects}
        # baseline: stop, then copy everything straight to the destination before resuming
        dst = gpu_anchor.connect(dest, namespace="mig-stw", socket=path)
        src = job.tensors()
        t0 = time.perf_counter()
        bound = dst.bind([(n, tuple(t.shape), t.dtype) for n, t in src.items()], "replace")
        for b in bound:
            b.tensor.copy_(src[b.name], non_blocking=True)
        torch.cuda.synchronize(torch.device(dest))
        dst.journal.commit(job.client.journal.get_many())
        stop_copy = time.perf_counter() - t0
        return {"to": dest, "live": live, "stop_and_copy_downtime_s": stop_copy}
    finally:
        control.stop(dest, path)
        proc.wait(timeout=30)
