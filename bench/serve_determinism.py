"""``gpu-anchor serve --deterministic``: token-identical streams across faults, and what it costs.

    python -m bench serve_determinism                  # H200: Qwen3-8B shape, random bf16, 32 streams x 200 tokens
    python -m bench serve_determinism --tiny           # CPU smoke size (not published)

For each mode — the default kernels (cuBLAS, torch's norms) and ``--deterministic``
(``gpu_anchor/serve/batch_invariant.py``) — one ``gpu-anchor serve`` of the seeded random
weights (its own daemon) serves ``--streams`` concurrent SSE streams of ``/v1/completions``
(prompts of ``--prompt-len`` random token ids, ``--max-tokens`` tokens each, ``ignore_eos``;
even streams greedy, odd ones seeded sampling at temperature 0.8, top-p 0.9; token ids and
log-probabilities read from the stream):

1. a warm-up run (kernels compiled, graphs captured), which is also the reference;
2. ``--rounds`` fault-free runs, timed: tokens/s = completion tokens / (first request sent →
   last stream finished); each stream compared with the reference;
3. a run where the engine is SIGKILLed ``--engine-kills`` times (once every stream has a share
   of its tokens; the server restarts it in place);
4. a run where the daemon is SIGKILLed once (the anchored state lost: a fresh daemon, weights
   made again, every open request's K/V recomputed by one prefill of prompt + delivered tokens).

A stream counts as identical when its token ids equal the reference's (and its
log-probabilities are reported as the largest difference).  Then transformers'
``generate_batch`` (continuous batching, greedy; ``bench/serve_throughput.py``'s) on the same
prompt ids and token counts, in a child process after the servers stopped, as the
library baseline (``--no-transformers`` skips it).
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from bench.common import default_device, get_json, run_isolated, stop_process, write_result
from bench.protocol import Cell, Interval, throughput_section

INTERVAL = Interval("the first request sent", "the last stream finished")
# each kill starts a fresh engine (--no-hot-standby; the hot standby is bench serve_takeover's)
MODES = {"default": ["--no-hot-standby", "--no-prewarm"], "deterministic": ["--deterministic", "--no-hot-standby", "--no-prewarm"]}


def _prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    from bench.serve_throughput import _prompts as same_as_throughput   # the same ids as that benchmark's
    return same_as_throughput(n, length, vocab)


class _Stream(threading.Thread):
    """One SSE stream of /v1/completions over plain http.client (the openai package may be
    absent on the GPU host): token ids (``return_tokens_as_token_ids``) and their log-probabilities."""

    def __init__(self, base: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.host, self.port = base.rsplit("/", 1)[1].split(":")
        self.body, self.ids, self.lps, self.finish, self.error, self.done_at = body, [], [], None, None, None
        self.times: list[float] = []      # arrival of each chunk that carried tokens
        self.conn = None
        self.start()

    def abort(self) -> None:
        """Close the connection: the server aborts the request."""
        conn = self.conn
        if conn is not None and conn.sock is not None:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def run(self) -> None:
        try:
            self.conn = conn = http.client.HTTPConnection(self.host, int(self.port), timeout=1800)
            conn.request("POST", "/v1/completions", json.dumps(self.body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            for line in resp:
                if not line.startswith(b"data: {"):
                    continue
                ev = json.loads(line[6:])
                if "error" in ev:
                    self.error = ev["error"]
                    break
                for ch in ev.get("choices", ()):
                    lp = ch.get("logprobs") or {}
                    if lp.get("tokens"):
                        self.times.append(time.time())
                    self.ids += [int(t.split(":")[1]) for t in lp.get("tokens", ())]
                    self.lps += lp.get("token_logprobs", [])
                    self.finish = ch.get("finish_reason") or self.finish
            conn.close()
        except Exception as e:  # noqa: BLE001 - reported in the result
            self.error = repr(e)
        self.done_at = time.time()


class _Server:
    def __init__(self, a, config_path: str, mode: str, work: str) -> None:
        self.a, self.work, self.mode = a, work, mode
        self.sock = os.path.join(work, f"{mode}.sock")
        port_file = os.path.join(work, f"{mode}.port")
        per_seq = -(-(a.prompt_len + a.max_tokens + 1) // a.block_size)
        cmd = [sys.executable, "-m", "gpu_anchor.serve", config_path, "--random-weights", "--device", a.device,
               "--dtype", a.dtype, "--block-size", str(a.block_size), "--num-blocks", str(per_seq * a.streams + 16),
               "--max-num-seqs", str(a.streams), "--max-num-batched-tokens", str(a.max_batched_tokens),
               "--max-model-len", str(a.prompt_len + a.max_tokens + 16), "--socket", self.sock,
               "--namespace", f"bench-det-{mode}", "--port", "0", "--port-file", port_file, *MODES[mode]]
        if a.device == "cpu":
            cmd += ["--cpu-threads", "1"]
        self.log = os.path.join(work, f"{mode}.log")
        t0 = time.time()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(self.log, "ab"),
                                     env=dict(os.environ, PYTHONPATH=os.getcwd()))
        while not os.path.exists(port_file) or not open(port_file).read():
            self._alive(t0)
        self.base = f"http://127.0.0.1:{open(port_file).read()}"
        self.wait_serving(t0)
        self.start_s = time.time() - t0

    def _alive(self, t0: float) -> None:
        if self.proc.poll() is not None or time.time() - t0 > 900:
            raise RuntimeError(f"{self.mode} server is not up: " + open(self.log).read()[-3000:])
        time.sleep(0.1)

    def wait_serving(self, t0: float | None = None, not_pid: int | None = None) -> int:
        t0 = t0 or time.time()
        while True:
            h = get_json(self.base + "/health")
            if h.get("status") == "ok" and h.get("engine_pid") not in (None, not_pid):
                return h["engine_pid"]
            self._alive(t0)

    def daemon_pid(self) -> int | None:
        from gpu_anchor.client import control
        hello = control.ping(self.a.device, self.sock)
        return hello and hello["pid"]

    def stop(self) -> None:
        stop_process(self.proc)


def _bodies(a, vocab: int) -> list[dict]:
    out = []
    for i, p in enumerate(_prompts(a.streams, a.prompt_len, vocab)):
        b = {"prompt": p, "max_tokens": a.max_tokens, "stream": True, "ignore_eos": True, "logprobs": 0,
             "return_tokens_as_token_ids": True}
        b.update({"temperature": 0.8, "top_p": 0.9, "seed": 1000 + i} if i % 2 else {"temperature": 0.0})
        out.append(b)
    return out


def _run(srv: _Server, bodies: list[dict], kill=None) -> dict:
    """Every stream at once; ``kill(streams)``, if given, runs while they stream."""
    t0 = time.time()
    streams = [_Stream(srv.base, b) for b in bodies]
    kill_times = kill(streams) if kill is not None else []
    for s in streams:
        s.join(1800)
    errors = [s.error for s in streams if s.error]
    tokens = sum(len(s.ids) for s in streams)
    wall = max(s.done_at for s in streams) - t0
    return {"ids": [s.ids for s in streams], "lps": [s.lps for s in streams], "errors": errors[:3],
            "tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall,
            "pauses": [_pause(streams, t, u) for t, u in zip(kill_times, kill_times[1:] + [float("inf")])]}


def _pause(streams, t_kill: float, until: float = float("inf")) -> dict:
    """The pause a kill caused, per stream open at the kill, as its client saw it: the longest
    wait for a token from the kill until the next kill (a daemon kill may stop the streams only
    when the engine next needs the daemon, not at once).  Seconds."""
    gaps = []
    for s in streams:
        times = [t for t in s.times if t_kill < t < until]
        if s.times and s.times[-1] > t_kill and times:
            gaps.append(max(b - a for a, b in zip([t_kill] + times, times)))
    gaps.sort()
    if not gaps:
        return {"streams": 0}
    return {"streams": len(gaps), "median_s": statistics.median(gaps), "max_s": gaps[-1]}


def _at_progress(streams, share: float) -> None:
    """Wait until every open stream has ``share`` of its tokens."""
    need = [max(1, int(share * s.body["max_tokens"])) for s in streams]
    while any(len(s.ids) < n and s.finish is None and s.error is None for s, n in zip(streams, need)):
        time.sleep(0.005)


def _engine_kills(srv: _Server, n: int):
    def kill(streams):
        pid, times = srv.wait_serving(), []
        for k in range(n):
            _at_progress(streams, (k + 1) / (n + 1))
            times.append(time.time())
            os.kill(pid, signal.SIGKILL)
            pid = srv.wait_serving(not_pid=pid)
        return times
    return kill


def _daemon_kill(srv: _Server):
    def kill(streams):
        _at_progress(streams, 0.5)
        dead = srv.daemon_pid()
        t = time.time()
        os.kill(dead, signal.SIGKILL)
        deadline = time.time() + 600
        while srv.daemon_pid() in (None, dead) and time.time() < deadline:
            time.sleep(0.05)
        return [t]
    return kill


def _compare(ref: dict, run: dict) -> dict:
    same = [a == b for a, b in zip(ref["ids"], run["ids"])]
    lp = [max((abs(x - y) for x, y in zip(a, b)), default=0.0) for a, b in zip(ref["lps"], run["lps"])]
    firsts = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
              for a, b in zip(ref["ids"], run["ids"])]
    return {"identical": sum(same), "of": len(same),
            "identical_greedy": sum(s for i, s in enumerate(same) if i % 2 == 0),
            "identical_sampled": sum(s for i, s in enumerate(same) if i % 2),
            "first_difference_median": statistics.median([f for f, s in zip(firsts, same) if not s] or [0]),
            "max_logprob_diff_identical": max([d for d, s in zip(lp, same) if s] or [0.0]),
            "errors": run["errors"], "tokens": run["tokens"]}


def run_mode(a, config_path: str, mode: str, work: str) -> dict:
    vocab = json.load(open(config_path))["vocab_size"]
    bodies = _bodies(a, vocab)
    srv = _Server(a, config_path, mode, work)
    try:
        print(f"[bench] {mode}: server up in {srv.start_s:.1f} s", flush=True)
        ref = _run(srv, bodies)
        out = {"server_start_s": srv.start_s, "warmup_tokens_per_s": ref["tokens_per_s"], "fault_free": []}
        for r in range(a.rounds):
            run = _run(srv, bodies)
            out["fault_free"].append(dict(_compare(ref, run), seconds=run["seconds"],
                                          tokens_per_s=run["tokens_per_s"]))
            print(f"[bench] {mode} fault-free {r}: {run['tokens_per_s']:.0f} tok/s, "
                  f"{out['fault_free'][-1]['identical']}/{len(bodies)} identical", flush=True)
        run = _run(srv, bodies, _engine_kills(srv, a.engine_kills))
        out["engine_kills"] = dict(_compare(ref, run), kills=a.engine_kills, seconds=run["seconds"],
                                   pauses=run["pauses"])
        print(f"[bench] {mode} {a.engine_kills} engine kills: {out['engine_kills']['identical']}/{len(bodies)} "
              "identical", flush=True)
        if a.daemon_kill:
            run = _run(srv, bodies, _daemon_kill(srv))
            out["daemon_kill"] = dict(_compare(ref, run), seconds=run["seconds"], pauses=run["pauses"])
            print(f"[bench] {mode} daemon kill: {out['daemon_kill']['identical']}/{len(bodies)} identical",
                  flush=True)
        out["health"] = {k: v for k, v in get_json(srv.base + "/health").items()
                         if k in ("token_mismatches", "engine_restarts", "last_state_loss", "last_recovery")}
        tps = [r["tokens_per_s"] for r in out["fault_free"]]
        out["tokens_per_s"] = {"median": statistics.median(tps), "min": min(tps), "max": max(tps), "n": len(tps),
                               "samples": tps}
        return out
    finally:
        srv.stop()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="2-layer toy model on the CPU, few short streams (smoke run)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--model", default="qwen3-8b", help="shape from bench/models.py")
    ap.add_argument("--streams", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-batched-tokens", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3, help="timed fault-free runs per mode (n)")
    ap.add_argument("--engine-kills", type=int, default=2)
    ap.add_argument("--no-daemon-kill", dest="daemon_kill", action="store_false")
    ap.add_argument("--modes", default="default,deterministic", help="comma-separated; empty: transformers only")
    ap.add_argument("--no-transformers", dest="transformers", action="store_false")
    ap.add_argument("--out", default=None, help="results directory (default bench/results)")
    ap.add_argument("--name", default=None,
                    help="result name (default serve_determinism, serve_determinism_tiny with --tiny)")
    a = ap.parse_args(argv)
    a.device = "cpu" if a.tiny and a.device is None else default_device(a.device)
    a.dtype = a.dtype or ("bfloat16" if a.device.startswith("cuda") else "float32")
    a.streams = a.streams or (6 if a.tiny else 32)
    a.prompt_len = a.prompt_len or (12 if a.tiny else 128)
    a.max_tokens = a.max_tokens or (24 if a.tiny else 200)
    from bench import models
    work = tempfile.mkdtemp(prefix="bench-det-")
    config_path = os.path.join(work, "config.json")
    cfg = models.config(a.model, tiny=a.tiny).to_dict()
    with open(config_path, "w") as f:
        json.dump(cfg, f)
    result = {"model": a.model + (" (tiny)" if a.tiny else ""), "device": a.device, "dtype": a.dtype,
              "streams": a.streams, "prompt_len": a.prompt_len, "max_tokens": a.max_tokens, "modes": {},
              "interval": INTERVAL.text}
    t0 = time.time()
    name = a.name or "serve_determinism" + ("_tiny" if a.tiny else "")
    try:
        for mode in [m for m in a.modes.split(",") if m]:
            result["modes"][mode] = run_mode(a, config_path, mode, work)
            result["wall_s"] = time.time() - t0
            write_result(name, dict(result, complete=False), a.out)    # kept if a timeout stops the rest
        if a.transformers:
            from bench.serve_throughput import hf_generate_batch
            hf_args = argparse.Namespace(requests=a.streams, prompt_len=a.prompt_len, max_tokens=a.max_tokens,
                                         device=a.device, dtype=a.dtype, rounds=a.rounds)
            try:
                result["transformers"] = run_isolated(hf_generate_batch, hf_args, config_path, timeout=600)
            except Exception as e:  # noqa: BLE001 - a missing baseline is said in the result, not hidden
                result["transformers"] = {"error": repr(e)[:500]}
    finally:
        result["wall_s"] = time.time() - t0
        shutil.rmtree(work, ignore_errors=True)
    result["complete"] = True
    print(json.dumps({m: {k: r[k] for k in ("tokens_per_s", "engine_kills")} for m, r in result["modes"].items()},
                     indent=1, default=str))
    print("[bench] wrote", write_result(name, result, a.out))
    return 0


def title(result: dict) -> str:
    where = "CPU" if result["device"] == "cpu" else "GPU"
    name = result.get("benchmark", "")
    what = "the pause of each kill" + (", --hot-standby --prewarm" if name.endswith("_hot_kills") else "") \
        if name.endswith("_kills") else "its cost"
    return f"Serving with --deterministic: identical streams across faults, and {what} ({where}, {result['model']})"


def _ident(r: dict | None) -> str:
    return "—" if not r else f"{r['identical']}/{r['of']} ({r['identical_greedy']} greedy, {r['identical_sampled']} sampled)"


def render(result: dict) -> str:
    modes = result["modes"]
    lines = [f"{result['model']}, {result['dtype']}, {result['streams']} concurrent SSE streams × "
             f"{result['max_tokens']} tokens (prompts of {result['prompt_len']} ids; half greedy, half seeded "
             "sampling). Streams identical to the mode's own warm-up run, token for token:", "",
             *([result["note"], ""] if result.get("note") else []),
             *(["On the CPU the default mode's rounding differences (float32) seldom flip a token; a GPU run in "
                "bf16 is the one that tells the modes apart.", ""] if result["device"] == "cpu" else []),
             "| mode | fault-free repeats (worst of n) | after engine SIGKILLs | after a daemon SIGKILL (K/V recomputed) |",
             "| --- | --- | --- | --- |"]
    for m, r in modes.items():
        worst = min(r["fault_free"], key=lambda x: x["identical"]) if r.get("fault_free") else None
        ek = r.get("engine_kills")
        kills = f" ({ek['kills']} kills)" if ek else ""
        lines.append(f"| {m} | {_ident(worst)} | {_ident(ek)}{kills} | {_ident(r.get('daemon_kill'))} |")
    pause_rows = [(m, kind, p) for m, r in modes.items() for kind in ("engine_kills", "daemon_kill")
                  for p in (r.get(kind) or {}).get("pauses", ()) if p.get("streams")]
    if pause_rows:
        lines += ["", "The pause a kill caused: the longest wait for a token of each stream open at the kill, from the "
                  "kill to the next one, as its client saw it (a daemon kill: a "
                  "fresh daemon, the weights made again from the seed (`--random-weights`), not read from disk, "
                  "every open context recomputed):", "",
                  "| mode | fault | streams | median over streams | slowest stream |", "| --- | --- | ---: | ---: | ---: |"]
        lines += [f"| {m} | {'engine SIGKILL' if kind == 'engine_kills' else 'daemon SIGKILL'} | {p['streams']} | "
                  f"{p['median_s'] * 1e3:.0f} ms | {p['max_s'] * 1e3:.0f} ms |" for m, kind, p in pause_rows]
    rows = [(f"gpu-anchor serve ({m})", Cell(r["tokens_per_s"]["samples"])) for m, r in modes.items()]
    hf = result.get("transformers") or {}
    if hf.get("runs"):
        rows.append(("transformers generate_batch (greedy)", Cell([x["tokens_per_s"] for x in hf["runs"]])))
    lines += throughput_section(rows, f"Fault-free throughput ({INTERVAL.text}):", "tokens/s")
    if "default" in modes and "deterministic" in modes:
        det, dflt = Cell(modes["deterministic"]["tokens_per_s"]["samples"]), Cell(modes["default"]["tokens_per_s"]["samples"])
        lines += ["", f"--deterministic runs at {det.median / dflt.median:.2f}× the default mode's tokens/s (medians)" +
                  (f" and {det.median / statistics.median([x['tokens_per_s'] for x in hf['runs']]):.2f}× "
                   "transformers generate_batch's" if hf.get("runs") else "") + "."]
    if hf.get("error"):
        lines += ["", f"transformers baseline: {hf['error']}"]
    if not result.get("complete", True):
        lines += ["", "Incomplete run: it stopped (a timeout) after the modes above; the rest was not measured."]
    return "\n".join(lines)
