"""2-GPU DDP (NCCL) with one rank SIGKILLed at protocol points, group restarted torchrun-style.

    NCCL_NVLS_ENABLE=0 PYTHONPATH=. python -m gpu_anchor.train.ddp_gpu --out train_gpu_ddp.json

Starts a daemon per GPU in a private socket directory, runs a fault-free reference
group and a group whose ranks are killed (``ddp_campaign.run_group``, ranks are fresh
interpreters), and compares per-rank loss trajectories and sha256 digests of each
rank's parameters + optimizer state.  Model: the campaign MLP widened (fp32).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    from gpu_anchor.daemon import control

    from . import campaign as C
    from . import ddp_campaign as D

    tmp = tempfile.mkdtemp(prefix="ga-ddp-gpu-")
    os.environ["GPU_ANCHOR_SOCKET_DIR"] = os.path.join(tmp, "sock")
    os.makedirs(os.environ["GPU_ANCHOR_SOCKET_DIR"], mode=0o700)
    devices = ["cuda:0", "cuda:1"]
    daemons = [(d, os.path.join(os.environ["GPU_ANCHOR_SOCKET_DIR"], d.replace(":", "") + ".sock")) for d in devices]
    procs = [control.start(d, p) for d, p in daemons]
    cfg = C.RunConfig(steps=args.steps, chunk_bytes=4 << 20, progress="device")
    specs = [(1, "mid_chunk@1:1"), (0, "before_boundary@3"), (1, "after_update@4:0"),
             (0, "after_commit@6:2"), (1, "between_steps@7")]
    out = {"test": "train_gpu_ddp", "devices": devices, "width": args.width, "steps": args.steps, "specs": specs}
    try:
        os.makedirs(os.path.join(tmp, "ref"))
        os.makedirs(os.path.join(tmp, "run"))
        ref = D.run_group("dref", cfg, os.path.join(tmp, "ref"), devices=devices, width=args.width, timeout_s=240)
        run = D.run_group("dk", cfg, os.path.join(tmp, "run"), faults_seq=specs, devices=devices,
                          width=args.width, timeout_s=240)
        ok = run["kills"] == len(specs)
        for r in range(2):
            a, b = C.trajectory(ref["logs"][r])[0], C.trajectory(run["logs"][r])[0]
            out[f"rank{r}_losses_identical"] = a == b
            da, db = C.digests(ref["logs"][r]), C.digests(run["logs"][r])
            out[f"rank{r}_state_digest_identical"] = bool(da) and da == db
            ok &= a == b and bool(da) and da == db
        out.update({"kills": run["kills"], "generations": run["generations"], "ref_wall_s": ref["wall_s"],
                    "faulted_wall_s": run["wall_s"], "ok": bool(ok)})
    finally:
        for (d, p), proc in zip(daemons, procs):
            control.stop(d, p)
            proc.wait(timeout=30)
    text = json.dumps(out, indent=1, default=list)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0 if out.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
