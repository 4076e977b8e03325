"""Run a test's job command in a fork of an interpreter that has already imported torch (and
transformers, accelerate, ... as asked): ``subprocess.run`` for job scripts, without paying
their imports at every start.

    out = preloaded.run([sys.executable, JOB, "anchored", ns], env=env, timeout=300,
                        preload=preloaded.HF)     # subprocess.CompletedProcess, text output

Why: on CI's two cores ``import torch`` alone takes 2 s and torch + transformers' model and
Trainer modules 5.5 s, which was nearly all of each run of a small accelerate or Trainer job
(a test file runs 30 of them).  ``tests/scope_matrix.py`` forks its cases from such an
interpreter for the same reason; this module offers it behind ``subprocess``'s interface.

What the child is: a fork (``gpu_anchor.runtime.fork``: refused while the server runs any
thread, the child's torch thread pool rebuilt) of a server that imported only the ``preload``
modules (of gpu-anchor only its package root and torch-free runtime; never CUDA, never an op),
given the command's environment, working directory, ``sys.argv`` and ``sys.path`` (the script's
folder, then ``PYTHONPATH``, then the interpreter's own) and the caller's stdin, stdout and
stderr (``run``: ``/dev/null`` and two files), then the script (``runpy``), module (``-m``) or
code (``-c``) run as ``__main__`` and the exit taken as ``python`` takes it
(``runtime.exit_path``).  The return code is the child's (negative: killed by that signal), as
``subprocess`` reports it.

Started as a new interpreter by ``subprocess`` itself instead (never silently otherwise: a
server that cannot start warns):

- ``GPU_ANCHOR_TEST_COLD=1`` in the environment;
- a CUDA build of torch (GPU machines: their tests start interpreters as users do);
- a command that is not ``[sys.executable, script | -m module | -c code, ...]``, or a ``Popen``
  given a stdin other than None or ``DEVNULL``;
- an environment whose variables read at import time (``HF_*``, ``TRANSFORMERS_*``,
  ``TORCH*``, ``PYTORCH_*``, ``ACCELERATE_*``, ``PYTHON*`` but ``PYTHONPATH``, ``OMP_*``,
  ``MKL_*``, ...) differ from the server's: the preloaded modules read them already (but
  ``OMP_NUM_THREADS``, given to the child's torch thread pool as it is rebuilt).

One server per preload set per pytest process, started at its first use, exiting when that
process is gone (its children, with ``PR_SET_PDEATHSIG``, die with the server).
"""
from __future__ import annotations

import json
import os
import select
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCH = ("torch",)
HF = ("torch", "transformers", "transformers.modeling_utils", "transformers.models.qwen3.modeling_qwen3",
      "transformers.optimization", "transformers.trainer", "accelerate")
_IMPORT_TIME_ENV = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TORCH", "PYTORCH_", "ACCELERATE_", "TOKENIZERS_",
                    "PYTHON", "OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "LD_", "MALLOC_")
# read when used, not at import (inductor sets its cache folder's variable in the test process)
_READ_WHEN_USED = ("PYTHONPATH", "TORCHINDUCTOR_CACHE_DIR")
_servers: dict[tuple, "_Server | None"] = {}


