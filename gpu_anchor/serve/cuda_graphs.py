"""Decode steps replayed from CUDA graphs (the host launches one graph, not ~900 kernels).

A decode step is ``n`` sequences × one token.  ``DecodeGraphs`` pads ``n`` up to the
next captured batch size (1, 2, 4, 8, 16, 32, 48, …, ``max_num_seqs``) and replays the
graph of that size over static input buffers:

    ids, positions, slots   [max_bs]             padding rows: token 0, position 0, slot -1
    token_seq               [max_bs]             arange (row b is sequence b)
    block_tables            [max_bs, max_blocks] fixed width: ceil(max_model_len / block_size) + 1

A padding row's slot is -1, so ``write_kv`` skips it: it never writes into a block that
a committed sequence owns (the anchored KV invariant, docs/serving.md).  Its attention
reads block ``block_tables[row][0]`` at position 0, a harmless read whose output is
dropped.  What is captured is ``embed`` + the decoder layers; the final norm, lm_head and
sampling run eagerly on the ``n`` real rows, so the logits of a row do not depend on the
padding.  Prefill and mixed steps stay eager.

Graphs are captured lazily (the first step of each size) or all at once with
``capture_all``; they live in one memory pool, reported in ``stats``.  They hold raw
pointers into the anchored weights and KV cache, whose addresses are fixed for the life
of the process: a restarted engine is a new process and captures its own.  With fault
injection on (``model.mid_hook``), each size is captured as two graphs, layers
``0..mid-1`` and ``mid..L-1``, and the hook runs between their replays, exactly where the
eager forward calls it.  An engine serving LoRA adapters captures each size twice, with the
adapters' terms and without (a step none of whose sequences has an adapter replays the latter
and pays nothing for them, as an eager step does).

On the CPU (``capture=False``) the same padded static-buffer path runs eagerly: the tests
check its bookkeeping there against the unpadded eager path.
"""
from __future__ import annotations

import logging
import time

import torch

from .attention import AttnMeta, to_device

log = logging.getLogger("gpu_anchor.serve")


