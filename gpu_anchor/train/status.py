"""The supervisor's fallback hook: read the training protocol state without torch.

``training_state(device="cpu", namespace=None, prefix="train")`` asks the device's
daemon for the journal and says whether anchored training state is consistent (a
committed step, or an in-flight step the next worker completes from its redo log)
and which step training resumes at.  Imports neither torch nor the client.
"""
from __future__ import annotations

import os

from gpu_anchor import protocol as wire
from gpu_anchor.client.channel import Channel

from .protocol import describe


def training_state(device: str = "cpu", namespace: str | None = None, prefix: str = "train",
                   socket: str | None = None) -> dict:
    """``describe()`` of the journal of ``namespace`` (default as ``gpu_anchor.connect`` picks it)."""
    if namespace is None:
        namespace = os.environ.get("GPU_ANCHOR_NAMESPACE", "default")
        if device == "cpu" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            namespace = f"{namespace}/rank{os.environ.get('RANK', '0')}"
    ch = Channel(device, socket)
    try:
        reply, blob, _ = ch.request({"op": "journal_get", "prefix": prefix + "/", "namespace": namespace})
        return describe(wire.unpack_blobs(reply["values"], blob), prefix)
    finally:
        ch.close()
