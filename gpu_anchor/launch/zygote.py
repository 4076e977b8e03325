"""Warm workers: a fork server that has imported torch (and the user's declared
heavy modules) but touched no CUDA, and forks one worker per (re)start.

    python -m gpu_anchor.launch.zygote --fd N [--preload torch,transformers] [--standby N]

Protocol on the inherited socket (JSON lines), supervisor → zygote:
``{"op": "spawn", "id", "target", "env", "cwd"}``; zygote → supervisor:
``{"op": "ready", "preload_s", "threads", "failed"}`` once, then
``{"op": "spawned", "id", "pid"}`` and ``{"op": "exit", "pid", "status"}``
(status as ``Popen.returncode``: negative = killed by that signal).

Standbys (``runtime.Standby``, the project's one standby: forked ahead of need, its CUDA
context made, optionally a pre-warm function run, then waiting):

- ``--standby N`` keeps one per local rank; a spawn for that rank is handed to it.  Each
  time one is ready the zygote says ``{"op": "standby_ready", "rank", "pid", "info"}``
  (``info``: what its preparation reported, or ``failed``), which the supervisor records
  in the job record.
- ``{"op": "recipe", "rank", "recipe"}``: that rank's pool standbys run the automatic pre-warm
  of ``recipe`` (what the job's first step trained, recorded in the worker); an unused standby
  made before it is dismissed and made again.
- A client may also ask for one explicitly (the benchmarks give every method the same
  standby this way): ``{"op": "standby", "id", "device", "prewarm", "env"}`` →
  ``{"op": "standby_ready", "id", "pid", "info"}``; then ``{"op": "go", "id", "target", "env",
  "cwd"}`` → ``{"op": "spawned", "id", "pid"}`` (the standby's pid, now running the target),
  or ``{"op": "dismiss", "id"}``.

Forks go through ``gpu_anchor.runtime.fork`` (docs/runtime.md): the zygote imports
modules and never runs their work (no CUDA, no parallel ops that would start OpenMP's
pool), and the runtime refuses a fork while any thread but OpenBLAS's (which stops itself
for a fork) runs; at ``ready`` the zygote reports its threads, and the supervisor refuses
the warm path if a preload left a foreign one running.  Each child gets a fresh process
group, ``PR_SET_PDEATHSIG`` (it dies with the zygote), faulthandler, torch's thread pool
rebuilt, the job's environment and working directory, then runs the target via
``gpu_anchor.launch.worker`` and exits through ``runtime.exit_path``.  The zygote dies
with the supervisor.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import selectors
import signal
import socket
import sys
import time

from gpu_anchor import runtime
from gpu_anchor.runtime.warm import PREWARM_ENV


def _run_request(req: dict, how: str = "warm"):
    """In the forked worker (or a standby taking over): the job's environment, then its target.
    Returns the script's globals (``runtime.exit_path`` holds them until the process ends)."""
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    from . import events, worker
    worker.subscribe()
    events.mark("user_code", how=how)
    worker.restore_if_asked()
    return worker.run(req["target"])


def _fork_worker(sock: socket.socket, req: dict) -> int:
    return runtime.fork(lambda: _run_request(req), new_process_group=True, sigint_raises=True,
                        before_main=sock.close)


STANDBY_AFTER_S = 2.0


def _make_standby(sock: socket.socket, device: str | None, prewarm: str | None, env: dict | None,
                  rank: int | None = None, recipe: dict | None = None) -> runtime.Standby:
    """The one way this server makes a standby (the per-rank pool and explicit requests alike):
    made in a new process group, like a forked worker (the supervisor kills groups)."""
    sb = runtime.Standby(lambda: _prepare(device, prewarm, env, rank, recipe),
                         lambda req: _run_request(req, "standby"), new_process_group=True, sigint_raises=True, before_main=sock.close)
    sb.visible = (env if env is not None else os.environ).get("CUDA_VISIBLE_DEVICES")
    return sb


