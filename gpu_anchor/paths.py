"""Where daemons listen (torch-free).

Sockets live in one per-user directory, mode 0700, so only the owner can even
reach them; the daemon also checks each peer's uid (SO_PEERCRED).  Order of
precedence for the directory: ``GPU_ANCHOR_SOCKET_DIR``, then
``$XDG_RUNTIME_DIR/gpu-anchor``, then ``/tmp/gpu-anchor-<uid>``.  A single
socket can be named outright with ``GPU_ANCHOR_SOCKET``.
"""
from __future__ import annotations

import os
import re
import stat

_DEVICE_RE = re.compile(r"^(cpu|cuda:(\d+))$")


def normalize_device(device: object) -> str:
    """``'cuda'`` → ``'cuda:0'``; accepts torch.device-like objects via ``str()``."""
    text = str(device)
    if text == "cuda":
        text = "cuda:0"
    if not _DEVICE_RE.match(text):
        raise ValueError(f"device must be 'cpu' or 'cuda:N', got {device!r}")
    return text


def socket_dir() -> str:
    explicit = os.environ.get("GPU_ANCHOR_SOCKET_DIR")
    if explicit:
        return explicit
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return os.path.join(runtime, "gpu-anchor")
    return f"/tmp/gpu-anchor-{os.getuid()}"


def socket_name(device: str) -> str:
    return normalize_device(device).replace(":", "") + ".sock"


def default_socket(device: str) -> str:
    return os.path.join(socket_dir(), socket_name(device))


def ensure_private_dir(path: str) -> None:
    """Create ``path`` with mode 0700, or check that an existing one is ours and private."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.stat(path)
    if st.st_uid != os.getuid():
        raise PermissionError(
            f"socket directory {path} belongs to uid {st.st_uid}, not to you (uid {os.getuid()}); "
            "choose another with --socket or GPU_ANCHOR_SOCKET_DIR")
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(path, 0o700)


# A daemon holds an exclusive flock on ``<socket>.lock`` for its whole life and writes its
# identity there, so a client can tell "starting, not yet listening" from "dead, stale
# socket" without touching the lock (probing with flock could make a starting daemon fail).
def lock_path(socket_path: str) -> str:
    return socket_path + ".lock"


def process_identity(pid: int) -> str | None:
    """``"<pid> <start time>"``: stays unique when the pid is reused; None if no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] == "Z":
        return None
    return f"{pid} {fields[19]}"  # field 22 of stat: start time in clock ticks since boot


def daemon_alive(socket_path: str) -> bool:
    """True while the daemon that took ``socket_path``'s lock runs (listening yet or not)."""
    path = lock_path(socket_path)
    try:
        with open(path) as f:
            owner = f.read().split()
    except OSError:
        return False
    if len(owner) == 2 and owner[0].isdigit() and process_identity(int(owner[0])) == " ".join(owner):
        return True
    # A starting daemon empties the file before it writes who it is: between the two, the
    # file names nobody, but the daemon already holds the lock (seen by the kernel's lock table)
    return _flock_held(path)


def _flock_held(path: str) -> bool:
    """Someone holds a granted flock on ``path`` (read from ``/proc/locks``, which takes no lock)."""
    try:
        st = os.stat(path)
        with open("/proc/locks") as f:
            table = f.read().splitlines()
    except OSError:
        return False
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for line in table:       # "1: FLOCK  ADVISORY  WRITE 1234 fe:00:5678 0 EOF"; waiters have "->"
        parts = line.split()
        if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5] == want:
            return True
    return False
