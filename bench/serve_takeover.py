"""``gpu-anchor serve --hot-standby``: kill → next token on every open stream, as clients see it.

    python -m bench serve_takeover                 # H200: Qwen3-8B shape, random bf16, 64 streams, 20 kills
    python -m bench serve_takeover --tiny          # CPU smoke size (not published)

One ``gpu-anchor serve --hot-standby --prewarm`` (its own daemon) of seeded random weights
serves ``--streams`` concurrent SSE streams of ``/v1/completions`` (greedy, ``ignore_eos``).
For each of ``--kills`` rounds: fresh streams start; once every stream has received tokens and
the job record says a hot standby is attached to the running engine, the engine is SIGKILLed.
Measured per kill, from the SIGKILL, for each stream: the chunk that ended its longest stall
around the kill (a chunk the dead engine sent just before dying can still arrive after the
kill; it is not the recovery); **the kill's pause = the last of them** (every open stream has
its next token from the new engine), and their median.  Also the server's own
breakdown of the take-over (``/health``'s ``last_recovery``: how the predecessor was found
quiet — its step fence or its exit — and how long that, the daemon's ``await_gone`` or
``drain``, the take-over and the first step took), whether the supervisor started it before the
engine's exit and what told it the engine was dying (its writer threads' robust mutexes or its
lifeline, a pipe's end of file), and a timeline from the kill by the wall clock.  This is the
user's path: the product's supervisor, frontend and engine; nothing of the benchmark's own launcher.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter

from bench.common import default_device, get_json, write_result


def _resumed(times: list[float], t_kill: float) -> float:
    """Kill → the chunk that ended a stream's longest stall around the kill (chunks the dead
    engine had sent before it died may still arrive after the kill; they are not the recovery)."""
    near = [t for t in times if t_kill - 1.0 <= t]
    stall = max(((b - a, b) for a, b in zip(near, near[1:]) if b > t_kill), default=(0.0, near[0]))
    return stall[1] - t_kill


def _job(namespace: str) -> dict:
    from gpu_anchor.launch import jobstate
    return {j["namespace"]: j for j in jobstate.load_all()}.get(namespace, {})


def _wait(cond, what: str, timeout: float, proc) -> None:
    t0 = time.time()
    while not cond():
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited while waiting for {what}")
        if time.time() - t0 > timeout:
            raise TimeoutError(f"waited {timeout:.0f} s for {what}")
        time.sleep(0.02)


def main(argv=None) -> int:
    from bench.serve_determinism import _prompts, _Stream
    ap = argparse.ArgumentParser(prog="python -m bench serve_takeover", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-8b", help="shape from bench/models.py")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--streams", type=int, default=None, help="default 64 (--tiny: 4)")
    ap.add_argument("--kills", type=int, default=None, help="default 20 (--tiny: 2)")
    ap.add_argument("--prompt-len", type=int, default=None, help="default 128 (--tiny: 8)")
    ap.add_argument("--max-tokens", type=int, default=3000, help="per stream: long enough to outlive a round")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-batched-tokens", type=int, default=8192)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    a.device = "cpu" if a.tiny else default_device(a.device)
    if a.tiny:
        a.dtype = "float32"
    for name, full, tiny in (("streams", 64, 4), ("kills", 20, 2), ("prompt_len", 128, 8)):
        if getattr(a, name) is None:
            setattr(a, name, tiny if a.tiny else full)
    from bench import models
    work = tempfile.mkdtemp(prefix="serve-takeover-")
    config_path = os.path.join(work, "config.json")
    cfg = models.config(a.model, tiny=a.tiny).to_dict()
    vocab = cfg["vocab_size"]
    with open(config_path, "w") as f:
        json.dump(cfg, f)
    t0 = time.time()
    srv = _ServerHot(a, config_path, work)
    print(f"[bench] server up in {time.time() - t0:.1f} s (log {srv.log})", flush=True)
    kills = []
    try:
        ns = "bench-det-hot"          # serve_determinism's namespace for mode "hot"
        pid = srv.wait_serving()
        for k in range(a.kills):
            bodies = [{"prompt": p, "max_tokens": a.max_tokens, "stream": True, "ignore_eos": True,
                       "temperature": 0.0, "logprobs": 0, "return_tokens_as_token_ids": True} for p in _prompts(a.streams, a.prompt_len, vocab)]
            streams = [_Stream(srv.base, b) for b in bodies]
            _wait(lambda: all(len(s.ids) >= 8 or s.error for s in streams), "every stream's first tokens", 600, srv.proc)
            print(f"[bench] round {k}: {len(streams)} streams at >= 8 tokens ({time.time() - t0:.1f} s)", flush=True)

            def attached():
                sb = (_job(ns).get("standbys") or {}).get("0") or {}
                return bool(sb.get("hot")) and sb.get("pid") != pid
            _wait(attached, "a hot standby attached", 600, srv.proc)
            print(f"[bench] round {k}: hot standby attached ({time.time() - t0:.1f} s)", flush=True)
            # what the standby holds of the device (its own report: NVML for its process, its allocator)
            standby = {key: ((_job(ns).get("standbys") or {}).get("0") or {}).get(key)
                       for key in ("device_bytes", "allocator_bytes", "allocator_peak_bytes", "attach_s")}
            time.sleep(0.3)          # mid-stream, past the attach's own work
            t_kill = time.time()
            os.kill(pid, signal.SIGKILL)
            _wait(lambda: all(s.error or s.finish or (s.times and s.times[-1] > t_kill) for s in streams),
                  "every stream's next token", 600, srv.proc)
            time.sleep(0.5)          # chunks keep coming: the stall's end is in the record
            gaps = [_resumed(s.times, t_kill) for s in streams if not (s.error or s.finish)]
            errors = [s.error for s in streams if s.error]
            new = srv.wait_serving(not_pid=pid)
            rec = get_json(srv.base + "/health").get("last_recovery", {})
            restarts = _job(ns).get("restarts") or []
            row = {"kill": k, "pause_s": max(gaps) if gaps else None, "median_gap_s": statistics.median(gaps)
                   if gaps else None, "streams": len(gaps), "errors": errors, "engine": new,
                   "early": bool(restarts and restarts[-1].get("early")),
                   # what started the early take-over: the writer threads' robust mutexes or the lifeline
                   "detected_by": restarts[-1].get("detected_by") if restarts else None,
                   "server": {key: rec.get(key) for key in ("quiesced_by", "quiesce_s", "await_gone_s", "hot_standby",
                                                            "take_over_s", "first_step_s", "down_s")},
                   "server_all": rec,
                   # from the kill, by the wall clock: the supervisor saw the engine dying (its writers
                   # gone or its lifeline's end: ``detected_by``; results before it was built: "lifeline"), the frontend
                   # lost the engine, got the new one's hello, and its first token to any open stream
                   "timeline_ms": {k: round((t - t_kill) * 1e3, 2) for k, t in (
                       ("detected", (restarts[-1] if restarts else {}).get("t_detect")), ("lost", rec.get("lost_at")),
                       ("hello", rec.get("hello_at")), ("first_token", rec.get("first_token_at"))) if t},
                   "resyncs": rec.get("resyncs"), "standby": standby}
            kills.append(row)
            if row["pause_s"] is None:
                raise RuntimeError(f"no stream got a token after the kill: {row}")
            print(f"[bench] kill {k}: pause {row['pause_s'] * 1e3:.1f} ms (median stream {row['median_gap_s'] * 1e3:.1f}"
                  f" ms), {'early, by ' + str(row['detected_by']) if row['early'] else 'at the exit'}, timeline {row['timeline_ms']}, "
                  f"{row['resyncs']} resyncs, {row['server']}", flush=True)
            write_result("serve_takeover" + ("_tiny" if a.tiny else ""), _result(a, kills, argv), a.out)
            for s in streams:
                s.abort()
            for s in streams:
                s.join(60)
            pid = new
    finally:
        srv.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(write_result("serve_takeover" + ("_tiny" if a.tiny else ""), _result(a, kills, argv), a.out))
    return 0


def _result(a, kills: list[dict], argv) -> dict:
    pauses = [r["pause_s"] for r in kills if r["pause_s"] is not None]
    return {"benchmark": "serve_takeover", "device": a.device, "config": a.model + (" (tiny)" if a.tiny else ""), "streams": a.streams,
              "kills": kills, "summary": {"pause_s": {"median": statistics.median(pauses), "min": min(pauses),
                                                      "max": max(pauses), "n": len(pauses)},
                                          "early": sum(r["early"] for r in kills),
                                          "stream_errors": sum(len(r["errors"]) for r in kills)},
              "complete": len(kills) == a.kills,
              "command": "python -m bench serve_takeover " + " ".join(argv if argv is not None else sys.argv[1:])}


def _ServerHot(a, config_path: str, work: str):
    """``serve_determinism``'s server (same flags, own daemon) with ``--hot-standby --prewarm``."""
    from bench import serve_determinism as sd
    sd.MODES.setdefault("hot", ["--hot-standby", "--prewarm"])
    return sd._Server(a, config_path, "hot", work)


