"""What runs in a worker process before and around the user's code.

Shared by the warm path (a child forked from the zygote) and the cold path
(``python -m gpu_anchor.launch.worker TARGET...``):

0. subscribe the supervisor to the training protocol's "step committed" event
   (``subscribe``: checkpoints, recovery timing) and, if asked, record what the job trains
   for the standbys' automatic pre-warm;
1. if the supervisor asked for a restore (``GPU_ANCHOR_RESTORE=DIR:STEP``), fill this
   rank's daemons from that checkpoint step — the user's code then binds
   exactly as after a shallow failure (``GPU_ANCHOR_RESTORE_MODE=on_demand``: the
   objects are bound at once and filled as the user's ops first touch them, see
   ``gpu_anchor.checkpoint.supervised``);
2. run the target like ``python script.py args`` / ``python -m module args``, with torch's
   destroyed process groups kept until the worker exits (``process_groups``: a gloo group's
   destructor could otherwise deadlock on the GIL when ``main()`` returns);
3. exit through ``runtime.exit_path`` (atexit, flush, ``os._exit``: no destructor runs), on the
   cold path as on the warm one.

TARGET is ``script.py args...``, ``-m module args...`` or ``-c code args...``.
"""
from __future__ import annotations

import os
import runpy
import sys
import time

from gpu_anchor.checkpoint.settings import CheckpointSettings

from . import events


def subscribe() -> None:
    """The supervisor listens to this worker's committed steps (``boundary.SupervisedSteps``)
    and, when it asked (``GPU_ANCHOR_WARM_RECIPE=1``), to what the first step trained: the
    automatic pre-warm's recipe (``runtime.auto_prewarm.Recorder``), sent as a ``warm_recipe`` mark."""
    from gpu_anchor.train import step_hooks
    from .boundary import STEPS
    step_hooks.subscribe(STEPS)
    from gpu_anchor.runtime.auto_prewarm import RECIPE_ENV, Recorder
    if os.environ.get(RECIPE_ENV) == "1" and not STEPS.watchers:
        STEPS.watchers.append(Recorder(lambda out: events.mark("warm_recipe", **out)).install())


def restore_if_asked() -> None:
    settings = CheckpointSettings.from_env()
    spec = settings.restore
    if not spec:
        return
    from gpu_anchor.checkpoint import snapshot
    import torch
    if spec.startswith("auto:"):
        directory, step = spec[5:], _auto_step(spec[5:])
        if step is None:
            return
    else:
        directory, _, step = spec.rpartition(":")
    t0 = time.time()
    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    # every recorded GPU of this rank goes to the GPU this rank now runs on
    here = f"cuda:{local}"
    man_devices = _recorded_devices(directory, int(step), rank)
    device_map = {d: here for d in man_devices if d.startswith("cuda")}
    if device_map and not torch.cuda.is_available():
        raise RuntimeError(f"checkpoint step {step} of rank {rank} holds GPU state but no GPU is visible")
    if settings.restore_mode == "on_demand":
        # objects bound, journal back (marked restoring); each loads when first touched
        from gpu_anchor.checkpoint import supervised
        stats = supervised.restore_on_demand(directory, int(step), rank, device_map)
    else:
        stats = snapshot.restore(directory, int(step), rank, device_map)
    events.mark("restored", step=int(step), seconds=time.time() - t0, files=stats)


def _auto_step(directory: str) -> int | None:
    """Under torchrun: the checkpoint to restore if this rank's daemons hold no committed step."""
    from gpu_anchor.checkpoint.format import latest_complete
    from gpu_anchor.paths import default_socket
    from . import health
    world, local = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_RANK", "0"))
    ns = os.environ.get("GPU_ANCHOR_NAMESPACE", "default")
    import torch
    checks = [("cpu", f"{ns}/rank{os.environ.get('RANK', '0')}" if world > 1 else ns)]
    if torch.cuda.is_available():
        checks.append((f"cuda:{local}", ns))
    for device, namespace in checks:
        view = health.read_namespace(device, default_socket(device), namespace)
        if view is not None and view["step"] is not None:
            return None
    return latest_complete(directory, world)


def _recorded_devices(directory: str, step: int, rank: int) -> list[str]:
    from gpu_anchor.checkpoint.format import rank_dir, read_manifest
    man = read_manifest(rank_dir(directory, step, rank))
    if man is None:
        raise FileNotFoundError(f"checkpoint step {step} of rank {rank} in {directory} is not complete")
    return [e["device"] for e in man["files"]]


LIVENESS_ENV = "GPU_ANCHOR_LIVENESS"      # "PATH:SLOT": this worker's writers' slot (launch.early_start)


def run(target: list[str]) -> dict:
    """``run_target`` with this process marked as a writer of the job's anchored state when the
    supervisor watches it (``LIVENESS_ENV``): its main thread holds the slot's robust mutexes
    from now until it dies, or lets go of them when the target ends cleanly — so that the
    supervisor tells a death (start the successor now) from the end of the work."""
    spec = os.environ.pop(LIVENESS_ENV, None)
    if not spec:
        return run_target(target)
    from gpu_anchor.runtime import liveness
    path, _, slot = spec.rpartition(":")
    live, slot = liveness.Liveness(liveness.shared_file(path)), int(slot)
    for w in range(liveness.WRITERS):
        live.hold(slot, w)
    try:
        out = run_target(target)
    except SystemExit as e:
        if e.code in (0, None):
            _release(live, slot)
        raise
    _release(live, slot)
    return out


def _release(live, slot: int) -> None:
    from gpu_anchor.runtime import liveness
    for w in range(liveness.WRITERS):
        live.release(slot, w)


def run_target(target: list[str]) -> dict:
    """Run ``target`` as ``python`` would, in this process; raises SystemExit like it.

    Returns the script's globals: the caller keeps them until the process ends,
    because tensors dropped before interpreter shutdown free their anchored objects
    (a plain ``python script.py`` keeps its globals until shutdown too)."""
    if not target:
        raise SystemExit("gpu-anchor worker: nothing to run")
    from . import process_groups
    process_groups.install()
    if target[0] == "-m":
        sys.argv = [target[1]] + target[2:]
        sys.path.insert(0, os.getcwd())
        return runpy.run_module(target[1], run_name="__main__", alter_sys=True)
    elif target[0] == "-c":
        sys.argv = ["-c"] + target[2:]
        sys.path.insert(0, "")
        g = {"__name__": "__main__"}
        exec(compile(target[1], "<string>", "exec"), g)
        return g
    else:
        script = target[0]
        sys.argv = list(target)
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        return runpy.run_path(script, run_name="__main__")


def main(argv: list[str] | None = None):
    """The cold worker; returns the script's globals (``runtime.exit_path`` holds them)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    from gpu_anchor.runtime import install_stack_dumps
    install_stack_dumps()       # as in a forked worker: stacks on SIGABRT, and on SIGUSR1
    if argv[:1] == ["--restore-only"]:   # for a non-Python job: nothing of ours runs its ops
        from gpu_anchor.checkpoint.settings import RESTORE_MODE_ENV
        os.environ[RESTORE_MODE_ENV] = "full"
        restore_if_asked()
        return None
    subscribe()
    events.mark("user_code", how="cold")
    restore_if_asked()
    return run(argv)


if __name__ == "__main__":
    from gpu_anchor.runtime import exit_path
    exit_path(main)     # as a forked worker ends: no destructor runs (see process_groups)
