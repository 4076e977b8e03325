"""KV-memory, the inference baseline that persists the KV cache in host memory, built as its
best users would build it: every step's new KV is copied to a host mirror in /dev/shm (which
outlives the engine) off the engine's critical path, and a restarted engine reloads the
weights from local safetensors (page cache warm), copies back the KV blocks of the live
requests, and resumes every request without prefill.

Per step (``attach`` wires it into the engine's commit pipeline):

- at the end of step N, on the engine's thread (``capture``): the token slots written since
  the last capture are listed; on a GPU, a side CUDA stream waits for the step's work, gathers
  those slots of every layer into one device buffer and copies it to a pinned host buffer
  (``non_blocking``), then records an event.  The engine's own stream never waits for it.
- on the commit thread, before step N's journal commit (``land``): wait for that event, then
  scatter the rows into the /dev/shm mirror (numpy fancy assignment on a byte view: torch's CPU
  ``index_copy_`` into a 268 MB mirror took ~7 ms per layer for 64 slots, numpy ~16 µs).  A
  commit therefore never names KV that is not in the mirror.  The engine already overlaps
  step N's commit with step N+1's forward, so the copy overlaps it too.  Blocks freed in step N
  are reused only after commit N lands (the engine's block epochs), so the side stream never
  reads a slot a later step has overwritten.

On restart (``_kv``) the device cache is zeroed (fresh memory is undefined, as for the
engine's own KV) and only the blocks named by the committed block tables, and the cached blocks
the journal records (the engine's prefix cache, found again as with gpu-anchor), are copied back:
gathered per layer from the mirror into pinned buffers by a few threads while earlier layers
are copied to the GPU and scattered there on a copy stream.
"""
from __future__ import annotations

import collections
import os
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from .replay import ReplayAnchor

GATHER_THREADS = 4


