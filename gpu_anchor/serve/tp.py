"""A tensor-parallel engine group: one engine process per device, rank 0 in charge.

    gpu-anchor serve MODEL --tensor-parallel-size 2     # ranks 0, 1 on cuda:0, cuda:1 (or both on the CPU)

Rank 0 is the engine the frontend talks to: it alone runs the scheduler, the block
manager, sampling and the journal commit (``engine.py``).  Every rank holds its shard of
the weights and of the KV cache (``shards.py``) in its own device's daemon, and runs the
same forward in lockstep; the collectives (all-reduce after the row-parallel matmuls and
the vocabulary-parallel embedding, all-gather of the logits) go through
``torch.distributed`` — NCCL on GPUs, gloo on the CPU.

What a step computes is decided by rank 0 and sent, before rank 0 launches its own
forward, as a *plan* over a Unix socket (``Leader`` → ``Link``): the token ids, positions,
KV slots, block tables and rows to sample — plain lists, so a rank rebuilds exactly rank
0's inputs.  The plans travel on a socket and not through the collective backend so an
idle server holds no collective open (gloo and NCCL time out; a rank blocked in ``recv``
waits for ever and sees EOF the moment rank 0 dies).

Start-up (every rank, fresh processes each time; docs/serving.md, "Tensor parallelism"):
connect the control channel → ``init_process_group`` (a ``FileStore`` per incarnation of
the group) → bind and, where needed, load its shard → report to rank 0 whether its KV can
be trusted (``ready``) → rank 0 decides for all of them and commits → ``go`` → a rank
records its layout, then follows plans.  A rank never records its layout before rank 0
has committed the decision (``go``): so a rank whose KV was lost can never later pass for
one whose KV rank 0's journal still counts on.
"""
from __future__ import annotations

import logging
import os
import pickle
import signal
import socket
import struct
import time

import torch

from . import shards

log = logging.getLogger("gpu_anchor.serve")

ACCEPT_TIMEOUT_S = 600.0      # every rank of the group connects within this (else rank 0 gives up)
_LEN = struct.Struct("<Q")


