"""Connecting under load: 600 processes at once, an accept queue that overflows, a daemon
that is starting, a dead daemon's stale socket.  Nothing here asserts on time."""
from __future__ import annotations

import fcntl
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from gpu_anchor import errors, protocol
from gpu_anchor.client.channel import Channel
from gpu_anchor.client import control
from gpu_anchor.paths import lock_path, process_identity

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STORM = os.path.join(ROOT, "tests", "connect_storm.py")
SMALL_BACKLOG = 16


def _storm(path: str, n: int, pause_pid: int) -> dict:
    out = subprocess.run([sys.executable, STORM, path, str(n), "--pause-daemon", str(pause_pid)],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    print(f"connect storm at {path}: {summary}")   # the measurement (pytest -s shows it)
    return summary


def _small_daemon(path: str, backlog: int = SMALL_BACKLOG, max_fds: int = 0) -> subprocess.Popen:
    """A real daemon process whose listen backlog is what a kernel with somaxconn=``backlog``
    grants, and (``max_fds``) whose hard descriptor limit is that low."""
    code = ("import sys, logging, resource; logging.basicConfig(stream=sys.stderr)\n"
            f"if {max_fds}: resource.setrlimit(resource.RLIMIT_NOFILE, ({max_fds}, {max_fds}))\n"
            "import gpu_anchor.daemon.server as server\n"
            f"server.LISTEN_BACKLOG = {backlog}\n"
            f"server.run('cpu', {path!r})\n")
    proc = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": ROOT},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 60
    while control.ping("cpu", path) is None:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()
        time.sleep(0.05)
    return proc


def _stop(proc: subprocess.Popen, path: str) -> None:
    os.kill(proc.pid, signal.SIGCONT)
    control.stop("cpu", path)
    proc.wait(30)


def test_600_processes_connect_at_once(host_daemon):
    path, proc = host_daemon
    s = _storm(path, 600, proc.pid)
    assert (s["ok"], s["reported"], s["errors"]) == (600, 600, {}), s
    assert Channel("cpu", path).request({"op": "ping"})[0]["ok"]


def test_600_processes_connect_past_a_full_accept_queue(socket_dir):
    path = os.path.join(socket_dir, "small.sock")
    proc = _small_daemon(path)
    try:
        s = _storm(path, 600, proc.pid)       # the daemon is stopped while they connect: the queue overflows
        assert (s["ok"], s["reported"], s["errors"]) == (600, 600, {}), s
        assert Channel("cpu", path).request({"op": "ping"})[0]["ok"]
    finally:
        _stop(proc, path)


def test_a_queue_that_stays_full_ends_in_a_clear_error_and_service_resumes(socket_dir):
    path = os.path.join(socket_dir, "small.sock")
    proc = _small_daemon(path)
    filler = []
    try:
        os.kill(proc.pid, signal.SIGSTOP)     # a stuck daemon: nothing is accepted from here on
        while True:                           # fill its accept queue, observed directly
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            try:
                s.connect(path)
            except BlockingIOError:
                s.close()
                break
            filler.append(s)
        assert len(filler) >= SMALL_BACKLOG
        with pytest.raises(errors.DaemonUnavailable) as e:
            Channel("cpu", path, timeout=0.5)
        msg = str(e.value)
        assert "accepted no connection within 0.5 s" in msg and "stayed full" in msg, msg
        assert "BlockingIOError" not in msg and "Errno" not in msg, msg
        os.kill(proc.pid, signal.SIGCONT)
        for s in filler:
            s.close()
        assert Channel("cpu", path).request({"op": "ping"})[0]["ok"]
    finally:
        for s in filler:
            s.close()
        _stop(proc, path)


def test_stale_socket_fails_at_once_and_a_starting_daemon_is_waited_for(socket_dir):
    path = os.path.join(socket_dir, "cpu.sock")
    dead = control.start("cpu", path)
    dead.kill()                               # SIGKILL: its socket file and lock file stay behind
    dead.wait(10)
    assert os.path.exists(path)
    with pytest.raises(errors.DaemonUnavailable, match="Start one with"):   # not the retry-until-deadline error
        Channel("cpu", path, timeout=600)

    # A daemon between taking its lock and listening, as bind_socket leaves it for a moment:
    # it holds the lock and has written who it is; the stale socket still refuses.
    lock = os.open(lock_path(path), os.O_RDWR)
    fcntl.flock(lock, fcntl.LOCK_EX)
    os.ftruncate(lock, 0)
    os.pwrite(lock, process_identity(os.getpid()).encode(), 0)
    result = {}

    def connect():
        try:
            result["hello"] = Channel("cpu", path, timeout=120).hello
        except Exception as e:   # noqa: BLE001
            result["error"] = e

    t = threading.Thread(target=connect)
    t.start()
    os.close(lock)                            # now the real daemon starts and takes over
    proc = control.start("cpu", path)
    try:
        t.join(150)
        assert result.get("hello", {}).get("device") == "cpu", result
    finally:
        control.stop("cpu", path)
        proc.wait(10)


def test_out_of_descriptors_the_daemon_pauses_accept_and_serves_everyone(socket_dir):
    path = os.path.join(socket_dir, "fds.sock")
    proc = _small_daemon(path, backlog=4096, max_fds=48)   # room for about 40 connections
    sel, socks = selectors.DefaultSelector(), []
    ping = protocol.encode({"op": "ping"})
    try:
        for _ in range(120):                  # all queued at once; the daemon runs out of descriptors
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(path)
            s.sendall(ping)
            sel.register(s, selectors.EVENT_READ)
            socks.append(s)
        answered, deadline = 0, time.monotonic() + 120  # a hang guard, not a measurement
        while answered < len(socks) and time.monotonic() < deadline:
            for key, _ in sel.select(timeout=1.0):
                reply = protocol.recv_frame(key.fileobj)[0]
                assert reply["ok"], reply
                answered += 1
                sel.unregister(key.fileobj)
                key.fileobj.close()          # frees a descriptor: the daemon accepts the next one
        assert answered == len(socks) and proc.poll() is None
        assert Channel("cpu", path).request({"op": "ping"})[0]["ok"]
    finally:
        for s in socks:
            s.close()
        _stop(proc, path)


def test_a_daemon_that_emptied_its_lock_file_but_not_yet_wrote_it_counts_as_starting(socket_dir):
    """A starting daemon truncates its lock file, then writes who it is: a client that reads the
    file in between must wait for it, not say "no daemon" (seen once in a loaded CI run)."""
    from gpu_anchor.paths import daemon_alive
    path = os.path.join(socket_dir, "cpu.sock")
    dead = control.start("cpu", path)
    dead.kill()
    dead.wait(10)
    assert not daemon_alive(path)             # the dead daemon's identity, nobody holding the lock
    lock = os.open(lock_path(path), os.O_RDWR)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        os.ftruncate(lock, 0)                 # the daemon's first two moves (daemon/server.py)
        assert daemon_alive(path)
    finally:
        os.close(lock)
    assert not daemon_alive(path)             # lock released, file empty: nobody
