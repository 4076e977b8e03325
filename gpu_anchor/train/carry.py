"""What an iteration carries to the next besides tensors: RNG state and the user's loop data.

Captured at the gradient-finalization boundary of step ``s`` (= the state at the start
of iteration ``s + 1``, since the optimizer consumes no randomness) and committed with
the step, so a worker that resumes at ``s + 1`` restores exactly that.
"""
from __future__ import annotations

import pickle

import torch


def capture(loop_state: dict, device) -> bytes:
    """``device=None``: do not track RNG; else the CPU generator and, for CUDA, that device's."""
    rng = {}
    if device is not None:
        rng["cpu"] = torch.get_rng_state().numpy().tobytes()
        if device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(device).numpy().tobytes()
    return pickle.dumps({"rng": rng, "loop": loop_state})


def restore(raw: bytes, device) -> dict:
    """Restore the RNG state; returns the loop data."""
    carry = pickle.loads(raw)
    rng = carry["rng"]
    if "cpu" in rng:
        torch.set_rng_state(torch.frombuffer(bytearray(rng["cpu"]), dtype=torch.uint8))
    if "cuda" in rng and device.type == "cuda":
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(rng["cuda"]), dtype=torch.uint8), device)
    return carry["loop"]