def run(cmd: list, *, env: dict | None = None, cwd=None, timeout: float | None = None,
        preload: tuple = TORCH) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)``,
    in a fork of the ``preload`` server when it can be (the module docstring says when not)."""
    env, cwd = dict(os.environ if env is None else env), os.fspath(cwd) if cwd is not None else os.getcwd()
    server, target = _usable(cmd, env, preload)
    if server is None:
        return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = server.spawn(cmd, target, env, cwd, (subprocess.DEVNULL, out, err))
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise subprocess.TimeoutExpired(cmd, timeout, _text(out), _text(err)) from None
        return subprocess.CompletedProcess(cmd, proc.returncode, _text(out), _text(err))


def Popen(cmd: list, *, env: dict | None = None, cwd=None, stdin=None, stdout=None, stderr=None,
          text: bool = False, preload: tuple = TORCH):
    """``subprocess.Popen`` with these arguments (``stdout`` / ``stderr``: None, ``DEVNULL``,
    ``PIPE``, a file or a descriptor; ``stderr`` also ``STDOUT``), in a fork of the ``preload``
    server when it can be.  The object answers ``pid``, ``returncode``, ``poll``, ``wait``,
    ``send_signal``, ``terminate``, ``kill``, ``stdout`` / ``stderr`` (with ``PIPE``) and ``with``."""
    env, cwd = dict(os.environ if env is None else env), os.fspath(cwd) if cwd is not None else os.getcwd()
    server, target = _usable(cmd, env, preload) if stdin in (None, subprocess.DEVNULL) else (None, None)
    if server is None:
        return subprocess.Popen(cmd, env=env, cwd=cwd, stdin=stdin, stdout=stdout, stderr=stderr, text=text)
    return server.spawn(cmd, target, env, cwd, (stdin, stdout, stderr), text)


def _usable(cmd, env, preload) -> tuple:
    target = _target(cmd)
    if target is None or os.environ.get("GPU_ANCHOR_TEST_COLD") == "1" or _cuda_build():
        return None, None
    server = _server(tuple(preload))
    return (server, target) if server is not None and server.fits(env) else (None, None)


def _target(cmd) -> tuple | None:
    cmd = [os.fspath(c) for c in cmd]
    if len(cmd) < 2 or cmd[0] != sys.executable:
        return None
    if cmd[1] in ("-m", "-c"):
        return ("module" if cmd[1] == "-m" else "code", cmd[2], cmd[3:]) if len(cmd) > 2 else None
    if cmd[1].startswith("-"):
        return None
    return "path", cmd[1], cmd[2:]


def _cuda_build() -> bool:
    try:
        import torch
        return bool(torch.backends.cuda.is_built())
    except ImportError:
        return False


def _import_time_env(env: dict) -> dict:
    return {k: v for k, v in env.items() if k.startswith(_IMPORT_TIME_ENV) and k not in _READ_WHEN_USED}


def _server(preload: tuple) -> "_Server | None":
    if preload in _servers and _servers[preload] is not None:
        if _servers[preload].owner != os.getpid():
            return None          # a forked test worker: its parent's server, not its own to use
        if _servers[preload].proc.poll() is not None:
            warnings.warn(f"tests/preloaded.py: the server for {preload} exited "
                          f"({_servers[preload].proc.returncode}); starting another", stacklevel=4)
            del _servers[preload]
    if preload not in _servers:
        try:
            _servers[preload] = _Server(preload)
        except RuntimeError as e:
            warnings.warn(f"tests/preloaded.py: no server for {preload} ({e}); these jobs run cold", stacklevel=4)
            _servers[preload] = None
    return _servers[preload]


class _Server:
    """The client's handle on one server process."""

    def __init__(self, preload: tuple) -> None:
        self.dir = tempfile.mkdtemp(prefix="ga-preloaded-")
        self.path = os.path.join(self.dir, "s.sock")
        self.env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), self.path, *preload],
                                     env={**self.env, "PYTHONPATH": ROOT}, stdout=subprocess.PIPE,
                                     stdin=subprocess.DEVNULL, text=True)
        line = self.proc.stdout.readline()
        ready = json.loads(line) if line.startswith("{") else {"why": f"exited {self.proc.wait()}"}
        if "why" in ready:
            raise RuntimeError(ready["why"])
        self.base_path, self.owner = ready["path"], os.getpid()
        import atexit
        atexit.register(self.close)

    def fits(self, env: dict) -> bool:
        mine, theirs = _import_time_env(self.env), _import_time_env(env)
        if "OMP_NUM_THREADS" not in mine:         # read when the child's pool is built: given to it
            theirs.pop("OMP_NUM_THREADS", None)
        return mine == theirs

    def spawn(self, cmd, target, env, cwd, stdio, text=False) -> "_Forked":
        kind, what, args = target
        argv0 = {"path": what, "module": what, "code": "-c"}[kind]
        first = {"path": os.path.dirname(os.path.abspath(os.path.join(cwd, what))), "module": cwd, "code": ""}[kind]
        paths = [first, *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p], *self.base_path]
        request = {"kind": kind, "what": what, "argv": [argv0, *args], "path": paths, "env": env, "cwd": cwd}
        fds, mine, theirs = [], [], []           # what the child gets; pipe ends kept here; to close here
        for i, want in enumerate(stdio):
            if want is None:
                fds.append(i)
            elif want == subprocess.DEVNULL:
                fds.append(os.open(os.devnull, os.O_RDWR))
                theirs.append(fds[-1])
            elif want == subprocess.PIPE and i > 0:
                r, w = os.pipe()
                fds.append(w)
                theirs.append(w)
                mine.append(open(r, "r" if text else "rb"))
            elif want == subprocess.STDOUT and i == 2:
                fds.append(fds[1])
            elif isinstance(want, int) and want >= 0:
                fds.append(want)
            elif hasattr(want, "fileno"):
                fds.append(want.fileno())
            else:
                raise ValueError(f"tests/preloaded.py: stdio {i} = {want!r} is not supported")
        s = socket.socket(socket.AF_UNIX)
        try:
            s.connect(self.path)
            socket.send_fds(s, [b"\n"], fds)
            s.sendall(json.dumps(request).encode() + b"\n")
            pid = _reply(s)["pid"]
        except BaseException:
            s.close()
            raise
        finally:
            for fd in theirs:
                os.close(fd)
        pipes = iter(mine)
        return _Forked(cmd, pid, s, next(pipes) if stdio[1] == subprocess.PIPE else None,
                       next(pipes) if stdio[2] == subprocess.PIPE else None)

    def close(self) -> None:
        if os.getpid() != self.owner:           # a fork of the test process exiting: not its server
            return
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        try:
            os.unlink(self.path)
            os.rmdir(self.dir)
        except OSError:
            pass


