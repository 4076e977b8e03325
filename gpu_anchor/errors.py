"""Errors raised by gpu-anchor clients (torch-free); the daemon raises ``BadRequest`` too, when it
validates a message, and replies with its code and details."""
from __future__ import annotations


class AnchorError(RuntimeError):
    """Base class; ``code`` is the daemon's error code where one exists."""

    code = "error"

    def __init__(self, message: str, **details) -> None:
        super().__init__(message)
        self.details = details


class DaemonUnavailable(AnchorError, ConnectionError):
    code = "unavailable"


class PermissionDenied(AnchorError, PermissionError):
    code = "permission"


class ConflictError(AnchorError, ValueError):
    """A name is anchored with another dtype or shape; the anchored data was left untouched."""

    code = "conflict"

    @property
    def conflicts(self) -> list[dict]:
        return self.details.get("conflicts", [])


class OutOfMemoryError(AnchorError, MemoryError):
    code = "out_of_memory"


class VersionMismatch(AnchorError):
    code = "version_mismatch"


class BadRequest(AnchorError, ValueError):
    """A request field is invalid; ``details``: ``field`` (e.g. ``shape[1]``) and ``name`` (the object)."""

    code = "bad_request"


_BY_CODE = {cls.code: cls for cls in (PermissionDenied, ConflictError, OutOfMemoryError, VersionMismatch, BadRequest)}


def from_reply(error: dict) -> AnchorError:
    code = error.get("code", "error") if isinstance(error, dict) else "error"
    message = error.get("message", str(error)) if isinstance(error, dict) else str(error)
    details = {k: v for k, v in error.items() if k not in ("code", "message")} if isinstance(error, dict) else {}
    return _BY_CODE.get(code, AnchorError)(message, **details)