class _Pool:
    """``--standby N``: one warm standby per local rank, its CUDA context created for
    ``cuda:<rank>``; a spawn for that rank is handed to it instead of a fork.  A standby is
    (re)made ``STANDBY_AFTER_S`` after the server starts or after its slot was used, so its
    CUDA init does not compete with a starting worker.

    Automatic pre-warm: once the supervisor passes a rank's recipe (``set_recipe``: what the
    job's first step trained), that rank's standbys replay it (``runtime.auto_prewarm``); an
    unused standby made before the recipe is dismissed and made again at once."""

    def __init__(self, n: int, sock: socket.socket) -> None:
        self.n, self.sock, self.sb = n, sock, {}
        self.due = {r: time.monotonic() + STANDBY_AFTER_S for r in range(n)}
        self.recipes: dict[int, dict] = {}

    def set_recipe(self, rank: int, recipe: dict) -> None:
        if self.recipes.get(rank) == recipe or not 0 <= rank < self.n:
            return
        self.recipes[rank] = recipe
        sb = self.sb.pop(rank, None)
        if sb is not None:          # made without it: re-prepare now
            sb.close()
            self.due[rank] = time.monotonic()

    def refill(self) -> list[tuple[int, runtime.Standby]]:
        """Make the standbys that are due; returns the new ones (rank, standby)."""
        now, made = time.monotonic(), []
        for r in range(self.n):
            if r not in self.sb and now >= self.due[r]:
                self.sb[r] = _make_standby(self.sock, None, os.environ.get(PREWARM_ENV), None, rank=r,
                                           recipe=self.recipes.get(r))
                made.append((r, self.sb[r]))
        return made

    def take(self, req: dict) -> int | None:
        """The standby's pid, now running ``req``; None: fork as usual."""
        r = int(req["env"].get("LOCAL_RANK", "0"))
        sb = self.sb.pop(r, None)
        if sb is None:
            return None
        self.due[r] = time.monotonic() + STANDBY_AFTER_S
        return _hand_over(sb, req, timeout=10.0)

    def close(self) -> None:
        for sb in self.sb.values():
            sb.close()


def _hand_over(sb: runtime.Standby, req: dict, timeout: float) -> int | None:
    """``req`` run by the standby ``sb`` (its pid), or None (dismissed) when it is not ready
    within ``timeout`` or its CUDA context was made under another device visibility."""
    if req["env"].get("CUDA_VISIBLE_DEVICES") == sb.visible and sb.ready(timeout=timeout):
        try:
            return sb.go(req)
        except OSError:
            pass
    sb.close()
    return None


def _prepare(device: str | None, prewarm: str | None, env: dict | None, rank: int | None,
             recipe: dict | None = None) -> dict:
    """A standby's preparation: the environment it will run in (if given), the CUDA context of
    its device (``cuda:<rank>`` for the pool), and the pre-warm function if one is named, else
    the automatic pre-warm when the job's recipe is known.  It touches no anchored state."""
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    import torch
    from gpu_anchor.runtime.warm import run_prewarm, warm_cuda
    info = {}
    if device is None:
        device = f"cuda:{rank}" if torch.cuda.is_available() and rank < torch.cuda.device_count() else "cpu"
    if device.startswith("cuda"):
        info = warm_cuda(device)
    if prewarm:  # a failure here fails the standby: the caller forks as usual, the log has the traceback
        info.update(run_prewarm(prewarm, device))
    elif recipe is not None:  # never raises: a skip or failure is reported, the standby stays warm
        from gpu_anchor.runtime.auto_prewarm import run_auto_prewarm
        from gpu_anchor.train.standby_warm import warm_anchored_update
        info.update(run_auto_prewarm(recipe, device))
        info.update(warm_anchored_update(recipe, device))
    return info


def serve(fd: int, preload: list[str], standby: int = 0) -> None:
    runtime.set_pdeathsig(signal.SIGTERM)
    sock = socket.socket(fileno=fd)
    t0 = time.perf_counter()
    failed = {}
    for mod in preload:
        try:
            importlib.import_module(mod)
        except BaseException as e:  # report, keep serving what did import
            failed[mod] = f"{type(e).__name__}: {e}"
    def send(msg: dict) -> None:
        sock.sendall((json.dumps(msg) + "\n").encode())

    import threading
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        failed["cuda"] = "a preloaded module initialised CUDA: children could not use it"
    send({"op": "ready", "preload_s": time.perf_counter() - t0, "threads": len(runtime.os_threads()),
          "python_threads": threading.active_count(), "foreign_threads": runtime.foreign_threads(),
          "failed": failed, "pid": os.getpid()})
    rfd, wfd = os.pipe()
    os.set_blocking(rfd, False), os.set_blocking(wfd, False)
    signal.set_wakeup_fd(wfd)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ, "ctl")
    sel.register(rfd, selectors.EVENT_READ, "chld")
    buf = b""
    pool = _Pool(standby, sock) if standby else None
    asked: dict = {}       # id -> Standby made on request
    unreported: list = []  # (tag, Standby) whose readiness the client has not been told yet
    while True:
        if pool is not None:
            unreported += [({"rank": r}, sb) for r, sb in pool.refill()]
        for key, _ in sel.select(timeout=0.05 if unreported else 0.5 if pool else 1.0):
            if key.data == "chld":
                try:
                    os.read(rfd, 4096)
                except BlockingIOError:
                    pass
                continue
            data = sock.recv(65536)
            if not data:
                return  # supervisor gone
            buf += data
        unreported = _report_ready(unreported, send)
        _reap(send)
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            req = json.loads(line)
            op = req.get("op")
            if op == "quit":
                for sb in list(asked.values()) + (list(pool.sb.values()) if pool is not None else []):
                    sb.close()
                return
            if op == "recipe":
                if pool is not None:
                    pool.set_recipe(int(req["rank"]), req["recipe"])
            elif op == "spawn":
                pid = pool.take(req) if pool is not None else None
                if pid is None:
                    pid = _fork_worker(sock, req)
                send({"op": "spawned", "id": req["id"], "pid": pid})
            elif op == "standby":
                try:
                    asked[req["id"]] = sb = _make_standby(sock, req.get("device") or "cpu", req.get("prewarm"),
                                                          req.get("env"))
                except runtime.ForkUnsafe as e:
                    send({"op": "standby_ready", "id": req["id"], "pid": None, "info": {"failed": str(e)}})
                else:
                    unreported.append(({"id": req["id"]}, sb))
            elif op == "go":
                sb = asked.pop(req["id"], None)
                pid = _hand_over(sb, req, timeout=30.0) if sb is not None else None
                send({"op": "spawned", "id": req["id"], "pid": pid,
                      **({} if pid else {"error": "no ready standby with that id and device visibility"})})
            elif op == "dismiss":
                sb = asked.pop(req["id"], None)
                if sb is not None:
                    sb.close()


