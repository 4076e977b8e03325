"""Engine restart to first token, with and without the warm pool (``gpu-anchor serve --warm-pool``,
``--prewarm``).

    python -m bench coldstart                  # Qwen3-8B shape, random bf16 weights, cuda:0
    python -m bench coldstart --tiny           # toy model on the CPU

For each mode a real ``gpu-anchor serve`` runs with one long stream open; the engine
process is SIGKILLed ``--kills`` times and the client measures the gap between the last
token before the kill and the first one after it.  The engine reports its own phases
(process start, CUDA init, bind, restore, first step) in ``/health``.  Without the pool a
new engine is forked from the supervisor (imports done, no CUDA context); with it a
standby that already holds a CUDA context and warmed kernels takes over; with
``--prewarm`` that standby also ran a 1-layer scratch engine of the same shapes first
(``serve/prewarm.py``), so the restarted engine's first step finds its kernels loaded.  The state
(weights, KV, requests) survives in the device's anchor daemon in both modes: this is
restart from anchored GPU memory, not PhoenixOS's start from a host-memory checkpoint.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

from bench.common import get_json, stop_process, write_result
from bench.protocol import MIN_N, Cell

# --no-hot-standby: these modes measure an engine started after the fault (the hot standby, the
# default on one GPU, is bench serve_takeover's)
MODES = {"fork": ["--no-hot-standby", "--no-prewarm"], "warm_pool": ["--warm-pool", "--no-hot-standby", "--no-prewarm"],
         "prewarm": ["--prewarm", "--no-hot-standby"]}
LABELS = {"fork": "fork from the supervisor", "warm_pool": "warm standby (`--warm-pool`)",
          "prewarm": "warm standby + scratch-engine pre-warm (`--prewarm`)"}
PHASES = ("process_start_s", "cuda_init_s", "bind_s", "weights_s", "restore_s", "init_s", "first_step_s", "down_s")



def _stream(base, body, stamps, done):
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(dict(body, stream=True)).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            for line in r:
                if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                    stamps.append(time.perf_counter())
    finally:
        done.set()


def _one_mode(args, model, mode: str, sock_dir: str) -> dict:
    port_file = os.path.join(sock_dir, f"port-{mode}")
    cmd = [sys.executable, "-m", "gpu_anchor.serve", model, "--random-weights", "--port", "0", "--port-file",
           port_file, "--device", args.device, "--kv-cache-gib", str(args.kv_gib), "--max-model-len", "2048",
           "--socket", os.path.join(sock_dir, "d.sock"), "--namespace", "coldstart"]
    if args.device == "cpu":
        cmd += ["--dtype", "float32", "--cpu-threads", "1"]
    cmd += MODES[mode]
    log = open(os.path.join(sock_dir, f"serve-{mode}.log"), "ab")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, env={**os.environ, "PYTHONPATH": os.getcwd()})
    row = {"kills": []}
    try:
        deadline = time.time() + args.start_timeout
        while not os.path.exists(port_file):
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"gpu-anchor serve did not start (see {log.name})")
            time.sleep(0.1)
        base = f"http://127.0.0.1:{open(port_file).read()}"
        while not get_json(base + "/health").get("engine_pid"):
            time.sleep(0.1)
        for _ in range(args.kills):
            stamps, done = [], threading.Event()
            body = {"model": os.path.basename(model), "prompt": "hello " * args.prompt_words,
                    "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}
            threading.Thread(target=_stream, args=(base, body, stamps, done), daemon=True).start()
            time.sleep(args.settle)          # the standby (if any) is made ~2 s after an engine starts
            while len(stamps) < 3 and not done.is_set():
                time.sleep(0.01)
            pid = get_json(base + "/health")["engine_pid"]
            n = len(stamps)
            t_kill = time.perf_counter()
            os.kill(pid, signal.SIGKILL)
            while len(stamps) <= n and not done.is_set():
                time.sleep(0.001)
            if len(stamps) <= n:
                raise RuntimeError("the stream ended without a token after the kill")
            first_after = next(t for t in stamps[n:] if t > t_kill)
            done.wait(600)
            h = get_json(base + "/health")
            rec = h.get("last_recovery", {})
            row["kills"].append({"kill_to_token_s": first_after - t_kill,
                                 "token_gap_s": first_after - stamps[n - 1] if n else None,
                                 "warm_standby": rec.get("warm_standby"),
                                 **{k: rec.get(k) for k in PHASES}})
        ks = row["kills"]
        row["median_kill_to_token_s"] = statistics.median(k["kill_to_token_s"] for k in ks)
        for k in PHASES:
            vals = [x[k] for x in ks if isinstance(x.get(k), (int, float))]
            row[f"median_{k}"] = statistics.median(vals) if vals else None
        return row
    finally:
        stop_process(proc)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench coldstart")
    ap.add_argument("--tiny", action="store_true", help="smoke run: toy model on the CPU")
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--kv-gib", type=float, default=4.0)
    ap.add_argument("--prompt-words", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--settle", type=float, default=4.0, help="seconds a stream runs before each kill")
    ap.add_argument("--start-timeout", type=float, default=300.0)
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated: " + ", ".join(MODES))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if set(modes) - set(MODES):
        ap.error(f"unknown mode(s) {sorted(set(modes) - set(MODES))}; choose from {', '.join(MODES)}")
    if args.tiny:
        args.device, args.kills, args.kv_gib, args.prompt_words, args.max_tokens, args.settle = \
            "cpu", 1, 0.05, 10, 1800, 1.0
    name = "coldstart" + ("_tiny" if args.tiny else "")
    sock_dir = tempfile.mkdtemp(prefix="ga-coldstart-")
    os.environ["GPU_ANCHOR_SOCKET_DIR"] = sock_dir
    from bench.models import config
    mc = config(args.shape, tiny=args.tiny)
    mdir = os.path.join(sock_dir, args.shape)
    os.makedirs(mdir)
    with open(os.path.join(mdir, "config.json"), "w") as f:
        json.dump(mc.to_dict(), f, default=str)
    result = {"shape": args.shape + (" (tiny)" if args.tiny else ""), "device": args.device, "kills": args.kills,
              "paper": "PhoenixOS: 622 ms cold start to first token from a host-memory checkpoint",
              "notes": "kill_to_token = SIGKILL of the engine -> next token on the open stream (client side); "
                       "state survives in the anchor daemon in both modes"}
    from gpu_anchor.client import control
    try:
        for key in modes:
            try:
                result[key] = _one_mode(args, mdir, key, sock_dir)
            except Exception as e:
                result[key] = {"error": f"{type(e).__name__}: {e}"}
            write_result(name, result, args.out)
        print(json.dumps({k: {m: v for m, v in result[k].items() if m != "kills"} for k in modes}, indent=1))
        return 0 if all("error" not in result[k] for k in modes) else 1
    finally:
        dev = "cpu" if args.device == "cpu" else args.device
        control.stop(dev, os.path.join(sock_dir, "d.sock"))


def title(r: dict) -> str:
    return f"Serving: engine restart with and without the warm pool ({r.get('shape', '?')}, {r.get('device', '?')})"


def render(r: dict) -> str:
    def s(v):
        return "—" if not isinstance(v, (int, float)) else f"{v * 1e3:.0f} ms"
    lines = [f"{r['shape']} on {r['device']}, {r['kills']} engine SIGKILLs per mode, one stream open. "
             f"{r.get('paper', '')}.", "",
             "| Engine start | Kill → next token: median [min–max] | n | Process start | CUDA init | Bind | "
             "Restore | Engine init | First step |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for key, label in LABELS.items():
        if key not in r:
            continue
        row = r[key]
        if "error" in row:
            lines.append(f"| {label} | failed: {row['error']} | | | | | | | |")
            continue
        gaps = [k["kill_to_token_s"] for k in row.get("kills", []) if k.get("kill_to_token_s") is not None]
        cell = Cell(gaps).text(s, bold=True, show_n=False) if gaps else f"**{s(row.get('median_kill_to_token_s'))}**"
        lines.append(f"| {label} | {cell} | {len(gaps)} | "
                     f"{s(row.get('median_process_start_s'))} | {s(row.get('median_cuda_init_s'))} | "
                     f"{s(row.get('median_bind_s'))} | {s(row.get('median_restore_s'))} | "
                     f"{s(row.get('median_init_s'))} | {s(row.get('median_first_step_s'))} |")
    if r.get("kills", 0) < MIN_N:
        lines.append(f"\nn = {r.get('kills')} per mode: below the protocol's n ≥ {MIN_N}, not a headline.")
    lines.append("\n" + r.get("notes", ""))
    return "\n".join(lines)
