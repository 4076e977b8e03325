"""Random-instant SIGKILL campaign against AnchoredOptimizer (tiny CPU model).

    python -m bench.train_kills --kills 1000 [--progress journal|device] [--out results.json]

Starts its own host daemon in a private socket directory, runs a fault-free reference,
then kills forked workers at random instants until ``--kills`` kills have landed; every
run is checked bit for bit (anchored state, per-step losses, carried loop state)
against the reference.  Prints and writes JSON: kills, runs, how many kills left a step
in flight / needed the undo slot, mismatches (must be 0), wall time, ms per kill.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=1000)
    ap.add_argument("--tiny", action="store_true", help="20 kills (smoke test size)")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--progress", default="journal", choices=["journal", "device"])
    ap.add_argument("--optimizer", default="adamw", choices=["adamw", "adam", "sgd"])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default=None, help="result directory (default bench/results)")
    args = ap.parse_args(argv)
    if args.tiny:
        args.kills = min(args.kills, 20)

    tmp = tempfile.mkdtemp(prefix="ga-kills-")
    os.environ["GPU_ANCHOR_SOCKET_DIR"] = os.path.join(tmp, "sock")
    os.makedirs(os.environ["GPU_ANCHOR_SOCKET_DIR"], mode=0o700)
    import gpu_anchor
    from gpu_anchor.client import control
    from gpu_anchor.testing import campaign as C

    sock = os.path.join(os.environ["GPU_ANCHOR_SOCKET_DIR"], "cpu.sock")
    daemon = control.start("cpu", sock)
    try:
        cfg = C.CampaignConfig(steps=args.steps, progress=args.progress, optimizer=args.optimizer)
        ref = C.run("ref", cfg, os.path.join(tmp, "ref.log"))
        ref = C.run("ref2", cfg, os.path.join(tmp, "ref2.log"))     # warm timing
        ref_client = gpu_anchor.connect("cpu", namespace="ref2")
        ref_losses, ref_done = C.trajectory(ref.log)
        rng = random.Random(args.seed)
        total = runs = in_flight = rollbacks = mismatches = 0
        t0 = time.perf_counter()
        while total < args.kills:
            ns = f"run{runs}"
            client = gpu_anchor.connect("cpu", namespace=ns)
            res = C.run(ns, cfg, os.path.join(tmp, f"{ns}.log"), random_kills=min(25, args.kills - total),
                        max_delay_s=ref.wall_s * 0.8, rng=rng, client=client)
            losses, done = C.trajectory(res.log)
            bad = C.compare(ref_client, client)
            if losses != ref_losses or done != ref_done or bad:
                mismatches += 1
                print(f"MISMATCH in {ns}: {bad[:5]}", file=sys.stderr)
            total += res.kills
            in_flight += res.in_flight_at_kill
            rollbacks += res.rollbacks
            runs += 1
            client.drop_namespace()
            os.unlink(os.path.join(tmp, f"{ns}.log"))
        wall = time.perf_counter() - t0
        out = {"bench": "train_kills", "kills": total, "runs": runs, "steps_per_run": args.steps,
               "progress": args.progress, "optimizer": args.optimizer,
               "kills_leaving_step_in_flight": in_flight, "kills_needing_undo_rollback": rollbacks,
               "mismatches": mismatches, "wall_s": round(wall, 2), "ms_per_kill": round(1000 * wall / max(1, total), 2),
               "fault_free_run_s": round(ref.wall_s, 4)}
    finally:
        control.stop("cpu", sock)
        daemon.wait(timeout=10)
    from bench.common import write_result
    print(json.dumps(out))
    out.pop("bench")
    print(write_result("train_kills" + ("_tiny" if args.tiny else ""), out, args.out))
    return 0 if out["mismatches"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
