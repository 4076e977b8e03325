"""A worker writes named tensors, is SIGKILLed mid-loop, and a new worker maps them back.

    python examples/kill_and_remap.py [--device cpu|cuda:0] [--kills 5]

Each worker does rounds: write value i into every tensor, then commit ``written = i``
to the daemon's journal. The script kills it at a random instant and starts another,
which must find every byte of round ``written`` (and at most a prefix of round
``written + 1``) exactly where the dead worker left it — no save, no load.
"""
from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

WORKER = """
import sys, time, torch, gpu_anchor
t0 = time.perf_counter()
c = gpu_anchor.connect(sys.argv[1], namespace="demo")
state = [b.tensor for b in c.bind([(f"layer[{k}].weight", (1 << 20,), torch.float32) for k in range(8)])]
bind_ms = (time.perf_counter() - t0) * 1e3
i = int(c.journal.get("written", b"0"))
print(f"ready {i} {bind_ms:.1f}", flush=True)
while True:
    i += 1
    for t in state:
        t.fill_(float(i))
    if state[0].is_cuda:
        torch.cuda.synchronize()
    c.journal.put("written", str(i).encode())
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--kills", type=int, default=5)
    args = p.parse_args(argv)

    import torch

    import gpu_anchor
    from gpu_anchor.client import control

    os.environ.setdefault("GPU_ANCHOR_SOCKET_DIR", tempfile.mkdtemp(prefix="gpu-anchor-demo-"))
    daemon = control.start(args.device)
    print(f"daemon for {args.device} running (pid {daemon.pid})")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE))
    rng = random.Random(0)
    ok = True
    try:
        observer = gpu_anchor.connect(args.device, namespace="demo")
        for k in range(args.kills):
            w = subprocess.Popen([sys.executable, "-c", WORKER, args.device], stdout=subprocess.PIPE, text=True,
                                 env=env)
            _, resumed, bind_ms = w.stdout.readline().split()
            time.sleep(rng.uniform(0.05, 0.3))
            w.send_signal(signal.SIGKILL)
            w.wait()
            state = [b.tensor for b in observer.bind([(f"layer[{j}].weight", (1 << 20,), torch.float32)
                                                      for j in range(8)], "lookup")]
            written = int(observer.journal.get("written"))
            values = set(torch.cat(state).unique().tolist())
            good = values <= {float(written), float(written + 1)}
            ok &= good
            print(f"kill {k + 1}: worker resumed at round {resumed} (bind {bind_ms} ms), was SIGKILLed after "
                  f"round {written}; memory holds rounds {sorted(int(v) for v in values)} -> "
                  f"{'intact' if good else 'CORRUPT'}")
            del state
        print("status:", {k: v for k, v in observer.status().items() if k in ("object_bytes", "segments")})
    finally:
        control.stop(args.device)
        daemon.wait(10)
    print("RESULT:", "every kill recovered in place" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
