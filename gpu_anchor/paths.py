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
