"""The optimizer-step protocol as a plain-Python state machine (no torch).

The journal of the namespace holds, under ``<prefix>/``:

``state``    JSON ``{"step": s, "phase": "idle"|"applying", "cursor": c, "undo": u, "chunks": N}``
             ``step`` = optimizer steps committed so far (the next step to run is ``s``).
``boundary`` the in-flight step's redo metadata, written at the gradient-finalization
             boundary (which parameters have gradients, the hyper-parameters used,
             the per-parameter step counts before the step, the carried loop state).
``committed`` what the last committed step leaves behind for the next iteration
             (per-parameter step counts, hyper-parameters after scheduler steps, scheduler
             state, carried RNG / loop state, ``step_offset``: what a loaded ``state_dict``
             adds to ``s`` for ``completed_steps``; the protocol's own numbers are ``s``).

The undo buffer has two slots; chunk ``i`` is saved in slot ``i % 2``.  Invariant, at
every instant, for the durable journal state ``(phase, cursor=c, undo=u)``:

* ``idle``: parameters and optimizer state are exactly the result of ``step`` steps.
* ``applying``: chunks ``< c`` hold their post-step values, chunks ``> c`` their
  pre-step values, the anchored gradients are the finalized gradients of step ``step``
  (the redo log), and when ``u == c`` slot ``c % 2`` holds chunk ``c``'s complete
  pre-step image (chunk ``c`` itself may be half written).

Normal path (one journal commit per chunk, because the copy of chunk ``i+1`` goes to
the *other* slot and so may be made before chunk ``i`` is committed)::

    copy chunk 0 -> slot 0; wait
    commit {applying, cursor 0, undo 0, boundary}                 # gradient finalization
    for i in 0..N-1:
        apply chunk i                                              # optimizer numerics
        if i+1 < N: copy chunk i+1 -> slot (i+1)%2
        wait
        commit {cursor i+1, undo i+1}   or, for the last chunk, {idle, step+1, committed}

Recovery (``recover``): ``idle`` -> nothing to do; ``applying`` -> if ``undo == cursor``
copy slot ``cursor % 2`` back over chunk ``cursor``; then run the normal loop from
``cursor`` with the redo metadata of ``boundary``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

IDLE = "idle"
APPLYING = "applying"

#: The fault points of the paper's five phases (plus the boundary itself), in order.
PHASES = ("before_boundary",   # after backward, before the gradients are finalized
          "after_boundary",    # the boundary (redo log) committed, before the all-rank barrier
          "before_update",     # chunk i's undo image is durable, nothing of chunk i written
          "mid_chunk",         # chunk i half written
          "after_update",      # chunk i fully written, its cursor not yet committed
          "after_commit",      # cursor i+1 (or the whole step) committed
          "between_steps")     # the step is committed; the next iteration has not begun


def key(prefix: str, name: str) -> str:
    return f"{prefix}/{name}"


@dataclass(frozen=True)
class StepState:
    step: int = 0
    phase: str = IDLE
    cursor: int = 0
    undo: int = -1
    chunks: int = 0

    def encode(self) -> bytes:
        return json.dumps({"step": self.step, "phase": self.phase, "cursor": self.cursor,
                           "undo": self.undo, "chunks": self.chunks}, sort_keys=True).encode()

    @classmethod
    def decode(cls, raw: bytes | None) -> "StepState":
        if raw is None:
            return cls()
        d = json.loads(raw)
        st = cls(int(d["step"]), d["phase"], int(d["cursor"]), int(d["undo"]), int(d["chunks"]))
        st.check()
        return st

    def check(self) -> None:
        if self.phase not in (IDLE, APPLYING):
            raise ValueError(f"unknown training phase {self.phase!r}")
        if self.step < 0 or self.chunks < 0:
            raise ValueError(f"corrupt training state {self}")
        if self.phase == APPLYING and not (0 <= self.cursor < max(1, self.chunks) and self.undo in (-1, self.cursor)):
            raise ValueError(f"corrupt training state {self}: cursor/undo out of range")

    # ------------------------------------------------------------------ transitions
    def begin(self, chunks: int, device_progress: bool = False) -> "StepState":
        """Gradient-finalization boundary: step ``self.step`` goes in flight, chunk 0 saved.

        With ``device_progress`` the cursor lives in the device word (``undo`` stays -1 here).
        """
        if self.phase != IDLE:
            raise RuntimeError("a step is already in flight; recover it first")
        if chunks < 1:
            raise ValueError("a step needs at least one chunk")
        return StepState(self.step, APPLYING, 0, -1 if device_progress else 0, chunks)

    def finish(self) -> "StepState":
        """The whole step is written (device-progress mode): commit it."""
        if self.phase != APPLYING:
            raise RuntimeError("no step in flight")
        return StepState(self.step + 1, IDLE, 0, -1, self.chunks)

    def chunk_done(self, i: int) -> "StepState":
        """Chunk ``i`` written (and chunk ``i+1`` saved if it exists); the last one commits the step."""
        if self.phase != APPLYING or i != self.cursor:
            raise RuntimeError(f"chunk {i} done out of order in {self}")
        if i + 1 == self.chunks:
            return StepState(self.step + 1, IDLE, 0, -1, self.chunks)
        return StepState(self.step, APPLYING, i + 1, i + 1, self.chunks)

    def discard(self) -> "StepState":
        """Forget an in-flight step whose chunks were never touched (multi-rank agreement)."""
        return StepState(self.step, IDLE, 0, -1, self.chunks)

    # ------------------------------------------------------------------ recovery
    @property
    def in_flight(self) -> bool:
        return self.phase == APPLYING

    def rollback_chunk(self) -> int | None:
        """The chunk to restore from its undo slot before redoing, if any."""
        if self.phase == APPLYING and self.undo == self.cursor:
            return self.cursor
        return None


def slot_of(chunk: int) -> int:
    return chunk % 2


def describe(values: dict[str, bytes], prefix: str = "train") -> dict:
    """What the journal says about the training state (the supervisor's fallback hook).

    ``consistent``: anchored state is either a committed step or an in-flight step that
    the next worker completes from its redo log.  ``completed_steps`` is what training
    resumes at once that is done.
    """
    raw = values.get(key(prefix, "state"))
    if raw is None:
        return {"present": False, "consistent": True, "completed_steps": 0, "phase": IDLE,
                "in_flight_step": None, "cursor": None, "chunks": None}
    try:
        st = StepState.decode(raw)
    except (ValueError, KeyError, TypeError) as e:
        return {"present": True, "consistent": False, "error": str(e), "completed_steps": None}
    ok = not st.in_flight or key(prefix, "boundary") in values
    # a loaded state_dict's (state_dict.py); with no step, the next worker starts afresh
    offset = _offset(values.get(key(prefix, "committed"))) if st.step or st.in_flight else 0
    return {"present": True, "consistent": ok, "phase": st.phase,
            "completed_steps": offset + (st.step + (1 if st.in_flight else 0) if ok else st.step),
            "committed_steps": st.step,
            "in_flight_step": st.step if st.in_flight else None,
            "cursor": st.cursor if st.in_flight else None, "chunks": st.chunks}


def _offset(raw: bytes | None) -> int:
    try:
        return int(json.loads(raw).get("step_offset", 0)) if raw else 0
    except (ValueError, TypeError, AttributeError):
        return 0


# ---------------------------------------------------------------------- device progress word
# ``progress="device"`` (the default on CUDA): the per-chunk cursor is not a journal
# commit but one int64 in anchored device memory, written by the device stream itself
# between the kernels, and the host never waits for the device inside a step:
#
#     host:   commit {applying s, boundary s}        (lands the pending commit of step s-1 too)
#     stream: [backward s] [barrier] copy chunk 0 -> slot 0 ; word <- (s, 0) ; apply chunk 0 ;
#             copy chunk 1 -> slot 1 ; word <- (s, 1) ; apply chunk 1 ; ... ; word <- (s, N)
#     host:   keeps {idle s+1, committed, ...} pending; it lands with the boundary of step
#             s+1, after the device has passed word (s, N) — by then it always has.
#
# Stream order makes ``word == (s, i)`` imply "backward of step s (and the multi-rank
# boundary barrier) finished, chunks < i written, slot i%2 holds chunk i's complete
# pre-image, chunk i maybe half written"; ``(s, N)``: the whole step is written.  A word
# of an earlier step means the device never reached the boundary of step s, so the
# gradients may be incomplete and step s is discarded (its iteration is redone).  A
# single aligned 8-byte store is atomic: a kill never leaves a torn word.  The journal
# is never ahead of the device (the boundary commit only promises that the redo log
# will be final when the word moves) and at most one step behind it.
_CURSOR_BITS = 20


def encode_progress(step: int, cursor: int) -> int:
    if not 0 <= cursor < (1 << _CURSOR_BITS):
        raise ValueError("too many chunks")
    return (step << _CURSOR_BITS) | cursor


def decode_progress(word: int) -> tuple[int, int]:
    if word < 0:
        return -1, 0
    return word >> _CURSOR_BITS, word & ((1 << _CURSOR_BITS) - 1)


def device_resume_point(state: StepState, word: int, last_started: int | None = None) -> int | None:
    """Where the device left the in-flight step: ``None`` if it never reached its boundary
    (discard the step), else the cursor ``c``: chunk ``c`` is rolled back from its slot
    and chunks ``c..N-1`` redone; ``c == N`` means only the commit is missing.

    A fused step moves the word only at its start and end; ``last_started`` (the highest
    chunk with a block tagged for this step, ``FusedAdam.last_started``) is its cursor
    in between."""
    if not state.in_flight:
        raise RuntimeError("no step in flight")
    step, cursor = decode_progress(word)
    if step < state.step:
        if last_started is not None:
            raise ValueError(f"chunk {last_started} of step {state.step} is tagged, but the device word "
                             f"{word:#x} never showed the step")
        return None
    if step > state.step or cursor > state.chunks:
        raise ValueError(f"device progress word {word:#x} (step {step}, cursor {cursor}) does not fit {state}")
    if last_started is not None and cursor < state.chunks:
        if last_started >= state.chunks:
            raise ValueError(f"chunk {last_started} tagged, but the step has {state.chunks} chunks")
        cursor = max(cursor, last_started)
    return cursor
