"""The frontend's side of the engine's connection (``frontend.Frontend`` is an ``EngineSide``).

An engine connects to the frontend's engine socket, reports its start-up (``loading``), then says
``hello`` with the requests it restored; the frontend re-sends every other open request with the
tokens its client already has (``add``), and asks for a recomputation where the engine's tokens
cannot be trusted (``readd``: a replayed token that differs from a delivered one, a token that
came without the log-probabilities its request wants).  From then on ``_on_message`` takes the
engine's tokens and reports until the connection ends (``_engine_lost``: open requests wait for
the next engine).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from . import wire

if TYPE_CHECKING:
    from .frontend import Req

log = logging.getLogger("gpu_anchor.serve.frontend")


class EngineSide:
    def send(self, obj) -> None:
        if self.writer is not None:
            self.writer.write(wire.encode(obj))

    def _add_msg(self, r: Req) -> dict:
        return {"t": "add", "rid": r.rid, "prompt": r.prompt, "params": r.params, "out": r.out}

    def _resync(self, r: Req, from_start: bool = False) -> None:
        """Make the engine continue ``r`` from the tokens its client has (it recomputes the KV;
        ``from_start``: all of it, for the prompt log-probabilities)."""
        r.resyncing = True
        self.send(dict(self._add_msg(r), t="readd", from_start=from_start))
        self.last_timings["resyncs"] = self.last_timings.get("resyncs", 0) + 1

    async def on_engine(self, reader, writer) -> None:
        """One engine's connection, from its start-up reports to its end."""
        m = self.metrics
        try:
            while True:
                hello = await wire.read(reader)
                if hello["t"] != "loading":
                    break
                self.loading = hello
                m.engine_loading.set(1)
        except Exception:
            writer.close()
            return
        finally:
            self.loading = None
            m.engine_loading.set(0)
        if self.writer is not None:
            # a stale connection: the new engine wins.  A hot standby that took over as soon as
            # the old engine's writer threads were gone says hello before that engine's end of
            # file is read here: its loss is dated when the supervisor decided to replace it
            self.writer.close()
            decided = hello.get("timings", {}).get("decided_at")
            self._engine_lost(self.writer, ago=max(0.0, time.time() - decided) if decided else 0.0)
        if self.failed:                        # the supervisor gave up: nothing to serve any more
            writer.close()
            return
        self.engine_pid = hello["pid"]
        self.connects += 1
        down = time.monotonic() - self.down_since
        # a restarted engine that had to load the weights again did not find the anchored state:
        # every open request is recomputed from its tokens (re-sent below)
        fresh = self.connects > 1 and bool(hello.get("weights_loaded"))
        if fresh:
            for r in self.reqs.values():
                if r.finish is None and r.lost_at is not None:
                    r.lost_state = True
        # wall clock, to set against a kill's time: the engine's connection lost, the new one's hello,
        # (set later) the first token any open stream got from it, and the resyncs it took
        self.last_timings = dict(hello.get("timings", {}), down_s=down, lost_at=time.time() - down,
                                 hello_at=time.time(), resyncs=0)
        if fresh and self.state_loss.get("replace_s") is not None:
            self.last_timings["state_replace_s"] = self.state_loss["replace_s"]    # fresh daemon / namespace
        m.set_last_recovery(self.last_timings)
        self._log_up(hello, down, fresh)
        for note in hello.get("notes", []):
            log.warning("engine %s: %s", self.engine_pid, note)
        held = set(hello["rids"])
        self.writer = writer
        self.preemptions_seen = 0
        self.counts_seen: dict = {}          # the new engine's counters (prefix cache, LoRA swaps) start from 0
        m.engine_up.set(1)
        if self.runtime_lora is not None:
            self.runtime_lora.on_hello()      # before the requests below: some may name those adapters
        for r in self.reqs.values():
            r.resyncing = False          # the new engine replays; a mismatch re-triggers it
        for rid in held - set(self.reqs):
            self.send({"t": "abort", "rid": rid})
        for r in list(self.reqs.values()):
            if r.rid not in held and r.finish is None:
                self.send(self._add_msg(r))
        try:
            while True:
                self._on_message(await wire.read(reader))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            if self.writer is writer:
                self._engine_lost(writer)
            writer.close()

    def _on_message(self, msg: dict) -> None:
        """One message of the engine serving now (tokens, load, errors, resyncs, stats, LoRA
        loads, migrations)."""
        m = self.metrics
        t = msg["t"]
        if t == "toks":
            lps: dict = {}
            for rid, k, lp, top in msg.get("lp", ()):
                lps.setdefault(rid, {})[k] = (lp, top)
            for rid, plps in msg.get("plp", ()):
                r = self.reqs.get(rid)
                if r is not None and r.plps is None and not r.resyncing:
                    r.plps = [tuple(x) for x in plps]
            for rid, n in msg.get("cached", ()):
                r = self.reqs.get(rid)
                if r is not None and not r.resyncing:
                    r.cached_tokens = n
            for rid, i, ids, fin in msg["ev"]:
                self._apply(rid, i, ids, fin, lps.get(rid))
        elif t == "load":
            m.set_load(msg["running"], msg["waiting"], msg["kv_blocks_used"], msg["kv_blocks"])
            m.num_preemptions.inc(max(0, msg["preemptions"] - self.preemptions_seen))
            self.preemptions_seen = msg["preemptions"]
            for k, c in (("prefix_queries", m.prefix_queries), ("prefix_hits", m.prefix_hits)):
                c.inc(max(0, msg.get(k, 0) - self.counts_seen.get(k, 0)))
                self.counts_seen[k] = msg.get(k, 0)
            lora = msg.get("lora")
            if lora is not None:
                m.set_lora(lora["running"], lora["waiting"], lora["max"])
                for k, c in (("swaps", m.lora_swaps), ("reads", m.lora_reads), ("read_wait_s", m.lora_read_wait)):
                    c.inc(max(0, lora.get(k, 0) - self.counts_seen.get("lora_" + k, 0)))
                    self.counts_seen["lora_" + k] = lora.get(k, 0)
        elif t == "err":
            r = self.reqs.get(msg["rid"])
            if r is not None:
                r.error, r.finish = msg["msg"], "error"
                r.changed.set()
        elif t == "readd_ok":
            r = self.reqs.get(msg["rid"])
            if r is not None:
                r.resyncing = False
        elif t == "stats":
            self.last_timings.update({k: v for k, v in msg.items() if k != "t"})
            m.set_last_recovery(self.last_timings)
        elif t == "lora_done" and self.runtime_lora is not None:
            self.runtime_lora.on_done(msg)
        elif t in ("migrated", "migrate_done"):
            self.last_migration = dict(msg, phase=t)
            fut = self.migrations.pop(msg.get("mid"), None) if t == "migrated" else None
            if fut is not None and not fut.done():
                fut.set_result(msg)

    def _engine_lost(self, writer, ago: float = 0.0) -> None:
        """The engine's connection is gone (``ago`` seconds ago, by what the supervisor saw)."""
        for fut in self.migrations.values():
            if not fut.done():
                fut.set_result({"error": "the engine died during the migration; it restarts where "
                                         "its state was last complete"})
        self.migrations.clear()
        if self.runtime_lora is not None:
            self.runtime_lora.on_lost()
        self.writer = None
        self.engine_pid = None
        self.down_since = now = time.monotonic() - ago
        self.metrics.engine_up.set(0)
        for r in self.reqs.values():
            if r.finish is None and r.lost_at is None:
                r.lost_at = now
        log.warning("engine disconnected; %d open request(s) wait for the next one", len(self.reqs))

    def _log_up(self, hello: dict, down: float, fresh: bool) -> None:
        t = hello.get("timings", {})
        parts = ", ".join(f"{k[:-2]} {t[k]:.2f} s" for k in ("bind_s", "weights_s", "restore_s") if k in t)
        if self.connects == 1:
            since = f"{time.time() - self.started_at:.1f} s after start; " if self.started_at else ""
            log.info("ready: %s at %s (%sengine built in %.2f s: %s)", self.model_name, self.url, since,
                     t.get("init_s", 0.0), parts)
        else:
            self.metrics.restarts.inc()
            self.metrics.down.observe(down)
            if fresh:
                self.metrics.state_recoveries.inc()
                self.metrics.state_down.observe(down)
                self.state_loss["recovered_s"] = round(down, 3)
            log.info("engine %s serving again %.2f s after the last one was lost; %d restored request(s), "
                     "%d open (%s)%s", hello["pid"], down, len(hello["rids"]), len(self.reqs), parts,
                     "; the anchored state was lost: weights loaded again, open requests recomputed from "
                     "their tokens" if fresh else "")
