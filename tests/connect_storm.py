"""A connection storm: N forked processes connect to one daemon at the same instant and
each does one round trip (torch-free, so that forking hundreds of children stays cheap).

    python tests/connect_storm.py SOCKET N [--pause-daemon PID]

With ``--pause-daemon`` the daemon is SIGSTOPped before the children are released and
resumed once every child has begun connecting, so their connects pile up in the kernel's
accept queue.  Prints one JSON object: how many succeeded, the errors seen, the clients'
connect retries, the wall time.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gpu_anchor.client.channel import Channel  # noqa: E402


def _child(path: str, gate: int, ready: int, out: int) -> None:
    os.write(ready, b".")
    os.read(gate, 1)                      # blocks until the parent closes the gate's write end
    try:
        ch = Channel("cpu", path, timeout=120.0)
        ch.request({"op": "ping"})
        ch.close()
        line = {"ok": True, "retries": ch.connect_retries}
    except BaseException as e:  # noqa: BLE001 - the point is to report whatever happened
        line = {"ok": False, "error": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
    os.write(out, (json.dumps(line) + "\n").encode())   # < PIPE_BUF: atomic among children


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("socket")
    p.add_argument("n", type=int)
    p.add_argument("--pause-daemon", type=int, default=0, help="pid of the daemon to SIGSTOP during the start")
    args = p.parse_args()
    gate_r, gate_w = os.pipe()
    ready_r, ready_w = os.pipe()
    out_r, out_w = os.pipe()
    pids = []
    for _ in range(args.n):
        pid = os.fork()
        if pid == 0:
            os.close(gate_w), os.close(ready_r), os.close(out_r)
            try:
                _child(args.socket, gate_r, ready_w, out_w)
            finally:
                os._exit(0)
        pids.append(pid)
    os.close(gate_r), os.close(ready_w), os.close(out_w)
    ready = 0
    while ready < args.n:                  # every child forked and waiting at the gate
        ready += len(os.read(ready_r, args.n))
    if args.pause_daemon:
        os.kill(args.pause_daemon, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        os.close(gate_w)                   # EOF on the gate releases every child at once
        if args.pause_daemon:
            time.sleep(1.0)                # let the connects pile up (how many did is in the retries)
    finally:
        if args.pause_daemon:
            os.kill(args.pause_daemon, signal.SIGCONT)
    data = b""
    with os.fdopen(out_r, "rb") as f:
        data = f.read()                    # EOF once every child has exited
    wall = time.monotonic() - t0
    for pid in pids:
        os.waitpid(pid, 0)
    lines = [json.loads(x) for x in data.decode().splitlines()]
    retries = [x["retries"] for x in lines if x["ok"]]
    print(json.dumps({"n": args.n, "ok": sum(x["ok"] for x in lines), "reported": len(lines),
                      "errors": dict(collections.Counter(x["error"] for x in lines if not x["ok"])),
                      "retries_total": sum(retries), "retried_clients": sum(1 for r in retries if r),
                      "retries_max": max(retries, default=0), "wall_s": round(wall, 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