def title(result: dict) -> str:
    return f"Serving: hot take-over, kill → next token on every stream ({result['device']})"


def render(result: dict) -> str:
    s = result["summary"]
    lines = [f"{result['config']} shape, {result['streams']} concurrent SSE streams, `gpu-anchor serve --hot-standby "
             f"--prewarm`; the engine SIGKILLed {len(result['kills'])} times (each once a hot standby was attached).", "",
             "| | median | min | max | n |", "| --- | ---: | ---: | ---: | ---: |",
             f"| kill → next token on every open stream | {s['pause_s']['median'] * 1e3:.1f} ms | "
             f"{s['pause_s']['min'] * 1e3:.1f} ms | {s['pause_s']['max'] * 1e3:.1f} ms | {s['pause_s']['n']} |", "",
             f"Take-overs started before the engine's exit: {s['early']} of {len(result['kills'])}"
             + "".join(f"; by {how}: {n}" for how, n in sorted(Counter(
                 k.get("detected_by") or "lifeline" for k in result["kills"] if k.get("early")).items()))
             + f"; stream errors: {s['stream_errors']}."]
    marks = [("detected", "the supervisor sees the engine dying"), ("lifeline", "the engine's lifeline ends"),
             ("hello", "the new engine's hello at the frontend"), ("first_token", "its first token at the frontend")]
    rows = []
    for key, what in marks:
        xs = [k["timeline_ms"][key] for k in result["kills"] if key in k.get("timeline_ms", {})]
        if xs:
            rows.append(f"| {what} | {statistics.median(xs):.1f} ms | {min(xs):.1f} ms | {max(xs):.1f} ms | {len(xs)} |")
    if rows:
        lines += ["", "Timeline from the kill (wall clock):", "", "| event | median | min | max | n |",
                  "| --- | ---: | ---: | ---: | ---: |"] + rows
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
