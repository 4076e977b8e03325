"""The daemon under load, under garbage, and against other users: it keeps serving and leaks nothing."""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import socket
import struct
import subprocess
import sys
import tempfile
import time

import pytest
import torch

import gpu_anchor
from gpu_anchor import protocol
from gpu_anchor.client import control
from gpu_anchor.client.channel import Channel

FORK = mp.get_context("fork")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _daemon_usage(pid: int) -> tuple[int, int]:
    """(resident KiB, open descriptors) of the daemon process."""
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


def _churn(worker: int, objects: int, seed: int) -> None:
    rng = random.Random(seed)
    c = gpu_anchor.connect("cpu", namespace=f"churn{worker % 2}")
    live = {}
    for i in range(objects):
        name = f"w{worker}.t{i}"
        shape = (rng.choice([1, 3, 100, 1000, 20_000, 300_000]),)
        t = c.tensor(name, shape, rng.choice([torch.float32, torch.bfloat16, torch.uint8]))
        t.fill_(i % 7)
        live[name] = t
        if len(live) > 20 or rng.random() < 0.5:  # drop a random one: freed through GC
            live.pop(rng.choice(list(live)))
    del t  # alive at exit would mean: keep it for the next worker
    for name in list(live):
        c.free(name)  # and the rest explicitly
    live.clear()
    c.close()
    os._exit(0)


def test_eight_clients_churn_ten_thousand_objects_without_leaks(host_daemon):
    path, proc = host_daemon
    probe = Channel("cpu", path)
    status = lambda: probe.request({"op": "status"})[0]  # noqa: E731
    status()
    base_rss, base_fds = _daemon_usage(proc.pid)
    workers = [FORK.Process(target=_churn, args=(w, 1250, w)) for w in range(8)]
    for p in workers:
        p.start()
    for p in workers:
        p.join(300)
        assert p.exitcode == 0
    st = status()
    assert st["object_bytes"] == 0 and st["reserved_bytes"] == 0 and st["segments"] == 0
    assert all(not ns["objects"] for ns in st["namespaces"].values())
    rss, fds = _daemon_usage(proc.pid)
    assert fds == base_fds, "descriptor leak in the daemon"
    assert rss - base_rss < 8 * 1024, f"daemon RSS grew by {rss - base_rss} KiB"


def _garbage(rng: random.Random) -> bytes:
    kind = rng.randrange(9)
    good = {"op": rng.choice(["bind", "free", "list", "export", "journal_get", "journal_commit", "drop",
                               "status", "hello", "nope", 7, None]),
            "namespace": rng.choice(["fz", "", None, 5, "x" * 300]),
            "objects": rng.choice([None, "x", [], [{"name": "a", "dtype": "float32", "shape": [rng.randint(-3, 9)]}],
                                   [{"name": rng.random(), "dtype": "int8", "shape": [1]}],
                                   [{"name": "big", "dtype": "uint8", "shape": [1 << 60]}]]),
            "names": rng.choice([None, ["a"], [["a", "x"]], [1, 2], "a"]),
            "segments": rng.choice([None, [1], [-1], ["a"], list(range(300))]),
            "puts": rng.choice([None, {"k": [0, 5]}, {"k": [-1, 2]}, {"k": [0, 1 << 40]}, [1]]),
            "keys": rng.choice([None, ["k"], "k", [1]]),
            "policy": rng.choice([None, "replace", "lookup", "evil"])}
    if kind == 0:
        return bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))  # noise
    if kind == 1:
        return protocol.MAGIC + struct.pack("<II", rng.randint(0, 1 << 31), rng.randint(0, 1 << 31))  # oversize
    if kind == 2:
        frame = protocol.encode(good, os.urandom(rng.randint(0, 16)))
        return frame[: rng.randint(1, len(frame) - 1)]  # truncated, then the client vanishes
    if kind == 3:
        body = b"[1,2,3]" if rng.random() < 0.5 else b"{not json"
        return protocol.PREFIX.pack(protocol.MAGIC, len(body), 0) + body
    return protocol.encode(good, os.urandom(rng.randint(0, 16)))  # well framed, hostile fields


def _connect_retrying(path: str) -> socket.socket:
    for _ in range(500):  # the accept backlog can be full while the daemon drains closed peers
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(5)
        try:
            sock.connect(path)
            return sock
        except BlockingIOError:
            sock.close()
            time.sleep(0.01)
    raise AssertionError("daemon stopped accepting connections")


def _fuzz(path: str, messages: int, seed: int) -> None:
    """Sends ``messages`` garbage frames over connections it opens, drops and abandons."""
    rng = random.Random(seed)
    sent = 0
    sock = None
    while sent < messages:
        if sock is None or rng.random() < 0.05:
            if sock is not None:
                sock.close()
            sock = _connect_retrying(path)
        payload = _garbage(rng)
        try:
            if rng.random() < 0.02:  # descriptors a client should never send
                r, w = os.pipe()
                sock.sendmsg([payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("2i", r, w))])
                os.close(r), os.close(w)
            else:
                sock.sendall(payload)
            sent += 1
            if payload.startswith(protocol.MAGIC) and rng.random() < 0.3:
                sock.close()  # vanish mid-request
                sock = None
        except OSError:
            sock.close()  # the daemon dropped us for a framing error: fine
            sock = None
    if sock is not None:
        sock.close()
    os._exit(0)


