"""The engine process: build (or rebind) the engine, connect to the frontend, serve.

Runs in a child forked by the supervisor (``gpu-anchor serve``), which restarts it when it
dies.  It connects first and reports its start-up as it goes (``loading``: phase, bytes
done; the frontend's ``/health`` shows it and this process logs it); once built it says
which requests it restored (``hello``) and replays their committed tokens from index 0;
the frontend drops what it already has and re-sends every request the engine does not
know, with the tokens its client already received.  While serving it sends the
scheduler's ``load`` (running, waiting, KV blocks in use) for the frontend's metrics.
In a tensor-parallel group this is rank 0; the other ranks run ``tp.serve_rank`` and talk
only to rank 0.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import time

from gpu_anchor import fdwait

from . import lora, wire
from .engine import Engine, EngineConfig
from .sequence import SamplingParams
from .state import NotAttachable

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


class _Progress:
    """The engine's start-up, reported to the frontend (at most every 0.5 s, and at each new
    phase) and logged (at most every 5 s, and at each new phase)."""

    def __init__(self, sock: socket.socket, t0: float) -> None:
        self.sock, self.t0 = sock, t0
        self.phase, self.sent, self.logged = None, 0.0, 0.0

    def __call__(self, phase: str, done=None, total=None) -> None:
        now = time.time()
        new = phase != self.phase
        self.phase = phase
        msg = {"t": "loading", "pid": os.getpid(), "phase": phase, "done": done, "total": total,
               "elapsed_s": round(now - self.t0, 3)}
        if new or now - self.sent >= 0.5:
            self.sent = now
            self.sock.sendall(wire.encode(msg))
        if new or now - self.logged >= 5.0:
            self.logged = now
            log.info("engine %d loading: %s", os.getpid(), wire.describe_loading(msg))


def _toks(eng, events) -> bytes:
    """A ``toks`` message, with the log-probabilities of its tokens for requests that asked."""
    msg = {"t": "toks", "ev": [list(e) for e in events]}
    lp, plp, cached = eng.take_logprobs(events), eng.take_prompt_logprobs(events), eng.take_cached_tokens(events)
    if lp:
        msg["lp"] = lp
    if plp:
        msg["plp"] = plp
    if cached:
        msg["cached"] = cached
    return wire.encode(msg)


def _lora_change(eng, msg) -> dict:
    """Load or unload a LoRA adapter (``lora_runtime``); the answer names what failed."""
    try:
        if msg["t"] == "lora_load":
            eng.load_lora_adapter(msg["name"], msg["path"], msg.get("inplace", False))
        else:
            eng.unload_lora_adapter(msg["name"])
        error = None
    except Exception as e:      # noqa: BLE001 — a bad adapter file must not take the engine down
        log.warning("%s %r refused: %s", msg["t"], msg["name"], e)
        error = lora.describe_failure(msg["name"], e)
    return {"t": "lora_done", "id": msg.get("id"), "name": msg["name"], "error": error}


def placement_path(frontend_socket: str) -> str:
    """Where a migrated engine records its device and daemon for the supervisor's next fork."""
    return os.path.join(os.path.dirname(frontend_socket), "placement.json")


