"""gpu-anchor: keep PyTorch jobs' GPU state alive across worker crashes.

Public API: ``connect`` (this module), ``managed_scope``, ``train.AnchoredOptimizer``,
and the ``gpu-anchor`` command.  Importing this package does not import torch;
the names that need it load it on first use.
"""
from __future__ import annotations

__version__ = "0.1.0"

from . import train  # noqa: F401  (lazy: gpu_anchor.train.AnchoredOptimizer loads torch on first use)
from .errors import AnchorError, ConflictError, DaemonUnavailable, OutOfMemoryError, PermissionDenied


def connect(device=None, namespace=None, socket=None):
    """See :func:`gpu_anchor.client.connect`."""
    from .client import connect as _connect
    return _connect(device, namespace, socket)


def managed_scope(namespace=None, on_conflict="error", require=False):
    """See :func:`gpu_anchor.scope.managed_scope`."""
    from .scope import managed_scope as _managed_scope
    return _managed_scope(namespace, on_conflict, require=require)


__all__ = ["managed_scope", "AnchorError", "ConflictError", "DaemonUnavailable", "OutOfMemoryError", "PermissionDenied",
           "connect", "__version__"]
