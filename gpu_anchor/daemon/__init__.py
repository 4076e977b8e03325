"""The per-device memory daemon.  Never imports torch: it must stay small, start fast,
and keep working whatever state the workers' CUDA contexts are in."""
