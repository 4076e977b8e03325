"""``gpu_anchor.fdwait``: waits on descriptors numbered above ``select``'s 1024, and the
descriptor limit a host-backend client raises (it holds one descriptor per anchored object)."""
import os
import resource
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from gpu_anchor import fdwait

HIGH = 1500      # above FD_SETSIZE, where select.select raised ValueError


@pytest.fixture
def high_fd_room():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= HIGH + 10:
        pytest.skip(f"the hard descriptor limit ({hard}) leaves no room above {HIGH}")
    if soft != resource.RLIM_INFINITY and soft <= HIGH + 10:
        resource.setrlimit(resource.RLIMIT_NOFILE, (HIGH + 64, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_readable_above_select_s_limit(high_fd_room):
    r, w = os.pipe()
    high = os.dup2(r, HIGH)
    os.close(r)
    a, b = socket.socketpair()
    try:
        assert fdwait.readable([high], 0) == []
        t0 = time.monotonic()
        assert fdwait.readable([high], 0.0002) == []          # shorter than poll's millisecond
        assert time.monotonic() - t0 < 0.5
        os.write(w, b"x")
        assert fdwait.readable([a, high, high], 0.05) == [high, high]      # the objects given, in order
        b.send(b"y")
        assert fdwait.readable([a, high], None) == [a, high]
        b.close()
        a.recv(1)
        assert fdwait.readable([a], 0) == [a]                 # a hung-up peer reads as readable
    finally:
        for fd in (high, w):
            os.close(fd)
        a.close()


def test_a_dead_child_s_pidfd_is_readable(high_fd_room):
    if not hasattr(os, "pidfd_open"):
        pytest.skip("no pidfd_open here")
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    pidfd = os.dup2(os.pidfd_open(child.pid), HIGH + 1)
    try:
        assert fdwait.readable([pidfd], 0) == []
        child.stdin.close()
        assert fdwait.readable([pidfd], 30) == [pidfd]
    finally:
        child.wait()
        os.close(pidfd)


CLIENT = textwrap.dedent("""
    import os, resource, sys
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))     # a low soft limit, as on many hosts
    import torch, gpu_anchor
    c = gpu_anchor.connect("cpu", namespace="fds")
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] > 1100    # raised by the host client
    objs = c.bind([(f"t{i}", (4,), torch.float32) for i in range(1100)], "match_or_create")
    late = gpu_anchor.connect("cpu", namespace="fds")          # its connection's descriptor is above 1024
    assert late._channel._sock.fileno() > 1100, late._channel._sock.fileno()
    assert late._channel.peer_closed() is False
    late.journal.commit({"k": b"v"})
    print("ok", len(os.listdir("/proc/self/fd")))
""")


def test_a_client_holding_over_a_thousand_objects(host_daemon):
    """A host-backend process anchoring 1 100 objects from a soft limit of 256: the client raised
    the limit, and a connection it opens afterwards (numbered above 1024) works, including the
    idle check ``select`` refused there."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip(f"the hard descriptor limit ({hard}) is too low for this test")
    out = subprocess.run([sys.executable, "-c", CLIENT], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "ok"
