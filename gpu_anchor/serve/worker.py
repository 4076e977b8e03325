"""The engine process: build (or rebind) the engine, connect to the frontend, serve.

Runs in a child forked by the supervisor (``gpu-anchor serve``), which restarts it when it
dies.  On connect it says which requests it restored (``hello``) and replays their
committed tokens from index 0; the frontend drops what it already has and re-sends every
request the engine does not know, with the tokens its client already received.
"""
from __future__ import annotations

import logging
import os
import select
import socket
import time

from . import wire
from .engine import Engine, EngineConfig
from .sequence import SamplingParams

log = logging.getLogger("gpu_anchor.serve")


def _connect(path: str, timeout: float = 120.0) -> socket.socket:
    deadline = time.monotonic() + timeout
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(path)
            return s
        except OSError:
            s.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def run(cfg: EngineConfig, frontend_socket: str, started_at: float | None = None) -> None:
    """Serve until the frontend goes away.  ``started_at``: wall time the supervisor
    decided to start this engine (for the recovery breakdown)."""
    t0 = time.time()
    eng = Engine(cfg)
    timings = dict(eng.timings)
    if started_at is not None:
        timings["process_start_s"] = t0 - started_at
    sock = _connect(frontend_socket)
    sock.sendall(wire.encode({"t": "hello", "pid": os.getpid(), "rids": [s.rid for s in eng.restored],
                              "timings": timings, "notes": eng.recovery_notes,
                              "weights_loaded": eng.weights_loaded}))
    if eng.restored:
        sock.sendall(wire.encode({"t": "toks", "ev": [[s.rid, 0, s.output_ids, None] for s in eng.restored]}))
    dec = wire.Decoder()
    first_step = True
    while True:
        timeout = 0.0 if eng.has_work() else 0.5
        r, _, _ = select.select([sock], [], [], timeout)
        if r:
            data = sock.recv(1 << 20)
            if not data:
                log.info("frontend closed the connection; engine exits")
                return
            out = []
            for msg in dec.feed(data):
                if msg["t"] == "add":
                    try:
                        ev = eng.add_request(msg["rid"], msg["prompt"], SamplingParams.from_dict(msg["params"]),
                                             msg.get("out", ()))
                        out += [list(e) for e in ev]
                    except ValueError as e:
                        sock.sendall(wire.encode({"t": "err", "rid": msg["rid"], "msg": str(e)}))
                elif msg["t"] == "readd":
                    out += [list(e) for e in eng.readd(msg["rid"], msg["prompt"],
                                                       SamplingParams.from_dict(msg["params"]), msg["out"])]
                    if out:
                        sock.sendall(wire.encode({"t": "toks", "ev": out}))
                        out = []
                    sock.sendall(wire.encode({"t": "readd_ok", "rid": msg["rid"]}))
                elif msg["t"] == "abort":
                    eng.abort(msg["rid"])
            if out:
                sock.sendall(wire.encode({"t": "toks", "ev": out}))
        if eng.has_work():
            ts = time.perf_counter()
            events = eng.step()
            if events:
                sock.sendall(wire.encode({"t": "toks", "ev": [list(e) for e in events]}))
            if first_step:
                first_step = False
                sock.sendall(wire.encode({"t": "stats", "first_step_s": time.perf_counter() - ts,
                                          "ready_s": time.time() - t0}))
