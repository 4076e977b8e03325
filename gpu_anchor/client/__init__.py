"""Worker-side access to anchored memory.  ``channel`` and ``control`` are torch-free; the rest loads torch."""


def __getattr__(name):
    if name in ("Bound", "Client", "ObjectInfo", "connect"):
        from . import client
        return getattr(client, name)
    raise AttributeError(name)


__all__ = ["Bound", "Client", "ObjectInfo", "connect"]