def _write_placement(path: str, placement: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(placement, f)
    os.replace(tmp, path)


class _Migrating:
    """One ``migrate`` request's progress inside the serve loop (see ``serve.migration``)."""

    def __init__(self, eng, msg: dict) -> None:
        from gpu_anchor.serve.migration import EngineMigration
        self.mid = msg.get("mid")
        self.mig = EngineMigration(eng, msg["device"], msg.get("socket"))
        self.mig.start()
        self.cut_at = None           # perf_counter of the cut-over's start
        self.last_old = None         # perf_counter of the old engine's last token batch
        self.reported = False


LINGER_ENV = "GPU_ANCHOR_TEST_LINGER_S"


def _arm_linger() -> None:
    """Tests: with ``GPU_ANCHOR_TEST_LINGER_S`` set, SIGUSR2 makes this engine die the way a
    SIGKILLed CUDA process does, slowly: every descriptor closed at once (its lifeline, sockets,
    daemon connections), then nothing for that many seconds, then the kill — the window a CUDA
    context's teardown leaves between the end of a process's descriptors and its exit."""
    linger = os.environ.get(LINGER_ENV)
    if not linger:
        return
    import resource
    import signal

    def die_slowly(signum, frame):
        os.closerange(3, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        time.sleep(float(linger))
        os.kill(os.getpid(), signal.SIGKILL)
    signal.signal(signal.SIGUSR2, die_slowly)


def _await_predecessor(cfg: EngineConfig, fence, predecessor: int | None, writers_gone: bool = False) -> dict:
    """Wait until the engine this one replaces can change nothing any more; returns timings.
    ``writers_gone``: its writer threads are known dead (``runtime.liveness``): the daemon
    handles what it sent now (``drain``) instead of once its connections closed (``await_gone``)."""
    if predecessor is None:
        return {}
    t = time.perf_counter()
    from .step_fence import StepFence
    how = (fence or StepFence()).quiesce(predecessor)    # a page of its own says nothing: waits for the exit
    t1 = time.perf_counter()
    out = {"quiesce_s": t1 - t, "quiesced_by": how}
    if cfg.anchor:
        from gpu_anchor.client import control
        if writers_gone:
            out["torn_bytes"] = control.drain(cfg.device, cfg.socket, predecessor)
            out["drain_s"] = time.perf_counter() - t1
        else:
            control.await_gone(cfg.device, cfg.socket, predecessor)
            out["await_gone_s"] = time.perf_counter() - t1
    return out


def run(cfg: EngineConfig, frontend_socket: str, started_at: float | None = None, standby: bool = False,
        on_progress=None, engine: Engine | None = None, fence=None, predecessor: int | None = None,
        writers_gone: bool = False) -> None:
    """Serve until the frontend goes away.  ``started_at``: wall time the supervisor
    decided to start this engine (for the recovery breakdown); ``standby``: this process
    is a warm standby taking over (``runtime.Standby``); ``on_progress(what)``, if given,
    hears ``"ready"`` once the engine is built and ``"tokens"`` once it published new tokens
    (the supervisor tells a crash at start-up from a failure after progress); ``engine``: a
    hot standby's attached engine (``Engine(standby=True)``), which takes over here — or, if
    the state changed under it since it attached, is dropped for an engine built anew.
    ``fence``: the server's ``step_fence.StepFence``; ``predecessor``: the pid of the engine this
    one replaces, which may still be exiting (a take-over started at its lifeline's end): the
    new engine reads nothing of the state before that engine's last step is off the device
    (``StepFence.quiesce``) and the daemon has handled all it sent (``await_gone``, or ``drain``
    when ``writers_gone``: the supervisor saw its writer threads' robust mutexes released)."""
    progress = on_progress or (lambda what: None)
    t0 = time.time()
    _arm_linger()
    quiet = _await_predecessor(cfg, fence, predecessor, writers_gone)
    sock = _connect(frontend_socket)
    eng, hot = None, 0
    if engine is not None:
        try:
            engine.take_over(_Progress(sock, t0), fence=fence)
            eng, hot = engine, 1
        except NotAttachable as e:
            log.warning("the hot standby's engine cannot take over (%s): building the engine anew", e)
            engine = None
    if eng is None:
        eng = Engine(cfg, progress=_Progress(sock, t0), fence=fence)
    timings = dict(eng.timings, warm_standby=int(standby), hot_standby=hot,
                   tensor_parallel_size=cfg.tensor_parallel_size, **quiet)
    if started_at is not None:
        timings["process_start_s"] = t0 - started_at
        timings["decided_at"] = started_at      # wall clock: the frontend dates a loss it has not seen yet
    sock.sendall(wire.encode({"t": "hello", "pid": os.getpid(), "rids": [s.rid for s in eng.restored],
                              "timings": timings, "notes": eng.recovery_notes,
                              "weights_loaded": eng.weights_loaded}))
    if eng.restored:
        sock.sendall(wire.encode({"t": "toks", "ev": [[s.rid, 0, s.output_ids, None] for s in eng.restored]}))
    progress("ready")
    published = False
    dec = wire.Decoder()
    first_step = True
    mg: _Migrating | None = None
    last_sent = None
    load_sent, last_load = 0.0, None
    while True:
        timeout = 0.0 if eng.has_work() else (0.01 if mg is not None else 0.5)
        r = fdwait.readable([sock], timeout)
        if r:
            data = sock.recv(1 << 20)
            if not data:
                log.info("frontend closed the connection; engine exits")
                eng.close()
                return
            out = []
            for msg in dec.feed(data):
                if msg["t"] == "add":
                    try:
                        out += eng.add_request(msg["rid"], msg["prompt"], SamplingParams.from_dict(msg["params"]),
                                               msg.get("out", ()))
                    except ValueError as e:
                        sock.sendall(wire.encode({"t": "err", "rid": msg["rid"], "msg": str(e)}))
                elif msg["t"] == "readd":
                    out += eng.readd(msg["rid"], msg["prompt"], SamplingParams.from_dict(msg["params"]), msg["out"],
                                     msg.get("from_start", False))
                    if out:
                        sock.sendall(_toks(eng, out))
                        out = []
                    sock.sendall(wire.encode({"t": "readd_ok", "rid": msg["rid"]}))
                elif msg["t"] == "abort":
                    eng.abort(msg["rid"])
                elif msg["t"] in ("lora_load", "lora_unload"):
                    sock.sendall(wire.encode(_lora_change(eng, msg)))
                elif msg["t"] == "lora_sync":
                    for name, error in eng.sync_lora_adapters(msg["adapters"]):
                        sock.sendall(wire.encode({"t": "lora_done", "id": None, "name": name, "error": error}))
                elif msg["t"] == "migrate":
                    try:
                        if mg is not None:
                            raise ValueError("a migration is already in progress")
                        mg = _Migrating(eng, msg)
                    except Exception as e:
                        log.exception("migration refused")
                        sock.sendall(wire.encode({"t": "migrated", "mid": msg.get("mid"), "error": str(e)}))
            if out:
                sock.sendall(_toks(eng, out))
        if mg is not None and mg.cut_at is None and mg.mig.ready():
            mg.cut_at, mg.last_old = time.perf_counter(), last_sent
            events = eng.flush()        # the old engine's last tokens go out before the cut-over
            if events:
                sock.sendall(_toks(eng, events))
                mg.last_old = time.perf_counter()
            eng, events = mg.mig.cutover()
            if fence is not None:        # the engine on the new device does not mark its steps
                fence.unmark()
            if events:
                sock.sendall(_toks(eng, events))
        if eng.has_work():
            ts = time.perf_counter()
            events = eng.step()
            if events:
                sock.sendall(_toks(eng, events))
                last_sent = time.perf_counter()
                if not published:
                    published = True
                    progress("tokens")
            for rid, why in eng.failures:       # requests the engine could not run (their adapter's files)
                sock.sendall(wire.encode({"t": "err", "rid": rid, "msg": why}))
            eng.failures.clear()
            if first_step:
                first_step = False
                sock.sendall(wire.encode({"t": "stats", "first_step_s": time.perf_counter() - ts,
                                          "ready_s": time.time() - t0,
                                          "first_step_phases": {k: v for k, v in eng.step_times.items() if v}}))
        now = time.monotonic()
        if now - load_sent >= 0.1 or not eng.has_work():
            load = eng.load()
            if load != last_load:        # for the frontend's gauges; idle engines send nothing new
                sock.sendall(wire.encode(dict(load, t="load")))
                load_sent, last_load = now, load
        if mg is not None and mg.cut_at is not None:
            if not mg.reported and (last_sent and last_sent > mg.cut_at or not eng.has_work()):
                # downtime as a client sees it: last token from the old engine -> first from the new
                mg.reported = True
                first_new = last_sent if last_sent and last_sent > mg.cut_at else None
                sock.sendall(wire.encode({"t": "migrated", "mid": mg.mid, **mg.mig.stats,
                                          "downtime_s": (first_new - (mg.last_old or mg.cut_at)) if first_new
                                          else None, "device": mg.mig.device}))
            if mg.reported and mg.mig.poll():
                _write_placement(placement_path(frontend_socket), mg.mig.placement)
                sock.sendall(wire.encode({"t": "migrate_done", "mid": mg.mid, **mg.mig.stats,
                                          **mg.mig.placement}))
                mg = None
