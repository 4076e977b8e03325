"""Journal keys that more than one layer reads or writes (torch-free; the contract in
docs/supervisor.md).  A key here is gpu-anchor's, in every job namespace; a job's own keys
never start with ``gpu_anchor/``.

- ``STEP_KEY``: the committed step (ASCII integer), written in the same atomic commit that
  makes the step durable (the training protocol; a custom loop does it itself).  The
  supervisor reads it (crash loops, hangs, status), checkpoints happen only at it.
- ``INCONSISTENT_KEY``: a consistency protocol that finds state it cannot roll back writes
  its reason here (UTF-8), so that the supervisor restores instead of restarting in place.
- ``RESTORED_KEY``: the checkpoint step a namespace was restored from.
- ``RESTORING_KEY``: an on-demand restore of that step is still streaming in (a crash now
  leaves the namespace incomplete: restore again).
- ``TOUCH_KEY``: the first-write order of the last step (the checkpoint copier's order).
"""
STEP_KEY = "gpu_anchor/step"
INCONSISTENT_KEY = "gpu_anchor/inconsistent"
RESTORED_KEY = "gpu_anchor/restored_from"
RESTORING_KEY = "gpu_anchor/checkpoint/restoring"
TOUCH_KEY = "gpu_anchor/checkpoint/touch_order"
