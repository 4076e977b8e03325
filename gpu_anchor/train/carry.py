"""What an iteration carries to the next besides tensors: RNG state and the user's loop data.

Captured at the gradient-finalization boundary of step ``s`` (= the state at the start
of iteration ``s + 1``, since the optimizer consumes no randomness) and committed with
the step, so a worker that resumes at ``s + 1`` restores exactly that.
"""
from __future__ import annotations

import pickle

import torch

from . import amp


def capture(loop_state: dict, device, scaler=None) -> bytes:
    """``device=None``: do not track RNG; else the CPU generator and, for CUDA, that device's.
    ``scaler``: a GradScaler whose state (scale, growth tracker) rides along."""
    rng = {}
    if device is not None:
        rng["cpu"] = torch.get_rng_state().numpy().tobytes()
        if device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(device).numpy().tobytes()
    out = {"rng": rng, "loop": loop_state}
    if scaler is not None:
        out["scaler"] = amp.state(scaler)
    return pickle.dumps(out)


def restore(raw: bytes, device, scaler=None) -> dict:
    """Restore the RNG state (and ``scaler``'s); returns the loop data."""
    carry = pickle.loads(raw)
    amp.restore(scaler, carry.get("scaler"))
    rng = carry["rng"]
    if "cpu" in rng:
        torch.set_rng_state(torch.frombuffer(bytearray(rng["cpu"]), dtype=torch.uint8))
    if "cuda" in rng and device.type == "cuda":
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(rng["cuda"]), dtype=torch.uint8), device)
    return carry["loop"]