class _Forked:
    """A child of a server, as the test sees it: ``subprocess.Popen``'s surface that tests use.
    Its exit status comes on the connection it was asked for (the server reaps it)."""

    def __init__(self, args, pid: int, conn: socket.socket, stdout, stderr) -> None:
        self.args, self.pid, self.conn, self.stdout, self.stderr = args, pid, conn, stdout, stderr
        self.stdin, self.returncode = None, None

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self.conn], [], [], 0)[0]:
            self._take()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self.conn], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._take()
        return self.returncode

    def _take(self) -> None:
        try:
            self.returncode = _reply(self.conn)["rc"]
        except RuntimeError:
            self.returncode = -signal.SIGKILL      # the server died: its children die with it
        self.conn.close()

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        for f in (self.stdout, self.stderr):
            if f is not None:
                f.close()
        self.wait()


def _reply(s: socket.socket) -> dict:
    """One JSON line from the server (a byte at a time: nothing read past the line)."""
    line = b""
    while not line.endswith(b"\n"):
        b = s.recv(1)
        if not b:
            raise RuntimeError("tests/preloaded.py: the server closed the connection")
        line += b
    return json.loads(line)


def _text(f) -> str:
    f.seek(0)
    return f.read().decode(errors="replace")


# ---------------------------------------------------------------------------- the server

def _serve(path: str, preload: list[str]) -> None:
    import importlib
    from gpu_anchor import runtime
    parent = os.getppid()            # watched, not PR_SET_PDEATHSIG: that follows the starting thread
    for name in preload:
        importlib.import_module(name)
    foreign = runtime.foreign_threads()
    if foreign:
        print(json.dumps({"why": f"importing {preload} started threads: {', '.join(foreign)}"}), flush=True)
        return
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen(64)
    own = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    print(json.dumps({"path": [p for p in sys.path[1:] if p not in own]}), flush=True)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    children: dict[int, socket.socket] = {}
    while os.getppid() == parent:          # the pytest process that started it is alive
        for key, _ in sel.select(timeout=0.02):
            conn, _ = listener.accept()
            _, stdio, _, _ = socket.recv_fds(conn, 1, 3)
            with conn.makefile("r") as f:
                request = json.loads(f.readline())
            try:
                pid = _spawn(request, stdio, [listener.fileno(), conn.fileno(), *(c.fileno() for c in children.values())])
            finally:
                for fd in stdio:
                    os.close(fd)
            children[pid] = conn
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(json.dumps({"rc": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
                except OSError:
                    pass           # its client gave up
                conn.close()


def _spawn(request: dict, stdio: list[int], close_fds: list[int]) -> int:
    from gpu_anchor import runtime
    threads = request["env"].get("OMP_NUM_THREADS", "")

    def before_main():
        for fd in close_fds:
            os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        for fd, given in enumerate(stdio):
            os.dup2(given, fd)
        for given in set(stdio):
            if given > 2:
                os.close(given)
        sys.argv[:] = request["argv"]
        sys.path[:] = request["path"]

    def main():
        import runpy
        kind, what = request["kind"], request["what"]
        if kind == "path":
            return runpy.run_path(what, run_name="__main__")
        if kind == "module":
            return runpy.run_module(what, run_name="__main__", alter_sys=True)
        import types
        module = types.ModuleType("__main__")
        sys.modules["__main__"] = module
        exec(compile(what, "<string>", "exec"), module.__dict__)
        return module

    return runtime.fork(main, before_main=before_main, sigint_raises=True,
                        torch_threads=int(threads) if threads.isdigit() and int(threads) > 0 else None)


if __name__ == "__main__":
    try:
        _serve(sys.argv[1], sys.argv[2:])
    except Exception as e:       # the client falls back to cold runs and says why
        print(json.dumps({"why": f"{type(e).__name__}: {e}"}), flush=True)