def _report_ready(unreported: list, send) -> list:
    """Send ``standby_ready`` for each standby that finished preparing (or failed); returns the rest."""
    left = []
    for tag, sb in unreported:
        if sb.used:
            continue
        sb.ready(0)
        if sb.info is None:
            left.append((tag, sb))
        else:
            send({"op": "standby_ready", **tag, "pid": sb.pid, "info": sb.info, "t": time.time()})
    return left


def _reap(send) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        rc = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        send({"op": "exit", "pid": pid, "status": rc, "t": time.time()})


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--fd", type=int, required=True)
    p.add_argument("--preload", default="torch")
    p.add_argument("--standby", type=int, default=0, help="warm standbys, one per local rank (0: none)")
    a = p.parse_args(argv)
    # runtime's exit path (atexit, flush, os._exit): the interpreter's teardown of torch and
    # torch._dynamo (~0.9 s) would only delay the supervisor, which waits for this exit
    runtime.exit_path(lambda: serve(a.fd, [m for m in a.preload.split(",") if m], a.standby))


if __name__ == "__main__":
    main()


class Zygote:
    """The supervisor's handle on one fork server (see the module docstring)."""

    def __init__(self, python: str, preload: list[str], env: dict, timeout: float = 300.0, standby: int = 0) -> None:
        import subprocess
        ours, theirs = socket.socketpair()
        # A preload that asks torch.cuda.is_available() must not initialise the CUDA
        # runtime in the server (forked children could not use it): ask NVML instead.
        env = {**env, "PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
        self.proc = subprocess.Popen([python, "-m", "gpu_anchor.launch.zygote", "--fd", str(theirs.fileno()),
                                      "--preload", ",".join(preload), "--standby", str(standby)],
                                     pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL)
        theirs.close()
        self.sock = ours
        self._buf = b""
        self._queue: list[dict] = []
        self._next_id = 0
        self.ready = self._wait("ready", timeout)

    def fileno(self) -> int:
        return self.sock.fileno()

    def _read(self, timeout: float | None) -> bool:
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(65536)
        except (socket.timeout, BlockingIOError):
            return True
        finally:
            self.sock.settimeout(None)
        if not data:
            return False
        self._buf += data
        while b"\n" in self._buf:
            line, self._buf = self._buf.split(b"\n", 1)
            self._queue.append(json.loads(line))
        return True

    def _wait(self, op: str, timeout: float, **match) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            for i, msg in enumerate(self._queue):
                if msg.get("op") == op and all(msg.get(k) == v for k, v in match.items()):
                    return self._queue.pop(i)
            left = deadline - time.monotonic()
            if left <= 0 or not self._read(min(left, 1.0)) or self.proc.poll() is not None:
                if self.proc.poll() is not None or left <= 0:
                    state = self.exit_status() if self.proc.poll() is not None else "still running"
                    raise RuntimeError(f"warm-worker server did not answer {op!r} ({state})")
                raise RuntimeError("warm-worker server closed its socket")

    def _send(self, msg: dict) -> None:
        try:
            self.sock.sendall((json.dumps(msg) + "\n").encode())
        except BrokenPipeError:
            raise RuntimeError(f"warm-worker server exited ({self.exit_status()})") from None

    def spawn(self, target: list[str], env: dict, cwd: str) -> int:
        self._next_id += 1
        self._send({"op": "spawn", "id": self._next_id, "target": target, "env": env, "cwd": cwd})
        return self._wait("spawned", 30.0, id=self._next_id)["pid"]

    def standby(self, device: str, env: dict, prewarm: str | None = None) -> int:
        """Ask for a standby (``runtime.Standby``) on ``device`` that will run in ``env`` and, with
        ``prewarm`` (``module:function``), calls it first; returns its id (``wait_standby``)."""
        self._next_id += 1
        self._send({"op": "standby", "id": self._next_id, "device": device, "env": env, "prewarm": prewarm})
        return self._next_id

    def wait_standby(self, sid: int, timeout: float = 1800.0) -> dict:
        """``{"pid", "info"}`` once standby ``sid`` is ready; RuntimeError if its preparation failed."""
        msg = self._wait("standby_ready", timeout, id=sid)
        if "failed" in msg["info"]:
            raise RuntimeError(f"standby {sid} failed to prepare: {msg['info']['failed']}")
        return msg

    def go(self, sid: int, target: list[str], env: dict, cwd: str) -> int:
        """Hand ``target`` to ready standby ``sid``; returns its pid (now the worker)."""
        self._send({"op": "go", "id": sid, "target": target, "env": env, "cwd": cwd})
        msg = self._wait("spawned", 60.0, id=sid)
        if not msg.get("pid"):
            raise RuntimeError(f"standby {sid} could not take over: {msg.get('error')}")
        return msg["pid"]

    def dismiss(self, sid: int) -> None:
        self._send({"op": "dismiss", "id": sid})

    def recipe(self, rank: int, recipe: dict) -> None:
        """Rank ``rank``'s standbys replay ``recipe`` from now on (``runtime.auto_prewarm``); one
        made before it is made again."""
        self._send({"op": "recipe", "rank": rank, "recipe": recipe})

    def pool_ready(self) -> list[dict]:
        """The per-rank pool's ``standby_ready`` reports received so far (non-blocking, each once)."""
        self._read(0.0)
        out = [m for m in self._queue if m.get("op") == "standby_ready" and "rank" in m]
        self._queue = [m for m in self._queue if not (m.get("op") == "standby_ready" and "rank" in m)]
        return out

    def exit_status(self) -> str:
        """How the server ended, for error messages (a signal number says who to suspect: 9 is
        also what the kernel's out-of-memory killer sends)."""
        try:
            rc = self.proc.wait(timeout=5)
        except Exception:
            return "still running, socket closed"
        return f"killed by signal {-rc}" if rc < 0 else f"exit status {rc}"

    def messages(self) -> list[dict]:
        """Exit reports received so far (non-blocking); raises if the zygote is gone."""
        alive = self._read(0.0)
        out, self._queue = [m for m in self._queue if m.get("op") == "exit"], \
            [m for m in self._queue if m.get("op") != "exit"]
        if not alive and not out:
            raise RuntimeError(f"warm-worker server exited ({self.exit_status()})")
        return out

    def close(self) -> None:
        try:
            self.sock.sendall(b'{"op": "quit"}\n')
        except OSError:
            pass
        self.sock.close()
        try:
            self.proc.wait(timeout=5)
        except Exception:
            self.proc.kill()


def start_server(python: str, preload: list[str], log, standby: int = 0,
                 prewarm: str | None = None, hide_gpus: bool = False) -> "Zygote | None":
    """A ready warm-worker server, or None (logged why) when the warm path is unusable.
    ``prewarm``: ``module:function`` each standby calls after its CUDA init (``runtime.warm.run_prewarm``).
    ``hide_gpus``: the server and its standbys see no GPU, as the job's workers (``--device-type cpu``);
    a standby only takes a spawn made under its own device visibility."""
    from gpu_anchor.runtime.warm import PREWARM_ENV
    env = dict(os.environ)
    if hide_gpus:
        env["CUDA_VISIBLE_DEVICES"] = ""
    env.pop(PREWARM_ENV, None)
    if prewarm and standby:
        env[PREWARM_ENV] = prewarm
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = here + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    try:
        z = Zygote(python, preload, env, standby=standby)
    except (RuntimeError, OSError) as e:
        log(f"warm-worker server did not start ({e}); cold starts")
        return None
    r = z.ready
    problem = None
    if "cuda" in r["failed"]:
        problem = r["failed"]["cuda"]
    elif r.get("foreign_threads"):
        problem = f"threads running after preloading {','.join(preload)}: {', '.join(r['foreign_threads'])}; " \
                  "forking is unsafe"
    if problem:
        log(f"warm-worker server unusable: {problem}; cold starts")
        z.close()
        return None
    if r["failed"]:
        log(f"warm-worker server could not preload {r['failed']}; they load in each worker")
    log(f"warm-worker server pid {r['pid']} ready (preloaded {','.join(preload)} in {r['preload_s']:.2f} s, "
        f"{r['threads']} OS thread(s))")
    return z