class Group:
    """This process's rank in the group and its collectives (``torch.distributed``)."""

    def __init__(self, rank: int, size: int, device: torch.device, vocab_size: int, store_path: str) -> None:
        import torch.distributed as dist
        self.dist = dist
        self.rank, self.size, self.vocab_size = rank, size, vocab_size
        self.vocab = shards.vocab_range(vocab_size, rank, size)
        self.chunk = -(-vocab_size // size)
        store = dist.FileStore(store_path, size)
        if device.type == "cuda":
            dist.init_process_group("nccl", store=store, rank=rank, world_size=size, device_id=device)
        else:
            dist.init_process_group("gloo", store=store, rank=rank, world_size=size)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        self.dist.all_reduce(t)
        return t

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Every rank's vocabulary range of the logits ``[rows, hi - lo]`` → ``[rows, V]``."""
        pad = self.chunk - logits.shape[1]
        if pad:
            logits = torch.nn.functional.pad(logits, (0, pad))
        parts = [torch.empty_like(logits) for _ in range(self.size)]
        self.dist.all_gather(parts, logits.contiguous())
        return torch.cat(parts, dim=1)[:, :self.vocab_size]


# ------------------------------------------------------------------ control channel
def _send(sock: socket.socket, data: bytes) -> None:
    sock.sendall(_LEN.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _recv(sock: socket.socket):
    head = _recv_exact(sock, _LEN.size)
    if head is None:
        return None
    body = _recv_exact(sock, _LEN.unpack(head)[0])
    return None if body is None else pickle.loads(body)


class PeerLost(RuntimeError):
    """A rank of the group went away (its process died): the group must be restarted whole."""


class Leader:
    """Rank 0's end of the control channel: every other rank connects, then gets each plan."""

    def __init__(self, path: str, size: int, timeout: float = ACCEPT_TIMEOUT_S) -> None:
        self.path = path
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(path)
        srv.listen(size)
        srv.settimeout(timeout)
        self.peers: dict[int, socket.socket] = {}
        try:
            while len(self.peers) < size - 1:
                try:
                    conn, _ = srv.accept()
                except socket.timeout:
                    raise PeerLost(f"only {len(self.peers) + 1} of {size} ranks connected within {timeout:.0f} s") \
                        from None
                conn.settimeout(None)
                hello = _recv(conn)
                if hello is None:
                    conn.close()
                    continue
                self.peers[hello["rank"]] = conn
        finally:
            srv.close()
        self.socks = [self.peers[r] for r in sorted(self.peers)]

    def send(self, msg: dict) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        for s in self.socks:
            try:
                _send(s, data)
            except OSError as e:
                raise PeerLost(f"a rank is gone ({e})") from None

    def gather(self) -> list[dict]:
        """One message from every other rank, by rank."""
        out = []
        for r in sorted(self.peers):
            msg = _recv(self.peers[r])
            if msg is None:
                raise PeerLost(f"rank {r} went away during start-up")
            out.append(msg)
        return out

    def close(self) -> None:
        """The group's clean end: every rank exits 0."""
        try:
            self.send({"t": "stop"})
        except PeerLost:
            pass
        for s in self.socks:
            s.close()


class Link:
    """A rank's end of the control channel."""

    def __init__(self, path: str, rank: int, timeout: float = ACCEPT_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while True:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(path)
                break
            except OSError:
                s.close()
                if time.monotonic() > deadline:
                    raise PeerLost(f"rank 0 did not open {path} within {timeout:.0f} s") from None
                time.sleep(0.02)
        self.sock = s
        self.send({"rank": rank})

    def send(self, msg: dict) -> None:
        _send(self.sock, pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))

    def recv(self) -> dict:
        msg = _recv(self.sock)
        if msg is None:
            raise PeerLost("rank 0 closed the control channel (it died or stopped without saying so)")
        return msg


def paths(rendezvous: str) -> tuple[str, str]:
    """The control socket and the process-group store of one incarnation of the group."""
    return rendezvous + ".sock", rendezvous + ".store"


class LeaderSide:
    """What rank 0's engine holds: the channel to the others and the process group."""

    def __init__(self, cfg, device: torch.device, vocab_size: int) -> None:
        sock, store = paths(cfg.rendezvous)
        self.leader = Leader(sock, cfg.tensor_parallel_size)
        self.group = Group(0, cfg.tensor_parallel_size, device, vocab_size, store)
        self.slowest_s = 0.0       # the slowest other rank's start-up (fork to ready), seconds

    def send(self, plan: dict) -> None:
        self.leader.send(plan)

    def agree(self, why: str) -> str:
        """Wait for every rank's ``ready``; the first reason any rank gives not to trust the
        anchored KV ("" if none does)."""
        for rep in self.leader.gather():
            self.slowest_s = max(self.slowest_s, rep["init_s"])
            if rep.get("why") and not why:
                why = f"rank {rep['rank']}: {rep['why']}"
        return why

    def close(self) -> None:
        self.leader.close()


# ------------------------------------------------------------------ ranks > 0
def fault_due(fault, phase: str, step: int, exact: bool = True) -> bool:
    """Fault injection (tests): ``fault = (step, phase)`` fires at that phase of that step;
    a mid-forward phase, or any phase when ``exact`` is off (a rank > 0 sees only the steps
    that run a forward), fires at the first such step at or after it."""
    if fault is None or fault[1] != phase:
        return False
    return step == fault[0] or ((phase.startswith("mid_") or not exact) and step >= fault[0])


def serve_rank(cfg) -> None:
    """A rank > 0 of the group, for its whole life: start up with rank 0, then follow plans
    until rank 0 says ``stop`` (exit 0) or goes away (``PeerLost``: exit 1)."""
    from . import lora, lora_slots
    from .cuda_graphs import decode_graphs
    from .engine import DTYPES
    from .model_runner import Model, load_config
    from .state import bind_state
    t0 = time.perf_counter()
    device = torch.device(cfg.device)
    dtype = DTYPES[cfg.dtype]
    if cfg.cpu_threads:
        torch.set_num_threads(cfg.cpu_threads)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    mc = load_config(cfg.model)
    sock, store = paths(cfg.rendezvous)
    link = Link(sock, cfg.rank)
    group = Group(cfg.rank, cfg.tensor_parallel_size, device, mc.vocab_size, store)
    st = bind_state(cfg, mc, dtype, device)
    why = st.kv_problem()
    link.send({"t": "ready", "rank": cfg.rank, "why": why, "init_s": time.perf_counter() - t0})
    model = Model(mc, st.weights, st.kv, device, max_positions=cfg.max_model_len, tp=group,
                  deterministic=cfg.deterministic, packed=st.packed)
    model.lora = lora_slots.load_for(cfg, mc, st.weights, model, cfg.rank)
    graphs = decode_graphs(cfg, model, device, dtype)
    msg = link.recv()
    if msg["t"] != "go":
        raise PeerLost(f"rank 0 sent {msg['t']!r} before 'go'")
    st.record_layout()          # only now: rank 0's journal holds the decision this layout stands for
    def follow(table: list) -> None:       # rank 0's adapters loaded while serving (lora_slots.runtime_table)
        lora_slots.follow_table(model.lora, table,
                                lambda name, path: lora.read_for(cfg, mc, st.weights, name, path, cfg.rank))

    follow(msg.get("lora", []))
    fault, step = cfg.fault, [0]

    def die_if(phase: str) -> None:
        if fault_due(fault, phase, step[0], exact=False):
            os.kill(os.getpid(), signal.SIGKILL)
        if fault is not None and fault[1] == "mid_prefill" and step[0] >= fault[0] + 2 and phase == "mid_decode":
            os.kill(os.getpid(), signal.SIGKILL)     # no prefill came: die mid-decode instead

    prefill = [False]
    if fault is not None:
        model.mid_hook = lambda: die_if("mid_prefill" if prefill[0] else "mid_decode")
    from .attention import step_inputs
    with torch.no_grad():
        while True:
            msg = link.recv()
            t = msg["t"]
            if t == "stop":
                return
            if t == "capture_all":
                if graphs is not None:
                    graphs.capture_all()
                continue
            if t == "lora":
                follow(msg["adapters"])
                continue
            step[0] = msg["step"]
            die_if("between_steps")
            prefill[0] = msg["prefill"]
            if t == "graph":
                model.head(graphs.run(msg["ids"], msg["pos"], msg["slots"], msg["tables"], lora=msg.get("lora")))
            else:
                ids, meta, rows = step_inputs(msg, device)
                model.forward(ids, meta, rows)
            die_if("before_commit")
            die_if("after_commit")
