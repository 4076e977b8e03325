"""Starting, finding and stopping daemons from other processes (torch-free).

Used by the CLI, the supervisor and the tests, so that there is one way to
start a daemon and wait until it answers.
"""
from __future__ import annotations

import glob
import os
import subprocess
import sys
import time

from gpu_anchor import errors
from gpu_anchor.client.channel import Channel
from gpu_anchor.paths import default_socket, ensure_private_dir, normalize_device, socket_dir


def ping(device: str, socket_path: str | None = None) -> dict | None:
    """The daemon's hello, or None if nothing answers there."""
    try:
        ch = Channel(device, socket_path, timeout=5.0)
    except errors.DaemonUnavailable:
        return None
    try:
        return ch.hello
    finally:
        ch.close()


def start(device: str, socket_path: str | None = None, log_path: str | None = None,
          timeout: float = 60.0, env: dict | None = None) -> subprocess.Popen:
    """Start a daemon in its own session (it outlives its parent) and wait until it answers."""
    device = normalize_device(device)
    path = socket_path or default_socket(device)
    ensure_private_dir(os.path.dirname(path))
    if log_path is None:
        log_path = (path[: -len(".sock")] if path.endswith(".sock") else path) + ".log"
    log = open(log_path, "ab")
    cmd = [sys.executable, "-m", "gpu_anchor.daemon", "--device", device, "--socket", path]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
                            env=env, close_fds=True)
    log.close()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            with open(log_path, "rb") as f:
                tail = f.read()[-2000:].decode(errors="replace")
            raise RuntimeError(f"daemon for {device} exited with {proc.returncode}; log {log_path}:\n{tail}")
        if ping(device, path) is not None:
            return proc
        time.sleep(0.02)
    proc.kill()
    raise TimeoutError(f"daemon for {device} did not answer at {path} within {timeout} s (log: {log_path})")


def stop(device: str, socket_path: str | None = None, timeout: float = 10.0) -> bool:
    """Ask a daemon to shut down (it releases all memory); False if none answered."""
    try:
        ch = Channel(device, socket_path, timeout=timeout)
    except errors.DaemonUnavailable:
        return False
    pid = ch.hello.get("pid")
    try:
        ch.request({"op": "shutdown"})
    finally:
        ch.close()
    deadline = time.monotonic() + timeout
    while pid and pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    return True


def await_gone(device: str, socket_path: str | None, pid: int, timeout: float = 30.0) -> None:
    """Return once the daemon holds no connection of process ``pid`` (which must be dying):
    whatever it sent whole has been handled, so a journal read after this sees its last commit
    if that commit reached the daemon at all.  Raises ``DaemonUnavailable`` (the daemon is gone,
    or ``pid`` kept a connection open for ``timeout`` seconds)."""
    ch = Channel(device, socket_path, timeout=timeout)
    try:
        ch.request({"op": "await_gone", "pid": int(pid)})
    finally:
        ch.close()


def drain(device: str, socket_path: str | None, pid: int, timeout: float = 30.0) -> int:
    """Make the daemon handle now every whole frame process ``pid`` sent; call it only once no
    thread of ``pid`` that could send runs any more (``runtime.liveness.Liveness.writers_gone``).
    Returns the bytes of a torn last frame (never handled).  Raises ``DaemonUnavailable``."""
    ch = Channel(device, socket_path, timeout=timeout)
    try:
        return int(ch.request({"op": "drain", "pid": int(pid)})[0].get("torn", 0))
    finally:
        ch.close()


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie (exited, not yet reaped by its parent) counts as gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def discover(directory: str | None = None) -> dict[str, str]:
    """``{device: socket_path}`` for every socket file in the directory (answering or not)."""
    out = {}
    for path in sorted(glob.glob(os.path.join(directory or socket_dir(), "*.sock"))):
        stem = os.path.basename(path)[: -len(".sock")]
        device = "cpu" if stem == "cpu" else stem.replace("cuda", "cuda:", 1)
        try:
            out[normalize_device(device)] = path
        except ValueError:
            continue
    return out
