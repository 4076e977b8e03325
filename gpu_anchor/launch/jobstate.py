"""A job's record: ranks (or the serving engine), restarts with their classification and
recovery times (torch-free).  The supervisor — of ``run`` and of ``serve`` alike — rewrites
it atomically after every event; ``gpu-anchor status`` reads it.

File: ``<socket dir>/jobs/<namespace>.json``.
"""
from __future__ import annotations

import json
import os
import time

from gpu_anchor.paths import ensure_private_dir, socket_dir


def jobs_dir() -> str:
    return os.path.join(socket_dir(), "jobs")


def path_for(namespace: str) -> str:
    return os.path.join(jobs_dir(), namespace.replace("/", "_") + ".json")


def events_path(namespace: str) -> str:
    """The supervisor's datagram socket; Unix socket paths are limited to 107 bytes."""
    path = os.path.join(jobs_dir(), namespace.replace("/", "_") + ".ev")
    if len(path.encode()) > 100:
        import hashlib
        path = f"/tmp/gpu-anchor-{os.getuid()}-{hashlib.sha1(path.encode()).hexdigest()[:16]}.ev"
    return path


class JobBusy(RuntimeError):
    pass


def lock(namespace: str):
    """Hold this job's lock for the life of the returned file; a second supervisor fails clearly."""
    import fcntl
    ensure_private_dir(jobs_dir())
    f = open(path_for(namespace)[: -len(".json")] + ".lock", "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        owner = f.read().strip() or "?"
        f.close()
        raise JobBusy(f"job {namespace!r} is already supervised (pid {owner}); "
                           "choose another --namespace or stop that one first") from None
    f.seek(0), f.truncate(), f.write(str(os.getpid())), f.flush()
    return f


class JobState:
    def __init__(self, namespace: str, command: list[str], nproc: int, devices: list[str], warm: bool,
                 kind: str = "run") -> None:
        self.path = path_for(namespace)
        self.data = {"namespace": namespace, "kind": kind, "command": command, "nproc": nproc, "devices": devices,
                     "warm": warm, "supervisor_pid": os.getpid(), "started": time.time(), "state": "starting",
                     "generation": 0, "ranks": {}, "restarts": [], "checkpoints": [], "result": None}
        ensure_private_dir(os.path.dirname(self.path))
        self.save()

    def set(self, **fields) -> None:
        self.data.update(fields)
        self.save()

    def set_ranks(self, ranks: dict[int, dict]) -> None:
        self.data["ranks"] = {str(k): v for k, v in ranks.items()}
        self.save()

    def add_restart(self, record: dict) -> dict:
        self.data["restarts"].append(record)
        self.save()
        return record

    def save(self) -> None:
        tmp = f"{self.path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1)
        os.replace(tmp, self.path)


def load_all(directory: str | None = None) -> list[dict]:
    d = directory or jobs_dir()
    out = []
    if not os.path.isdir(d):
        return out
    for name in sorted(os.listdir(d)):
        if name.endswith(".json"):
            try:
                with open(os.path.join(d, name)) as f:
                    job = json.load(f)
            except (OSError, ValueError):
                continue
            job["supervisor_alive"] = _alive(job.get("supervisor_pid"))
            out.append(job)
    return out


def is_live(job: dict) -> bool:
    """Its supervisor runs and it has not finished (``load_all`` fills ``supervisor_alive``)."""
    return bool(job.get("supervisor_alive")) and job.get("state") not in ("done", "stopped")


def _alive(pid) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


# what a training standby's report puts in the job record (``standbys``)
STANDBY_KEYS = ("cuda_init_s", "prewarm_s", "prepare_s", "failed", "auto_prewarm_s", "auto_prewarm_skipped",
                "auto_prewarm_failed", "auto_prewarm_peak_estimate", "auto_prewarm_note", "anchored_warm",
                "anchored_warm_s", "anchored_warm_skipped", "anchored_warm_failed")


def prewarm_text(sb: dict) -> str:
    """What a standby's pre-warm did, from its report (empty when it ran none)."""
    if sb.get("prewarm_s") is not None:
        return f" (pre-warmed in {sb['prewarm_s']:.2f} s)"
    if sb.get("auto_prewarm_s") is not None:
        anchored = f"; anchored update: {sb['anchored_warm']}" if sb.get("anchored_warm") else \
            f"; anchored update not warmed: {sb['anchored_warm_failed']}" if sb.get("anchored_warm_failed") else ""
        return f" (automatically pre-warmed in {sb['auto_prewarm_s']:.2f} s{anchored})"
    if sb.get("auto_prewarm_skipped"):
        return f" (automatic pre-warm skipped: {sb['auto_prewarm_skipped']})"
    if sb.get("auto_prewarm_failed"):
        return f" (automatic pre-warm failed: {sb['auto_prewarm_failed']}; a plain warm standby)"
    return ""


def format_jobs(jobs: list[dict]) -> str:
    """Human-readable lines for ``gpu-anchor status``."""
    lines = []
    for job in jobs:
        state = job["state"] if job.get("supervisor_alive") or job["state"] in ("done", "stopped") else \
            f"{job['state']} (supervisor gone)"
        serving = job.get("kind") == "serve"
        group = job.get("nproc", 1) > 1
        what = (f"serving engine group ({job['nproc']} tensor-parallel ranks)" if group else "serving engine") \
            if serving else f"{job['nproc']} rank(s)"
        lines.append(f"job {job['namespace']!r}: {state}, {what} on "
                     f"{', '.join(job['devices']) or 'cpu'}, {'warm' if job.get('warm') else 'cold'} starts, "
                     f"{len(job['restarts'])} restart(s)")
        lines.append(f"  command: {' '.join(job['command'])}")
        if serving and job.get("frontend_pid"):
            lines.append(f"  frontend: pid {job['frontend_pid']}")
        for r, info in sorted(job.get("ranks", {}).items(), key=lambda kv: int(kv[0])):
            who = (f"engine rank {r}" if group else "engine") if serving else f"rank {r}"
            lines.append(f"  {who}: pid {info.get('pid')}, {info.get('how', '')}")
        for r, sb in sorted((job.get("standbys") or {}).items(), key=lambda kv: int(kv[0])):
            what = f"failed to prepare: {sb['failed']}" if sb.get("failed") else "ready" + prewarm_text(sb)
            if sb.get("hot"):
                what += f", hot: attached to the engine's state in {sb.get('attach_s', 0.0):.2f} s"
            elif sb.get("not_attachable"):
                what += f", warm only (could not attach: {sb['not_attachable']})"
            if sb.get("device_bytes") is not None:
                what += f", holds {sb['device_bytes'] / (1 << 30):.2f} GiB of the device"
            lines.append(f"  standby for rank {r}: pid {sb.get('pid')}, {what}")
        for r, w in sorted((job.get("warm_recipes") or {}).items(), key=lambda kv: int(kv[0])):
            if w.get("skip"):
                lines.append(f"  automatic pre-warm for rank {r}: off ({w['skip']})")
            else:
                m = w["recipe"]["model"]
                lines.append(f"  automatic pre-warm for rank {r}: {m['class'].rpartition(':')[2]}, 1 of "
                             f"{m['config'].get('num_hidden_layers')} layers, batch {'x'.join(map(str, m['batch']))}, "
                             f"{m['dtype']}")
        for i, rs in enumerate(job["restarts"], 1):
            rec = rs.get("recovery_s")
            rec_s = f"{rec:.3f} s to first step" if rec is not None else "recovery not yet measured"
            if rs.get("early_s") is not None:      # a training restart's early start (serving: "early" only)
                rec_s += f" (started early, {rs['early_s'] * 1e3:.0f} ms before its gate opened)"
            lines.append(f"  restart {i}: {rs['action']} ({rs.get('kind') or '-'}), step {rs.get('step')}, "
                         f"{rec_s}: {rs['reason']}")
        if job.get("checkpoints"):
            lines.append(f"  last checkpoint: {job['checkpoints'][-1]}")
        if job.get("result"):
            lines.append(f"  result: {job['result']}")
    return "\n".join(lines)
