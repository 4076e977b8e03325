"""The training protocol's settings, as one record (the supervisor's and the engine's are
``launch.config.SupervisorConfig`` and ``serve.engine.EngineConfig``).

    opt = AnchoredOptimizer(torch.optim.AdamW(params), config=StepProtocolConfig(progress="journal"))

``AnchoredOptimizer``'s keyword arguments of the same names fill this record when no
``config`` is given; ``opt.config`` is what the optimizer runs with.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

PROGRESS = ("journal", "device")
AUTO = None      # lend_grad_bytes / grads_in_place: decided by the optimizer (StepProtocolConfig)


@dataclass(frozen=True)
class StepProtocolConfig:
    """``prefix``: the optimizer's names in its namespace (two optimizers need two prefixes).
    ``chunk_bytes``: undo bytes per chunk (None: both slots <= 2 % of the anchored state; a
    restart keeps the first run's value).  ``progress``: where the per-chunk cursor lives,
    ``"journal"`` or ``"device"`` (None: device on CUDA, journal on the host).  ``track_rng``:
    journal torch's CPU and CUDA RNG state with each step.  ``fused_update``: with
    ``progress="device"`` on CUDA, update Adam/AdamW chunks with one Triton kernel that also
    writes their undo image (``fused_adam``), where Triton is importable and the kernel was
    checked bit for bit against torch's own update on this device; False: always the undo
    copy + torch's update.  ``lend_grad_bytes``: in one process with ``zero_grad()``'s default
    ``set_to_none=True``, lend up to this many bytes of the anchored gradient buffers, which hold
    nothing between ``zero_grad()`` and the next backward, to the last activations the forward
    saves (``grad_lending``): the peak falls by what is lent, and each byte lent is copied once
    a step; a budget of at least the gradients' size lends all that fits; 0: off.
    ``grads_in_place``: in that same setting, ``nn.Linear`` layers over the anchored parameters
    write their weight's gradient with the GEMM that makes it straight into its anchored buffer,
    instead of torch making it elsewhere and the optimizer copying it home (``grads_in_place``):
    one read and one write of those gradients' bytes fewer a step, the same values.  The layers'
    ``forward`` is replaced on the instances (found during the first forward); False: off.

    None, the default of both, is ``AUTO``: on (every gradient byte lendable; the layers
    written in place) where they apply and pay, that is on a CUDA device in one process with
    fresh gradients, and off elsewhere without a word: on the CPU (no device copy to save, and
    the Python they add per layer is the step's own time), under DDP across ranks and under
    FSDP2 (the framework's gradient buffers).  An explicit value where it cannot apply warns.
    ``opt.config`` holds what was decided (``resolve``)."""

    prefix: str = "train"
    chunk_bytes: int | None = None
    progress: str | None = None
    track_rng: bool = True
    fused_update: bool = True
    lend_grad_bytes: int | None = AUTO
    grads_in_place: bool | None = AUTO

    def __post_init__(self) -> None:
        if not isinstance(self.prefix, str) or not self.prefix:
            raise ValueError(f"prefix must be a non-empty string, got {self.prefix!r}")
        if self.chunk_bytes is not None and (not isinstance(self.chunk_bytes, int) or self.chunk_bytes <= 0):
            raise ValueError(f"chunk_bytes must be a positive integer, got {self.chunk_bytes!r}")
        lend = self.lend_grad_bytes
        if lend is not AUTO and (isinstance(lend, bool) or not isinstance(lend, int) or lend < 0):
            raise ValueError(f"lend_grad_bytes must be a byte count >= 0 or None (automatic), got {lend!r}")
        if not isinstance(self.fused_update, bool):
            raise ValueError(f"fused_update must be True or False, got {self.fused_update!r}")
        if self.grads_in_place is not AUTO and not isinstance(self.grads_in_place, bool):
            raise ValueError(f"grads_in_place must be True, False or None (automatic), got {self.grads_in_place!r}")
        if self.progress is not None and self.progress not in PROGRESS:
            raise ValueError(f"progress must be one of {PROGRESS} or None, got {self.progress!r}")

    def resolve(self, applies: bool, grad_bytes: int) -> "StepProtocolConfig":
        """This record with ``AUTO`` decided: ``applies`` (a CUDA device, one process, fresh
        gradients) turns both on, every one of the ``grad_bytes`` gradient bytes lendable."""
        if self.lend_grad_bytes is not AUTO and self.grads_in_place is not AUTO:
            return self
        return replace(self, lend_grad_bytes=(grad_bytes if applies else 0) if self.lend_grad_bytes is AUTO
                       else self.lend_grad_bytes,
                       grads_in_place=applies if self.grads_in_place is AUTO else self.grads_in_place)
