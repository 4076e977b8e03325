"""The checks of the OpenAI / vLLM request surface's values, and the error they raise
(torch-free): ``ApiError``, HTTP 4xx/5xx with OpenAI's JSON body
(``{"error": {"message", "type", "param", "code"}}``), and ``bad(param, message)``, the 400
that names the field.  Each ``*_field`` check returns
the value checked or raises ``bad`` naming the field and what it must be."""
from __future__ import annotations

_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 500: "InternalServerError",
          503: "ServiceUnavailableError"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "Error"), "param": self.param,
                          "code": self.status}}


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param)


# ------------------------------------------------------------------ value checks
def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) or isinstance(v, float) and v.is_integer()


def int_field(name: str, v, lo: int | None = None, hi: int | None = None) -> int:
    if not is_int(v):
        raise bad(name, f"must be an integer, got {v!r}")
    v = int(v)
    if lo is not None and v < lo or hi is not None and v > hi:
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise bad(name, f"must be {rng}, got {v}")
    return v


def number_field(name: str, v, lo: float, hi: float, lo_open: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise bad(name, f"must be a number, got {v!r}")
    if not (lo < v if lo_open else lo <= v) or v > hi:
        raise bad(name, f"must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}")
    return float(v)


def bool_field(name: str, v) -> bool:
    if not isinstance(v, bool):
        raise bad(name, f"must be true or false, got {v!r}")
    return v


def object_field(name: str, v) -> dict:
    if not isinstance(v, dict):
        raise bad(name, "must be an object")
    return v


def ids_field(name: str, v, vocab_size: int) -> list[int]:
    if not isinstance(v, list) or not all(is_int(t) for t in v):
        raise bad(name, "must be a list of token ids")
    out = [int(t) for t in v]
    for t in out:
        if not 0 <= t < vocab_size:
            raise bad(name, f"token id {t} is outside the vocabulary (size {vocab_size})")
    return out


def logit_bias_field(v, vocab_size: int) -> list[list]:
    """OpenAI's ``{"token id": bias}``, biases in [-100, 100]."""
    out = []
    for k, b in object_field("logit_bias", v).items():
        t = int(k) if isinstance(k, str) and k.strip().lstrip("-").isdigit() else None
        if t is None or not 0 <= t < vocab_size:
            raise bad("logit_bias", f"key {k!r} is not a token id of this model (0 to {vocab_size - 1})")
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100 <= b <= 100:
            raise bad("logit_bias", f"the bias of token {k} must be a number in [-100, 100], got {b!r}")
        out.append([t, float(b)])
    return out