class KVMemoryAnchor(ReplayAnchor):
    name = "kv_memory"

    def _kv(self, specs, tensors) -> dict[str, str]:
        self.cuda = torch.device(self.device).type == "cuda"
        self.host, self.host_rows, self.dev = [], [], []
        for n, shape, dt in specs:
            path = os.path.join(self.state_dir, f"{n}.bin")
            nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dt).element_size()
            h = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8).view(dt).view(shape)
            self.host.append(h)
            # (2, slots, bytes per slot) bytes: the scatter target, one row per token slot
            self.host_rows.append(h.view(2, -1, h.shape[-2] * h.shape[-1]).view(torch.uint8).numpy())
            self.dev.append(tensors[n])
        if self.restart:
            t0 = time.perf_counter()
            blocks = self._live_blocks()
            self._copy_back(blocks)
            type(self).timings.update(kv_copy_back_s=time.perf_counter() - t0, kv_blocks_restored=len(blocks),
                                      kv_blocks_total=self.dev[0].shape[1] if self.dev else 0)
        return {n: ("matched" if self.restart else "created") for n, _, _ in specs}

    # ------------------------------------------------------------------ restart
    def _live_blocks(self) -> list[int]:
        """Every block a committed request's block table names (what the engine will resume on),
        and every cached block the journal records (the engine trusts those too: a prefix cache
        found again; their KV reached the mirror while their requests ran, and a block's record
        is deleted before the block is written again)."""
        from gpu_anchor.serve.commit import PC, read_cached, read_sequences
        seqs, _ = read_sequences(self.journal)
        cached, _, _ = read_cached(self.journal.get_many(prefix=PC))
        return sorted({b for s in seqs for b in s.block_table} | {b for b, _ in cached})

    def _copy_back(self, blocks: list[int]) -> None:
        for d in self.dev:
            d.zero_()
        if not blocks or not self.dev:
            if self.cuda:
                torch.cuda.synchronize(self.device)
            return
        idx = torch.tensor(blocks, dtype=torch.long)
        _, nb = self.dev[0].shape[:2]
        per_block = self.dev[0][0, 0].numel() * self.dev[0].element_size()
        shape = (2, len(blocks), per_block)

        def gather(layer: int, buf: torch.Tensor) -> torch.Tensor:
            src = self.host[layer].view(torch.uint8).view(2, nb, per_block)
            return torch.index_select(src, 1, idx, out=buf)

        if not self.cuda:
            buf = torch.empty(shape, dtype=torch.uint8)
            for layer, d in enumerate(self.dev):
                d.view(torch.uint8).view(2, nb, per_block).index_copy_(1, idx, gather(layer, buf))
            return
        ring = min(GATHER_THREADS, len(self.dev))
        host = [torch.empty(shape, dtype=torch.uint8, pin_memory=True) for _ in range(ring)]
        copy = torch.cuda.Stream(self.device)
        copy.wait_stream(torch.cuda.current_stream(self.device))         # after the zeroing
        dbuf = [torch.empty(shape, dtype=torch.uint8, device=self.device) for _ in range(2)]
        didx = idx.to(self.device)
        landed = [None] * ring                                           # event: buffer's H2D done
        with ThreadPoolExecutor(ring) as pool:
            futs = {k: pool.submit(gather, k, host[k]) for k in range(ring)}
            for layer, d in enumerate(self.dev):
                slot = layer % ring
                futs.pop(layer).result()
                with torch.cuda.stream(copy):
                    db = dbuf[layer % 2]
                    db.copy_(host[slot], non_blocking=True)
                    d.view(torch.uint8).view(2, nb, per_block).index_copy_(1, didx, db)
                    landed[slot] = torch.cuda.Event()
                    landed[slot].record(copy)
                nxt = layer + ring
                if nxt < len(self.dev):
                    landed[slot].synchronize()                           # its pinned buffer is free again
                    futs[nxt] = pool.submit(gather, nxt, host[slot])
        copy.synchronize()

    # ------------------------------------------------------------------ per step
    def attach(self, engine) -> None:
        """Mirror each step's new KV before the engine's commit of that step lands: ``capture``
        after the step's snapshot (engine thread), ``land`` before its commit (commit thread)."""
        self.engine = engine
        self._done: dict[str, int] = {s.rid: s.num_computed for s in engine.scheduler.seqs.values()}
        self._pending: collections.deque = collections.deque()
        self.copied_slots = 0
        self.side = torch.cuda.Stream(self.device) if self.cuda else None
        committer = engine.committer
        snapshot, apply = committer.snapshot, committer.apply
        from gpu_anchor.serve.commit import PC

        def snapshot_and_capture(live, gone=(), cached=()):
            snap = snapshot(live, gone, cached)
            if snap is not None:          # exactly the snapshots that become commits, in order
                self._pending.append(self.capture())
            return snap

        def land_then_apply(puts, deletes):
            # a deletion of cached blocks' records alone (``Pipeline.unrecord``) is no step's commit
            if puts or not all(k.startswith(PC) for k in deletes):
                self.land(self._pending.popleft())
            apply(puts, deletes)

        committer.snapshot, committer.apply = snapshot_and_capture, land_then_apply

    def capture(self):
        """The KV slots written since the last capture, on their way to host memory; None if none."""
        bs = self.engine.cfg.block_size
        slots, done = [], {}
        for s in self.engine.scheduler.seqs.values():
            a, b = self._done.get(s.rid, 0), s.num_computed
            t = s.block_table
            if b > a and t:
                slots += [t[p // bs] * bs + p % bs for p in range(a, b)]
            done[s.rid] = b
        self._done = done
        if not slots:
            return None
        _, nb, bsz, hkv, hd = self.dev[0].shape
        idx = torch.tensor(slots, dtype=torch.long)
        flat = [d.view(2, nb * bsz, hkv * hd) for d in self.dev]
        shape = (len(flat), 2, len(slots), hkv * hd)
        if not self.cuda:
            g = torch.empty(shape, dtype=self.dev[0].dtype)
            for layer, f in enumerate(flat):
                torch.index_select(f, 1, idx, out=g[layer])
            return idx.numpy(), g, None, ()
        pinned_idx = idx.pin_memory()
        step_done = torch.cuda.Event()
        step_done.record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.side):
            self.side.wait_event(step_done)
            didx = pinned_idx.to(self.device, non_blocking=True)
            g = torch.empty(shape, dtype=self.dev[0].dtype, device=self.device)
            for layer, f in enumerate(flat):
                torch.index_select(f, 1, didx, out=g[layer])
            host = torch.empty(shape, dtype=g.dtype, pin_memory=True)
            host.copy_(g, non_blocking=True)                             # one device-to-host transfer
            copied = torch.cuda.Event()
            copied.record(self.side)
        return idx.numpy(), host, copied, (pinned_idx, didx, g)           # the last kept alive until it landed

    def land(self, rec) -> None:
        """Wait for a capture's copy, then write it into the mirror (commit thread)."""
        if rec is None:
            return
        ix, host, copied, _ = rec
        if copied is not None:
            copied.synchronize()
        rows = host.view(torch.uint8).view(host.shape[0], 2, len(ix), -1).numpy()
        for layer, h in enumerate(self.host_rows):
            h[:, ix] = rows[layer]
        self.copied_slots += len(ix)
