"""`make demo`: a small training job survives workers killed on purpose.

1. a fault-free run of examples/demo_train.py under `gpu-anchor run`;
2. the same job with `--chaos-kills N`: workers SIGKILLed at random instants,
   each recovered in place (warm fork, reattach to the anchored state);
3. the same job once more with its daemon SIGKILLed: the supervisor restores
   the last complete checkpoint into a fresh daemon;
then checks that every run ends bit-identical to the fault-free one and prints
each recovery's time.  Runs on CPU in well under a minute.

    python examples/demo.py [--nproc 2] [--device-type cuda] [--kills 3] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def supervised(workdir, sock, name, opts, steps, nproc, device_type, out):
    cmd = [sys.executable, "-m", "gpu_anchor.launch.cli", "run", "--namespace", name, "--nproc-per-node", str(nproc),
           "--device-type", device_type, *opts, "--", sys.executable, os.path.join(HERE, "demo_train.py"),
           "--steps", str(steps), "--step-sleep", "0.015", "--out", out]
    env = {**os.environ, "GPU_ANCHOR_SOCKET_DIR": sock, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    t0 = time.time()
    p = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=600)
    for line in p.stderr.splitlines():
        if line.startswith("[gpu-anchor]") and ("decision" in line or "recovered" in line or "chaos" in line
                                                or "restore" in line):
            print("   ", line)
    if p.returncode != 0:
        print(p.stdout[-2000:], p.stderr[-4000:], file=sys.stderr)
        raise SystemExit(f"{name}: gpu-anchor run failed with {p.returncode}")
    with open(os.path.join(sock, "jobs", name + ".json")) as f:
        job = json.load(f)
    return torch.load(os.path.join(workdir, out)), job, time.time() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--device-type", default="cpu", choices=["cpu", "cuda", "auto"])
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--no-daemon-kill", action="store_true")
    ap.add_argument("--json", help="write the summary here")
    a = ap.parse_args(argv)
    summary = {"nproc": a.nproc, "device_type": a.device_type, "steps": a.steps, "runs": {}}
    ok = True
    with tempfile.TemporaryDirectory(prefix="gpu-anchor-demo-") as work:
        sock = os.path.join(work, "sock")
        print(f"1. fault-free run: {a.steps} steps, {a.nproc} rank(s)")
        ref, _, secs = supervised(work, sock, "demo-ref", [], a.steps, a.nproc, a.device_type, "ref.pt")
        print(f"   done in {secs:.1f} s")
        runs = [("chaos", f"2. chaos: {a.kills} workers SIGKILLed at random instants, recovered in place",
                 ["--chaos-kills", str(a.kills), "--chaos-kill-every", "0.3", "--max-restarts", str(a.kills)])]
        if not a.no_daemon_kill:
            runs.append(("daemon", "3. the daemon SIGKILLed: fall back to the last complete checkpoint",
                         ["--chaos-kills", "1", "--chaos-target", "daemon", "--chaos-kill-every", "0.8",
                          "--checkpoint-dir", os.path.join(work, "ckpt"), "--checkpoint-every", "20"]))
        for name, title, opts in runs:
            print(title)
            res, job, secs = supervised(work, sock, f"demo-{name}", opts, a.steps, a.nproc, a.device_type,
                                        f"{name}.pt")
            same = torch.equal(res, ref)
            want = [("restart", "shallow")] * a.kills if name == "chaos" else [("restore", "destructive")]
            got = [(r["action"], r["kind"]) for r in job["restarts"]]
            if got != want:
                print(f"   expected recoveries {want}, got {got}")
            ok &= same and got == want
            for i, r in enumerate(job["restarts"], 1):
                rec = f"{r['recovery_s']:.3f} s" if r.get("recovery_s") is not None else "n/a"
                extra = f", restored checkpoint step {r['restore_step']}" if r.get("restore_step") else ""
                at = f"at step {r['step']}" if r["step"] is not None else "with the daemon's memory gone"
                print(f"   recovery {i}: {r['action']} ({r['kind']}) {at}, "
                      f"kill -> first step again: {rec}{extra}")
            print(f"   final parameters {'IDENTICAL to' if same else 'DIFFER from'} the fault-free run "
                  f"(bit for bit); {secs:.1f} s")
            summary["runs"][name] = {"identical": same, "seconds": round(secs, 2), "restarts": [
                {k: r.get(k) for k in ("action", "kind", "step", "recovery_s", "restore_step", "how", "reason")}
                for r in job["restarts"]]}
        from gpu_anchor.client import control
        for device, path in control.discover(sock).items():  # a failed run leaves its daemons up
            control.stop(device, path)
    summary["ok"] = ok
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=1)
    print("demo OK: every run matches the fault-free result" if ok else "demo FAILED: results differ")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
