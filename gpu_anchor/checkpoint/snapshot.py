"""Checkpoints of a job's anchored state: every object of a namespace + its journal.

Contract (worker side)::

    client.journal.commit({..., "gpu_anchor/step": b"%d" % step})   # the step is durable
    snapshot.at_step(step, client, host_client)                    # then, at the boundary

``at_step`` does nothing unless the settings (``CheckpointSettings``; by default what the
supervisor put in the environment) ask for a checkpoint at ``step``.  When due, it copies
every object of each client's namespace and the whole journal to host memory *before
returning* — the worker is at a committed step boundary and nothing is in flight, so the
copy equals the state at exactly that step — then writes the copy in a background thread
while training goes on.  Layout and commit rule: ``gpu_anchor.checkpoint.format``.
``restore`` fills fresh daemons from a step: objects first, journal last (a crash during
restore leaves no journal, so the supervisor restores again).  Not tied to any training
protocol.
"""
from __future__ import annotations

import atexit
import base64
import json
import os
import shutil
import sys
import threading
import time

import torch

from gpu_anchor.client import mapping
from gpu_anchor.client.client import Client

from gpu_anchor.journal_keys import RESTORED_KEY, STEP_KEY

from .format import FORMAT, SAFETENSORS_DTYPES as _ST_DTYPES, complete_ranks, prune, read_manifest, step_dir
from .settings import CheckpointSettings

PROGRESS_MIN_BYTES = 1 << 30      # a progress bar for writes from this size on

_writer: threading.Thread | None = None
# Tensors this module bound that the program itself did not hold: dropping them
# would free the objects in the daemon (last reference gone), so they are kept
# until the process ends, when anchored objects stay for the next worker.
HELD: dict[tuple, torch.Tensor] = {}
_writer_error: list[BaseException] = []


def due(step: int, settings: CheckpointSettings | None = None) -> bool:
    return (settings or CheckpointSettings.from_env()).due(step)


def at_step(step: int, *clients: Client, settings: CheckpointSettings | None = None) -> bool:
    """Snapshot ``clients``' namespaces if ``step`` is due; True if one was started.

    Call on every rank right after the journal commit that made ``step``
    durable, before touching anchored state again.
    """
    settings = settings or CheckpointSettings.from_env()
    if not settings.due(step):
        return False
    directory = settings.directory
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if complete_ranks(step_dir(directory, step), world).get(rank):
        return False  # already on disk (a restarted worker re-reaching the step)
    wait()
    captured = [capture(c, step) for c in clients]
    _start_writer(directory, step, rank, world, captured, settings.keep)
    return True


def capture(client: Client, step: int | None = None) -> dict:
    """Host copies of every object of ``client``'s namespace, plus its journal."""
    journal = client.journal.get_many()
    if step is not None and STEP_KEY in journal and int(journal[STEP_KEY]) != step:
        raise RuntimeError(f"snapshot.at_step({step}) but the journal's committed step is "
                           f"{int(journal[STEP_KEY])}: call it right after committing the step")
    from gpu_anchor.client.client import _leases
    infos = client.objects()
    already = {n for n in infos if (client._instance, client.namespace, n) in _leases}
    bound = client.bind([(n, i.shape, mapping.torch_dtype(i.dtype)) for n, i in sorted(infos.items())], "lookup")
    tensors = {b.name: b.tensor.detach().to("cpu", copy=True) for b in bound if b.tensor is not None}
    for b in bound:
        if b.tensor is not None and b.name not in already:
            HELD[(client.device, client.namespace, b.name)] = b.tensor
    return {"device": client.device, "namespace": client.namespace, "tensors": tensors, "journal": journal}


def wait() -> None:
    """Block until the background write (if any) has finished; re-raise its error."""
    global _writer
    if _writer is not None:
        _writer.join()
        _writer = None
    if _writer_error:
        raise RuntimeError("writing the last snapshot failed") from _writer_error.pop()


def _start_writer(directory, step, rank, world, captured, keep: int) -> None:
    global _writer

    def run():
        try:
            write(directory, step, rank, world, captured, keep)
        except BaseException as e:  # reported by the next wait()
            _writer_error.append(e)
    _writer = threading.Thread(target=run, name="gpu-anchor-snapshot", daemon=True)
    _writer.start()
    if not getattr(_start_writer, "_hooked", False):
        atexit.register(lambda: _writer is not None and _writer.join())
        _start_writer._hooked = True


