"""Concurrent checkpoint and restore of anchored state (the PhoenixOS half); see docs/checkpoint.md.

- ``writeset.WriteSetTracker`` — per-op write sets from aten schemas (one tracker, many listeners)
- ``concurrent.ConcurrentCheckpointer`` — soft copy-on-write / soft recopy checkpoints while the job runs
- ``validation.Validator`` — checksums around op groups; catches undeclared writes
- ``guard.GroupGuard`` — group copy-on-write: a step is all-or-nothing across a crash
- ``restore.OnDemandRestore`` — the job runs before its state is loaded
"""
