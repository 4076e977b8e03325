"""``gpu-anchor run`` and ``gpu-anchor torchrun`` (registered by gpu_anchor/cli.py).

Also runnable on its own: ``python -m gpu_anchor.launch.cli run ... -- python train.py``.
"""
from __future__ import annotations

import argparse
import sys

from .config import DEFAULT_PRELOAD


def add_run_parser(sub) -> argparse.ArgumentParser:
    r = sub.add_parser("run", help="run a job under supervision: in-place restarts, checkpoint fallback",
                       description="Run COMMAND on this node under supervision. Example: gpu-anchor run "
                                   "--nproc-per-node 2 --checkpoint-dir ckpt --checkpoint-every 500 -- python train.py")
    r.add_argument("--nproc-per-node", type=int, default=1, dest="nproc")
    r.add_argument("--namespace", help="anchored-state namespace (default: GPU_ANCHOR_NAMESPACE or job-<script>)")
    r.add_argument("--max-restarts", type=int, default=3)
    r.add_argument("--restart-backoff", type=float, default=1.0, dest="backoff",
                   help="seconds before a restart that follows a failure without progress (doubles each time)")
    r.add_argument("--crash-loop", type=int, default=3,
                   help="stop after this many failures in a row at the same step with the same exit (0: never)")
    r.add_argument("--checkpoint-dir")
    r.add_argument("--checkpoint-every", type=int, default=0, help="steps between checkpoints (0: none)")
    r.add_argument("--checkpoint-keep", type=int, default=2)
    r.add_argument("--checkpoint-mode", default="concurrent", choices=["concurrent", "stop-the-world"],
                   help="concurrent: copy while the job runs on (soft copy-on-write); stop-the-world: copy to "
                        "host at the step boundary before the job continues")
    r.add_argument("--restore-mode", default="full", choices=["full", "on_demand"],
                   help="after a destructive failure: load the checkpoint before the job starts (full), or start "
                        "at once and load each object when first touched (on_demand; GPU_ANCHOR_RESTORE_MODE)")
    r.add_argument("--no-resume", dest="resume", action="store_false",
                   help="do not restore the newest checkpoint when the daemons hold nothing of this job")
    r.add_argument("--device-type", default="auto", choices=["auto", "cuda", "cpu"],
                   help="auto: the GPUs if the host has any; cpu: host daemons only, and the workers see no GPU "
                        "(their CUDA_VISIBLE_DEVICES is empty)")
    r.add_argument("--cold", dest="warm", action="store_false", help="no warm-worker server: every start is cold")
    r.add_argument("--warm-pool", action="store_true", default=None,
                   help="keep a standby worker per rank (CUDA context created, kernels warmed) that takes over "
                        "after a failure instead of a fork + CUDA init. Default: on for GPU jobs, off for CPU "
                        "jobs (env GPU_ANCHOR_WARM_POOL=1/0)")
    r.add_argument("--no-warm-pool", dest="warm_pool", action="store_false",
                   help="no standby workers: a restart forks from the warm-worker server (saves each GPU the "
                        "standby's CUDA context, ~0.5 GiB)")
    r.add_argument("--prewarm", metavar="MODULE:FUNCTION",
                   help="each standby calls FUNCTION(device) after its CUDA init, on scratch tensors only, e.g. "
                        "one step of a 1-layer copy of the model, so the first step after a failure finds its "
                        "kernels loaded (implies --warm-pool)")
    r.add_argument("--no-auto-prewarm", dest="auto_prewarm", action="store_false",
                   help="standbys do not replay what the job trains (default: after the first step, each "
                        "standby runs one step of a 1-layer copy of the job's transformers model with its batch "
                        "shape and optimizer, on scratch tensors, when the device has the memory; --prewarm "
                        "replaces it)")
    r.add_argument("--no-early-start", dest="early_start", action="store_false",
                   help="start a failed worker's successor only once the worker's process has exited (default: "
                        "at its death, ~0.1 s earlier for a 1B model on a GPU; the successor runs the script up "
                        "to its first daemon request and waits there until the failure is classified)")
    r.add_argument("--preload", default=",".join(DEFAULT_PRELOAD),
                   help="comma-separated modules the warm-worker server imports (e.g. torch,transformers,mymodel)")
    r.add_argument("--keep-daemons", action="store_true", help="leave daemons and anchored state after success")
    r.add_argument("--chaos-kills", type=int, default=0, help="SIGKILL this many times at random instants")
    r.add_argument("--chaos-kill-every", type=float, default=2.0, dest="chaos_every",
                   help="mean seconds between chaos kills (counted from the first step after a recovery)")
    r.add_argument("--chaos-seed", type=int)
    r.add_argument("--chaos-target", default="worker", choices=["worker", "daemon"])
    r.add_argument("--hang-timeout", type=float, default=0.0,
                   help="restart the group when the committed step has not advanced for this many seconds "
                        "(armed after each generation's first step; 0: off)")
    r.add_argument("--quiet", action="store_true")
    r.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ARGS...")
    r.set_defaults(func=cmd_run)
    return r