def test_fuzz_ten_thousand_malformed_messages(host_daemon):
    path, proc = host_daemon
    c = gpu_anchor.connect("cpu", namespace="fz-good")
    keep = c.tensor("keep", (100,), torch.float32)
    keep.fill_(5)
    base_fds = _daemon_usage(proc.pid)[1]
    # The garbage comes from another process so that the daemon's own contract can say when
    # it has handled all of it (await_gone: every frame that process sent whole), before the
    # namespaces its well-framed garbage made are counted and dropped.
    fuzzer = FORK.Process(target=_fuzz, args=(path, 10_000, 7))
    fuzzer.start()
    fuzzer.join(300)
    assert fuzzer.exitcode == 0, f"fuzzer ended with {fuzzer.exitcode}"
    control.await_gone("cpu", path, fuzzer.pid)
    assert proc.poll() is None, "daemon died"
    assert c.tensor("keep", (100,), torch.float32).tolist() == [5.0] * 100
    st = c.status()
    assert set(st["namespaces"]) >= {"fz-good"} and st["connections"] >= 1
    for ns in st["namespaces"]:
        if ns != "fz-good":
            c._channel.request({"op": "drop", "namespace": ns})
    assert c.status()["object_bytes"] == 400
    deadline = time.monotonic() + 60  # closed segments' descriptors go as the daemon notices
    while _daemon_usage(proc.pid)[1] > base_fds and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _daemon_usage(proc.pid)[1] <= base_fds, "fuzz connections or segments leaked descriptors"


def test_well_framed_bad_requests_get_clear_errors(host_daemon):
    path, _ = host_daemon
    ch = Channel("cpu", path)
    for header, code in [({"op": "nope"}, "bad_request"), ({"op": "bind", "namespace": 3}, "bad_request"),
                         ({"op": "bind", "namespace": "n", "objects": [{"name": "x", "dtype": "f", "shape": [1]}]},
                          "bad_request"),
                         ({"op": "bind", "namespace": "n",
                           "objects": [{"name": "huge", "dtype": "uint8", "shape": [1 << 55]}]}, "out_of_memory")]:
        with pytest.raises(gpu_anchor.AnchorError) as e:
            ch.request(header)
        assert type(e.value).code == code or e.value.code == code, (header, e.value)
    assert ch.request({"op": "ping"})[0]["ok"]


_NOBODY = 65534
_CLIENT = ("import sys; sys.path.insert(0, {repo!r})\n"
           "from gpu_anchor.client.channel import Channel\n"
           "from gpu_anchor import errors\n"
           "try:\n"
           "    Channel('cpu', {path!r})\n"
           "except errors.PermissionDenied as e:\n"
           "    print('REFUSED:', e); sys.exit(3)\n"
           "print('CONNECTED')\n")


def _run_as_nobody(path: str) -> subprocess.CompletedProcess:
    for exe in (sys.executable, "/usr/bin/python3"):
        try:
            r = subprocess.run([exe, "-c", _CLIENT.format(repo=REPO, path=path)], user=_NOBODY, group=_NOBODY,
                               capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
        except PermissionError:
            continue
        if "REFUSED" in r.stdout or "CONNECTED" in r.stdout:
            return r
    pytest.skip("no Python interpreter that uid nobody may run")


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to uid nobody needs root")
def test_other_user_is_refused_by_directory_and_by_peer_uid():
    d = tempfile.mkdtemp(prefix="ga-uid-", dir="/tmp")
    path = os.path.join(d, "cpu.sock")
    from gpu_anchor.client import control
    proc = control.start("cpu", path)
    try:
        assert (os.stat(d).st_mode & 0o777) == 0o700
        r = _run_as_nobody(path)  # layer 1: the private directory
        assert r.returncode == 3 and "belongs to another user" in r.stdout, r.stdout + r.stderr
        os.chmod(d, 0o711)  # simulate a misconfigured directory: SO_PEERCRED must still refuse
        os.chmod(path, 0o777)
        r = _run_as_nobody(path)
        assert r.returncode == 3 and "belongs to uid 0" in r.stdout and f"uid {_NOBODY}" in r.stdout, r.stdout
        assert control.ping("cpu", path) is not None  # and the daemon keeps serving its owner
    finally:
        control.stop("cpu", path)
        proc.wait(10)


def test_cli_status_drop_stop(socket_dir):
    env = dict(os.environ, PYTHONPATH=REPO)
    cli = [sys.executable, "-m", "gpu_anchor.cli"]
    out = subprocess.run(cli + ["daemon", "--device", "cpu", "--detach"], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and "started" in out.stdout, out.stderr
    c = gpu_anchor.connect("cpu", namespace="clijob")
    t = c.tensor("model.w", (256, 256), torch.float32)
    c.journal.commit({"cursor": b"1"})
    st = json.loads(subprocess.run(cli + ["status", "--json"], env=env, capture_output=True, text=True,
                                   timeout=60, check=True).stdout)
    ns = st["daemons"][0]["namespaces"]["clijob"]
    assert ns["objects"][0]["name"] == "model.w" and ns["journal_keys"] == ["cursor"]
    human = subprocess.run(cli + ["status"], env=env, capture_output=True, text=True, timeout=60).stdout
    assert "clijob" in human and "model.w" in human
    drop = subprocess.run(cli + ["drop", "clijob"], env=env, capture_output=True, text=True, timeout=60)
    assert "1 object" in drop.stdout
    assert c.names() == []
    del t
    c.close()
    stop = subprocess.run(cli + ["stop"], env=env, capture_output=True, text=True, timeout=60)
    assert "stopped" in stop.stdout
    with pytest.raises(gpu_anchor.DaemonUnavailable):
        gpu_anchor.connect("cpu")
