"""A ``multiprocessing`` forkserver context with a given preload, for tests.

The forkserver is one per process, and the first user fixes its preload for the rest of the
pytest session.  A test whose children need other modules would then import them in every
child: the serving kill campaign (about 45 engine incarnations) took 80 s after the benchmark
tests had started the server with their preload, 10 s alone.  So a server running with
another preload is stopped first.
"""
from __future__ import annotations

import multiprocessing as mp
from multiprocessing import forkserver


def forkserver_context(preload: list[str]):
    server = forkserver._forkserver
    if (getattr(server, "_forkserver_pid", None) is not None
            and list(getattr(server, "_preload_modules", ())) != list(preload)):
        server._stop()
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(preload))
    return ctx