def cmd_run(args) -> int:
    from gpu_anchor.checkpoint.settings import CheckpointSettings
    from .config import ChaosConfig, RestartPolicy, SupervisorConfig, WarmStart
    from .jobstate import JobBusy
    from .supervisor import Supervisor
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        print("gpu-anchor run: give the command to run after --", file=sys.stderr)
        return 2
    if args.prewarm and args.warm_pool is False:
        print("gpu-anchor run: --prewarm runs in the standby workers; it cannot go with --no-warm-pool",
              file=sys.stderr)
        return 2
    if args.prewarm:
        from gpu_anchor.runtime.warm import check_prewarm_spec
        try:
            check_prewarm_spec(args.prewarm)
        except ValueError as e:
            print(f"gpu-anchor run: {e}", file=sys.stderr)
            return 2
    try:
        cfg = SupervisorConfig(
            command=command, nproc=args.nproc, namespace=args.namespace, device_type=args.device_type,
            keep_daemons=args.keep_daemons, resume=args.resume, quiet=args.quiet,
            restart=RestartPolicy(args.max_restarts, args.backoff, args.crash_loop, args.hang_timeout),
            warm=WarmStart(enabled=args.warm, prewarm=args.prewarm, auto_prewarm=args.auto_prewarm,
                           early_start=args.early_start,
                           preload=[m for m in args.preload.split(",") if m],
                           **({"standby": args.warm_pool} if args.warm_pool is not None else {})),
            checkpoint=CheckpointSettings(args.checkpoint_dir, args.checkpoint_every, args.checkpoint_keep,
                                          args.checkpoint_mode, args.restore_mode),
            chaos=ChaosConfig(args.chaos_kills, args.chaos_every, args.chaos_seed, args.chaos_target))
    except ValueError as e:
        print(f"gpu-anchor run: {e}", file=sys.stderr)
        return 2
    try:
        sup = Supervisor(cfg)
        return sup.run()
    except (ValueError, JobBusy) as e:
        print(f"gpu-anchor run: {e}", file=sys.stderr)
        return 2


def add_torchrun_parser(sub) -> argparse.ArgumentParser:
    # prefix_chars: every argument (torchrun's own options included) goes to torchrun.main untouched
    t = sub.add_parser("torchrun", add_help=False, prefix_chars="\x00",
                       help="torch.distributed.run with this node's daemons started and workers reattaching",
                       description="gpu-anchor torchrun [gpu-anchor options] [torchrun options] script.py ARGS")
    t.add_argument("args", nargs=argparse.REMAINDER)
    t.set_defaults(func=cmd_torchrun)
    return t


def cmd_torchrun(args) -> int:
    from .torchrun import main
    return main(list(args.args))


def jobs_status_lines(as_json: bool = False):
    """For ``gpu-anchor status``: the supervised jobs (list of dicts, or text)."""
    from . import jobstate
    jobs = jobstate.load_all()
    return jobs if as_json else jobstate.format_jobs(jobs)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="gpu-anchor")
    sub = p.add_subparsers(dest="command_name", required=True)
    add_run_parser(sub)
    add_torchrun_parser(sub)
    j = sub.add_parser("jobs", help="supervised jobs: ranks, restarts, recovery times")
    j.add_argument("--json", action="store_true")
    j.set_defaults(func=lambda a: _print_jobs(a.json))
    args = p.parse_args(argv)
    return args.func(args) or 0


def _print_jobs(as_json: bool) -> int:
    import json
    out = jobs_status_lines(as_json)
    print(json.dumps(out, indent=1) if as_json else (out or "no supervised jobs"))
    return 0


if __name__ == "__main__":
    from gpu_anchor import runtime
    runtime.exit_path(lambda: sys.exit(main()))      # as the gpu-anchor command ends (cli.entry)
