"""Workers SIGKILLed between and in the middle of writes lose nothing that reached memory."""
from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import time

import torch

import gpu_anchor

FORK = mp.get_context("fork")
NAMES = [f"state[{k}]" for k in range(6)]
NUMEL = 1 << 16
CHUNK = 1 << 10


def _bind(client, policy="match_or_create"):
    return [b.tensor for b in client.bind([(n, (NUMEL,), torch.int32) for n in NAMES], policy)]


def _writer(conn, pause_between_rounds: bool):
    """Round i writes value i into every tensor, chunk by chunk, then commits ``written = i``."""
    c = gpu_anchor.connect("cpu", namespace="kill")
    tensors = _bind(c)
    written = int(c.journal.get("written", b"0"))
    i = written + 1
    conn.send(("ready", written))
    while True:
        for t in tensors:
            for j in range(0, NUMEL, CHUNK):
                t[j:j + CHUNK] = i
        c.journal.put("written", str(i).encode())
        if pause_between_rounds:
            conn.send(("written", i))
            conn.recv()  # killed while waiting here
        i += 1


def _check_after_kill(client, tensors):
    """Everything in write order is round w+1 then round w: a prefix of the interrupted round."""
    w = int(client.journal.get("written", b"0"))
    flat = torch.cat(tensors)
    values = set(flat.unique().tolist())
    assert values <= {w, w + 1}, (w, values)
    if len(values) == 2:
        boundary = int((flat == w + 1).sum())
        assert bool((flat[:boundary] == w + 1).all()) and bool((flat[boundary:] == w).all())
    return w


def _start(pause: bool):
    parent, child = FORK.Pipe()
    p = FORK.Process(target=_writer, args=(child, pause), daemon=True)
    p.start()
    assert parent.poll(30), "worker never became ready"
    return p, parent


def test_kill_between_writes_keeps_exactly_the_last_round(host_daemon):
    for kill in range(5):
        p, conn = _start(pause=True)
        kind, _ = conn.recv()
        assert kind == "ready"
        assert conn.poll(30)
        kind, i = conn.recv()
        os.kill(p.pid, signal.SIGKILL)
        p.join()
        c = gpu_anchor.connect("cpu", namespace="kill")
        tensors = _bind(c, "lookup")
        assert int(c.journal.get("written")) == i
        assert all(bool((t == i).all()) for t in tensors)


def test_kill_mid_write_loop_at_random_instants(host_daemon):
    rng = random.Random(1234)
    observed = []
    c = gpu_anchor.connect("cpu", namespace="kill")
    for kill in range(25):
        p, conn = _start(pause=False)
        kind, resumed_from = conn.recv()
        time.sleep(rng.uniform(0.0, 0.05))
        os.kill(p.pid, signal.SIGKILL)
        p.join()
        tensors = _bind(c, "lookup")  # an observer: letting go must not free the job's state
        w = _check_after_kill(c, tensors)
        assert w >= resumed_from  # progress is never lost
        observed.append(w)
        del tensors
    assert observed[-1] > 0
    st = c.status()
    ns = st["namespaces"]["kill"]
    assert len(ns["objects"]) == len(NAMES)  # the daemon kept serving, nothing leaked or lost
    assert st["object_bytes"] == len(NAMES) * NUMEL * 4