def decode_graphs(cfg, model, device: torch.device, dtype: torch.dtype) -> "DecodeGraphs | None":
    """The engine's decode graphs, or None (eager): on for CUDA unless ``cfg.cuda_graphs`` is
    False; ``True`` on the CPU runs the padded path uncaptured.  Every rank of a
    tensor-parallel group makes the same choice from the same configuration."""
    use = cfg.cuda_graphs if cfg.cuda_graphs is not None else device.type == "cuda"
    if use and device.type == "cuda" and (dtype == torch.float64 or not hasattr(torch.cuda, "CUDAGraph")):
        use = False       # float64 attention runs the (host-driven) reference path
    if not use:
        return None
    from . import attention
    if device.type == "cuda" and attention.triton is None:
        log.warning("no Triton: decode steps run eagerly")
        return None
    return DecodeGraphs(model, cfg.max_num_seqs, -(-cfg.max_model_len // cfg.block_size) + 1, device,
                        capture=device.type == "cuda")


def batch_sizes(max_bs: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s < max_bs] + list(range(16, max_bs, 16)) + [max_bs]
    return sorted(set(sizes))


class DecodeGraphs:
    def __init__(self, model, max_bs: int, max_blocks: int, device, capture: bool = True) -> None:
        self.model = model
        self.sizes = batch_sizes(max_bs)
        self.max_bs, self.max_blocks = max_bs, max_blocks
        self.device = torch.device(device)
        self.capture = capture
        dev = self.device
        self.ids = torch.zeros(max_bs, dtype=torch.long, device=dev)
        self.pos = torch.zeros(max_bs, dtype=torch.long, device=dev)
        self.slots = torch.full((max_bs,), -1, dtype=torch.long, device=dev)
        self.tseq = torch.arange(max_bs, dtype=torch.int32, device=dev)
        self.bt = torch.zeros(max_bs, max_blocks, dtype=torch.int32, device=dev)
        # each row's LoRA adapter slot (-1: none), when the model serves adapters: the graphs with
        # them compute the adapters' terms of every row, zero for rows without one
        self.lora = torch.full((max_bs,), -1, dtype=torch.long, device=dev) if model.lora is not None else None
        # (bs, with the adapters' terms) -> (graphs, static output h)
        self._graphs: dict[tuple[int, bool], tuple[list, torch.Tensor]] = {}
        self._pool = None
        # torch.cuda.graph's default capture stream is one per process, made on whichever
        # device was current at the first capture: an engine moved to another GPU in the
        # same process (migration) would capture on the old GPU's stream (an empty graph)
        self._capture_stream = torch.cuda.Stream(self.device) if capture else None
        self.stats = {"graphs": 0, "capture_s": 0.0, "pool_bytes": 0,
                      "static_bytes": sum(t.numel() * t.element_size() for t in
                                          (self.ids, self.pos, self.slots, self.tseq, self.bt)
                                          + (() if self.lora is None else (self.lora,))),
                      "replays": 0}

    def size_for(self, n: int) -> int | None:
        return next((s for s in self.sizes if s >= n), None)

    def fits(self, n: int, width: int) -> bool:
        return 0 < n <= self.max_bs and width <= self.max_blocks

    def _meta(self, bs: int, tables=None, lora: bool = False) -> AttnMeta:
        n = len(tables) if tables is not None else 0
        # host lists are read by the CPU reference attention only (the emulated path)
        ctx = [int(p) + 1 for p in self.pos[:n].tolist()] if not self.capture else []
        return AttnMeta(self.pos[:bs], self.slots[:bs], self.tseq[:bs], self.bt[:bs],
                        list(range(n)) if not self.capture else [], [1] * n if not self.capture else [],
                        ctx, tables if not self.capture else [], self.lora[:bs] if lora else None)

    def _segments(self) -> list[tuple[int, int]]:
        m = self.model
        return [(0, m.mid), (m.mid, m.L)] if m.mid_hook is not None else [(0, m.L)]

    def _run_segments(self, bs: int, meta: AttnMeta, hook: bool) -> torch.Tensor:
        m = self.model
        h, cos, sin = m.embed(self.ids[:bs], self.pos[:bs])
        segs = self._segments()
        for j, (lo, hi) in enumerate(segs):
            if j and hook:
                m.mid_hook()
            h = m.layers(h, cos, sin, meta, lo, hi)
        return h

    @torch.no_grad()
    def _capture(self, bs: int, lora: bool) -> None:
        m = self.model
        t0 = time.perf_counter()
        self.ids[:bs].zero_()
        self.pos[:bs].zero_()
        self.slots[:bs].fill_(-1)          # warm-up and capture write no KV
        meta = self._meta(bs, lora=lora)
        # warm-up on a side stream, as torch.cuda.graph asks: compiles the Triton kernels and
        # sets up cuBLAS outside the capture; the capture's own stream, so that what a kernel
        # keeps per stream (attention's merge counters) is made here, not inside the capture
        side, main = self._capture_stream, torch.cuda.current_stream(self.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            self._run_segments(bs, meta, hook=False)
        main.wait_stream(side)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()     # as torch.cuda.graph does on entry: the growth below is the pool's
        before = torch.cuda.memory_reserved(self.device)
        graphs = []
        segs = self._segments()
        state = {}
        for lo, hi in segs:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self._pool, stream=self._capture_stream, capture_error_mode="thread_local"):
                if lo == 0:
                    state["h"], state["cos"], state["sin"] = m.embed(self.ids[:bs], self.pos[:bs])
                state["h"] = m.layers(state["h"], state["cos"], state["sin"], meta, lo, hi)
            if self._pool is None:
                self._pool = g.pool()
            graphs.append(g)
        torch.cuda.synchronize(self.device)
        self._graphs[(bs, lora)] = (graphs, state["h"])
        self.stats["graphs"] += len(graphs)
        self.stats["pool_bytes"] += max(0, torch.cuda.memory_reserved(self.device) - before)
        self.stats["capture_s"] += time.perf_counter() - t0

    def capture_all(self) -> None:
        """Capture every size now, largest first (smaller graphs then reuse its pool memory); with
        and without the adapters' terms when the model serves adapters."""
        if self.capture:
            for bs in reversed(self.sizes):
                for lora in (False, True) if self.lora is not None else (False,):
                    if (bs, lora) not in self._graphs:
                        self._capture(bs, lora)

    def run(self, ids, pos: list[int], slots: list[int], tables: list[list[int]], around=None,
            lora: list[int] | None = None) -> torch.Tensor:
        """One decode step of ``n = len(pos)`` sequences; returns their hidden states [n, H]
        after the last layer (to go through ``model.head``).  ``ids``: a host list, or a tensor
        on the device (a step launched ahead: the previous step's sampled ids, copied on the
        device into the static buffer behind that step's work on the stream).  ``around``:
        ``(before, after)`` called right around the launch of the kernels that write the KV (the
        step fence's marks), once the inputs are in the graph's own buffers.  ``lora``: each
        sequence's adapter slot (None: none has one)."""
        n = len(pos)
        bs = self.size_for(n)
        pad = bs - n
        key = (bs, self.lora is not None and lora is not None)
        if self.capture and key not in self._graphs:
            self._capture(*key)        # before the inputs go in: capture clobbers the buffers
        on_device = isinstance(ids, torch.Tensor)
        rows = [[0] * bs if on_device else ids + [0] * pad, pos + [0] * pad, slots + [-1] * pad]
        if key[1]:
            rows.append(lora + [-1] * pad)
        host = torch.tensor(rows, dtype=torch.long)
        width = max(map(len, tables))
        host = to_device(host, self.device)           # one copy each, never waiting for the stream
        self.ids[:bs].copy_(host[0])
        if on_device:
            self.ids[:n].copy_(ids)
        self.pos[:bs].copy_(host[1])
        self.slots[:bs].copy_(host[2])
        if key[1]:
            self.lora[:bs].copy_(host[3])
        self.bt[:n, :width].copy_(to_device(torch.tensor([t + [0] * (width - len(t)) for t in tables],
                                                         dtype=torch.int32), self.device))
        before, after = around or (lambda: None, lambda: None)
        if not self.capture:
            before()
            h = self._run_segments(bs, self._meta(bs, tables, key[1]), hook=True)[:n]
            after()
            return h
        graphs, out = self._graphs[key]
        before()
        for j, g in enumerate(graphs):
            if j and self.model.mid_hook is not None:
                self.model.mid_hook()
            g.replay()
        after()
        self.stats["replays"] += 1
        return out[:n]