def write(directory: str, step: int, rank: int, world: int, captured: list[dict], keep: int = 2) -> str:
    """Write one rank's part of ``step`` and commit it; returns the rank directory."""
    rdir = os.path.join(step_dir(directory, step), f"rank{rank}")
    if os.path.exists(rdir):
        shutil.rmtree(rdir)  # a torn attempt at the same step
    os.makedirs(rdir)
    total = sum(t.numel() * t.element_size() for c in captured for t in c["tensors"].values())
    bar = _progress(total, f"checkpoint step {step} rank {rank}")
    files = []
    throttle = float(os.environ.get("GPU_ANCHOR_SNAPSHOT_THROTTLE_S", "0") or 0)  # tests: widen the window
    for c in captured:
        fname = c["device"].replace(":", "") + ".safetensors"
        size = _write_safetensors(os.path.join(rdir, fname), c["tensors"], bar, throttle)
        files.append({"device": c["device"], "namespace": c["namespace"], "file": fname, "bytes": size,
                      "objects": len(c["tensors"]),
                      "journal": {k: base64.b64encode(v).decode() for k, v in c["journal"].items()}})
    if bar is not None:
        bar.close()
    manifest = {"format": FORMAT, "step": step, "rank": rank, "world_size": world,
                "time": time.time(), "files": files}
    _write_durable(os.path.join(rdir, "manifest.json"), json.dumps(manifest, indent=1).encode())
    _write_durable(os.path.join(rdir, "COMMITTED"), b"%d\n" % step)
    _fsync_dir(rdir)
    if rank == 0:
        prune(directory, world, keep)
    return rdir


def _write_safetensors(path: str, tensors: dict, bar, throttle: float) -> int:
    header, offset = {}, 0
    for name, t in tensors.items():
        dt = mapping.dtype_name(t.dtype)
        if dt not in _ST_DTYPES:
            raise TypeError(f"cannot snapshot {name!r}: dtype {dt} has no safetensors code")
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[dt], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(len(head).to_bytes(8, "little"))
        f.write(head)
        for name, t in tensors.items():
            if t.numel():
                f.write(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))
            if bar is not None:
                bar.update(t.numel() * t.element_size())
            if throttle:
                f.flush()
                time.sleep(throttle)
        f.flush()
        os.fsync(f.fileno())
    return 8 + len(head) + offset


def _write_durable(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _progress(total: int, desc: str):
    if total < PROGRESS_MIN_BYTES:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="B", unit_scale=True, desc=desc, file=sys.stderr)


def restore(directory: str, step: int, rank: int, device_map: dict[str, str] | None = None,
            socket_paths: dict[str, str] | None = None) -> dict:
    """Fill this rank's daemons with ``step``: objects first, journal last.

    ``device_map`` maps a recorded device to where it goes now (e.g. a rank that
    moved GPUs).  Namespaces are emptied first.  Returns per-file statistics.
    """
    from safetensors import safe_open
    rdir = os.path.join(step_dir(directory, step), f"rank{rank}")
    man = read_manifest(rdir)
    if man is None:
        raise FileNotFoundError(f"{rdir} is not a complete snapshot")
    stats = {}
    for entry in man["files"]:
        device = (device_map or {}).get(entry["device"], entry["device"])
        client = Client(device, entry["namespace"], (socket_paths or {}).get(device))
        client.drop_namespace()
        t0 = time.perf_counter()
        with safe_open(os.path.join(rdir, entry["file"]), framework="pt") as f:
            names = list(f.keys())
            specs = []
            for n in names:
                sl = f.get_slice(n)
                specs.append((n, tuple(sl.get_shape()), torch_dtype_of(sl.get_dtype())))
            bound = client.bind(specs, "replace")
            for b in bound:
                b.tensor.copy_(f.get_tensor(b.name))
                HELD[(device, entry["namespace"], b.name)] = b.tensor
        if device.startswith("cuda"):
            torch.cuda.synchronize(torch.device(device))
        journal = {k: base64.b64decode(v) for k, v in entry["journal"].items()}
        journal[RESTORED_KEY] = b"%d" % step
        client.journal.commit(journal)
        stats[device] = {"objects": len(names), "bytes": entry["bytes"], "seconds": time.perf_counter() - t0}
    return stats


def torch_dtype_of(code: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype code (``"BF16"``)."""
    for name, c in _ST_DTYPES.items():
        if c == code:
            return mapping.torch_dtype(name)
    raise TypeError(f"unsupported safetensors dtype {code}")
