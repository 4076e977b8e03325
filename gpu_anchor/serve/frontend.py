"""The OpenAI-compatible HTTP frontend: its own process, torch-free, owns client connections.

    python -m gpu_anchor.serve.frontend --engine-socket PATH --model-dir DIR [--port 8000]

Routes: ``/v1/completions``, ``/v1/chat/completions`` (JSON or SSE streams), ``/v1/models``,
``/health``, ``/metrics`` (Prometheus, ``serve/metrics.py``), ``POST /admin/migrate``
(``gpu-anchor migrate``: the engine moves in place, the connection stays).  Request bodies
are checked by ``serve/openai_api.py`` (400 naming the field).  With an API key (``serve
--api-key`` or ``VLLM_API_KEY``), ``/v1/*`` and ``/admin/*`` need ``Authorization: Bearer KEY``.

The engine process connects to ``--engine-socket``, reports its start-up (``loading``, shown
by ``/health``, which stays 503 until the engine serves), then says ``hello``.  When it dies,
open streams stay open and new requests queue.  When an engine (re)connects, its ``hello``
lists the requests it restored; every other open request is re-sent with the tokens its
client already has.  Tokens carry their index, so duplicates from a replay are dropped — and
compared: a replayed token that differs from the delivered one counts in
``gpu_anchor_serve_token_mismatch_total`` (must stay 0).  A request that wants
log-probabilities never takes a token without them (a replay from the journal has none): the
engine is made to recompute it from the delivered tokens instead (``readd``).

The supervisor talks to this process over ``--control-fd`` (frames as on the engine socket):
``{"t": "restore", "reason", "replace_s"}`` (the anchored state was lost: the next engine starts on a fresh
one and recomputes every open request from its tokens) and ``{"t": "fatal", "reason"}`` (no
engine will come: a crash loop).  After ``fatal``, on SIGTERM/SIGINT, or when the supervisor's
end closes, every open request ends with an error — an SSE ``error`` event in the OpenAI error
shape and ``[DONE]`` on a stream, a JSON 503 otherwise — never a dropped connection or a stream
that just stops; ``/health`` answers 503 ``failed`` and new requests get 503.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import socket
import sys
import time
import uuid

from aiohttp import web

from . import openai_api as api
from . import wire
from .frontend_engine import EngineSide
from .lora_runtime import RuntimeAdapters
from .metrics import Metrics
from .response_store import ResponseStore
from .routes import make_app
from .tokenizer import Codec, IncrementalText

log = logging.getLogger("gpu_anchor.serve.frontend")


class Req:
    def __init__(self, rid, prompt, params, q: api.Request):
        self.rid, self.prompt, self.params, self.q = rid, prompt, params, q
        self.prompt_text: str | None = None    # the prompt as the client sent it, when as text (echo)
        self.stop = q.stop
        self.out: list[int] = []
        self.lps: list = []              # (logprob, top) per output token, when q.logprobs is not None
        self.plps: list | None = None    # (logprob, top, rank) per prompt token from the second, when asked
        self.cached_tokens = 0           # prompt tokens the engine found computed (prefix caching)
        self.finish: str | None = None
        self.error: str | None = None
        self.error_status = 400          # 503 when the server gave up on the request, not the request's fault
        self.changed = asyncio.Event()
        self.resyncing = False       # the engine must recompute from our tokens; ignore it until it did
        self.text: str | None = None     # final text when a stop string cut it
        self.detok: IncrementalText | None = None    # the text of ``out`` as it grows (streams, stop strings)
        self.stop_floor: int | None = None   # min_tokens: the text length a stop string must end past
        self.stop_scanned = 0                # the text length already searched for stop strings
        self.t0 = time.monotonic()
        self.t_first: float | None = None    # when its first token arrived
        self.t_last: float | None = None     # when its last token arrived
        self.lost_at: float | None = None    # when the engine was lost while this request was open
        self.lost_state = False              # ... and the next engine found no anchored state


class Frontend(EngineSide):
    def __init__(self, codec: Codec, model_name: str, max_model_len: int, vocab_size: int,
                 api_key: str | None = None, started_at: float | None = None, runtime_lora: bool = False,
                 **features) -> None:
        """``features``: the rest of ``openai_api.Surface`` (reply parsers, sampling defaults);
        ``runtime_lora``: LoRA adapters are loaded and unloaded while serving (``lora_runtime``)."""
        self.codec, self.model_name, self.max_model_len = codec, model_name, max_model_len
        self.vocab_size, self.api_key, self.started_at = vocab_size, api_key, started_at
        self.surface = api.Surface([model_name, *features.get("adapters", {})], vocab_size, **features)
        self.responses = ResponseStore()      # stored Responses (/v1/responses' store, previous_response_id)
        self.runtime_lora = RuntimeAdapters(self) if runtime_lora else None
        self.reqs: dict[str, Req] = {}
        self.writer = None
        self.engine_pid = None
        self.connects = 0
        self.mismatches = 0
        self.metrics = Metrics(model_name)
        self.last_timings: dict = {}
        self.loading: dict | None = None     # the starting engine's last progress report
        self.preemptions_seen = 0
        self.counts_seen: dict = {}
        self.down_since = time.monotonic()
        self.migrations: dict[str, asyncio.Future] = {}   # mid -> cut-over report
        self.last_migration: dict = {}
        self.url = ""
        self.failed: str | None = None       # why no engine will come (the supervisor gave up, or stopping)
        self.state_loss: dict = {}           # the last time the anchored state was lost, and why

    def _apply(self, rid, i, ids, fin, lps=None) -> None:
        r = self.reqs.get(rid)
        if r is None or r.finish is not None or r.resyncing:
            return
        new = 0
        # the tokens the client has already: a replay, compared as one slice (a take-over
        # replays every open stream from its first token at once)
        have = max(0, min(len(ids), len(r.out) - i))
        if have:
            self.metrics.replayed.inc(have)
            if list(ids[:have]) != r.out[i:i + have]:
                # The client has those tokens: make the engine continue from what was
                # delivered (it recomputes the KV), never from its own different replay.
                k = i + next(j for j in range(have) if ids[j] != r.out[i + j])
                self.metrics.mismatch.inc()
                self.mismatches += 1
                log.error("request %s: replayed token %d is %d, delivered %d; resyncing", rid, k, ids[k - i],
                          r.out[k])
                self._resync(r)
                return
        for j in range(have, len(ids)):
            k, t = i + j, ids[j]
            if k == len(r.out):
                if k == 0 and r.params.get("prompt_logprobs") is not None and r.plps is None:
                    # replayed from the journal, or restored in mid-prefill: the prompt again
                    log.info("request %s: its first token came without the prompt's log-probabilities; the "
                             "engine computes the prompt again", rid)
                    self._resync(r, from_start=True)
                    break
                if r.q.logprobs is not None:
                    lp = (lps or {}).get(k)
                    if lp is None:     # replayed from the journal, which keeps no log-probabilities
                        log.info("request %s: token %d came without its log-probabilities (a replay); the "
                                 "engine recomputes it", rid, k)
                        self._resync(r)
                        break
                    r.lps.append(lp)
                r.out.append(t)
                new += 1
        if new:
            self._arrived(r, new)
        if r.resyncing:
            r.changed.set()
            return
        least = r.q.sampling.get("min_tokens", 0)
        if r.stop and len(r.out) >= least:
            text = r.detok.update(r.out)
            # as vLLM: a stop string counts once it ends past the text of the first min_tokens tokens
            if r.stop_floor is None:
                r.stop_floor = len(self.codec.decode(r.out[:least], r.q.skip_special_tokens)) if least else 0
            # only the text a stop string could end in since the last look (the text only grows)
            floor = max(r.stop_floor, r.stop_scanned)
            r.stop_scanned = len(text)
            hits = [(at, s) for s in r.stop for at in [text.find(s, max(0, floor - len(s) + 1))] if at >= 0]
            if hits:
                at, s = min(hits)
                r.text = text[:at + len(s)] if r.q.include_stop_str else text[:at]
                fin = "stop"
                self.send({"t": "abort", "rid": rid})
        if fin:
            r.finish = fin
        r.changed.set()

    def _arrived(self, r: Req, new: int) -> None:
        m, now = self.metrics, time.monotonic()
        if r.t_last is None:
            m.ttft.observe(now - r.t0)
            r.t_first = now
        else:
            m.itl.observe(now - r.t_last)
        if r.lost_at is not None:
            if "first_token_at" not in self.last_timings:
                self.last_timings["first_token_at"] = time.time()
            m.stream_gap.observe(now - r.lost_at)
            if r.lost_state:
                m.state_stream_gap.observe(now - r.lost_at)
            r.lost_at, r.lost_state = None, False
        r.t_last = now
        m.generation_tokens.inc(new)
        m.generated.inc(new)

    def submit(self, prompt, params, q: api.Request) -> Req:
        r = Req(f"{'chatcmpl' if q.chat else 'cmpl'}-{uuid.uuid4().hex}", prompt, params, q)
        r.detok = IncrementalText(self.codec, q.skip_special_tokens)
        self.reqs[r.rid] = r
        self.metrics.requests.inc()
        self.metrics.prompt_tokens.inc(len(prompt))
        self.send(self._add_msg(r))
        return r

    def drop(self, r: Req) -> None:
        if self.reqs.pop(r.rid, None) is None:
            return
        m = self.metrics
        if r.finish is None:
            self.send({"t": "abort", "rid": r.rid})
        elif r.finish != "error":
            m.finished.inc()
            m.e2e.observe((r.t_last or time.monotonic()) - r.t0)
            m.prompt_len.observe(len(r.prompt))
            m.gen_len.observe(len(r.out))
            if len(r.out) > 1:
                m.tpot.observe((r.t_last - r.t_first) / (len(r.out) - 1))
        m.success.labels(self.model_name, r.finish or "abort").inc()

    # ------------------------------------------------------------- supervisor side
    def fail(self, reason: str) -> None:
        """No engine will serve again: end every open request with ``reason`` (503)."""
        if self.failed:
            return
        self.failed = reason
        self.metrics.failed.set(1)
        self.metrics.engine_up.set(0)
        n = 0
        for r in self.reqs.values():
            if r.finish is None:
                r.error, r.error_status, r.finish = reason, 503, "error"
                r.changed.set()
                n += 1
        if self.writer is not None:
            self.writer.close()
        log.error("not serving any more: %s; %d open request(s) ended with an error; /health answers 503",
                  reason, n)

    async def on_control(self, reader) -> None:
        """The supervisor's messages; its end closing means it is gone (this server with it)."""
        try:
            while True:
                msg = await wire.read(reader)
                if msg["t"] == "restore":
                    self.state_loss = {"reason": msg["reason"], "at": time.time(), "replace_s": msg.get("replace_s")}
                    log.warning("the anchored state is lost (%s): the next engine starts on a fresh one and "
                                "recomputes every open request from the tokens its client has", msg["reason"])
                elif msg["t"] == "fatal":
                    self.fail(msg["reason"])
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.fail("the gpu-anchor serve supervisor is gone")

    async def drain(self, timeout: float) -> None:
        """Wait until every open request's client got its ending (or ``timeout``)."""
        deadline = time.monotonic() + timeout
        while self.reqs and time.monotonic() < deadline:
            await asyncio.sleep(0.02)



def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="gpu_anchor.serve.frontend")
    ap.add_argument("--engine-socket", required=True)
    ap.add_argument("--tokenizer", default=None, help="directory with tokenizer.json (else byte fallback)")
    ap.add_argument("--chat-template", default=None, help="a file holding the Jinja chat template")
    ap.add_argument("--tool-call-parser", default=None, help="parse tool calls in replies (tool_choice auto)")
    ap.add_argument("--reasoning-parser", default=None, help="return <think> ... </think> apart, as reasoning")
    ap.add_argument("--structured-outputs", default="{}", help="JSON: disable_any_whitespace, enable_in_reasoning")
    ap.add_argument("--sampling-defaults", default="{}", help="JSON: sampling defaults (the model's generation config)")
    ap.add_argument("--lora-modules", default="{}", help="JSON: the LoRA adapters served, {name: directory}")
    ap.add_argument("--runtime-lora", action="store_true", help="serve /v1/load_lora_adapter and "
                                                               "/v1/unload_lora_adapter (lora_runtime.py)")
    ap.add_argument("--vocab-size", type=int, required=True)
    ap.add_argument("--model-name", required=True)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--port-file", default=None, help="write the bound port here (use with --port 0)")
    ap.add_argument("--started-at", type=float, default=None, help="wall time the server was started (for the "
                                                                    "ready line)")
    ap.add_argument("--control-fd", type=int, default=None, help="the supervisor's end of a socket pair")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s frontend %(levelname)s %(message)s")
    template = None
    if args.chat_template:
        with open(args.chat_template) as f:
            template = f.read()
    try:
        codec = Codec(args.tokenizer, args.vocab_size, chat_template=template)
    except ValueError as e:
        print(f"gpu-anchor serve: {e}", file=sys.stderr)
        return 2
    # The key comes in the environment, not on the command line (where `ps` would show it).
    fe = Frontend(codec, args.model_name, args.max_model_len, args.vocab_size,
                  api_key=os.environ.get("GPU_ANCHOR_SERVE_API_KEY") or None, started_at=args.started_at,
                  tool_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
                  defaults=json.loads(args.sampling_defaults), structured=json.loads(args.structured_outputs),
                  adapters=json.loads(args.lora_modules), runtime_lora=args.runtime_lora)

    async def run():
        if os.path.exists(args.engine_socket):
            os.unlink(args.engine_socket)
        server = await asyncio.start_unix_server(fe.on_engine, path=args.engine_socket)
        runner = web.AppRunner(make_app(fe), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, args.host, args.port)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        fe.url = f"http://{args.host}:{port}"
        if args.port_file:
            tmp = args.port_file + ".tmp"
            with open(tmp, "w") as f:
                f.write(str(port))
            os.replace(tmp, args.port_file)
        log.info("listening on %s; /health answers 503 until the engine is loaded", fe.url)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda s=sig: (fe.fail(f"the server is shutting down "
                                                                f"({signal.Signals(s).name})"), stop.set()))
        tasks = []
        if args.control_fd is not None:
            reader, _ = await asyncio.open_unix_connection(sock=socket.socket(fileno=args.control_fd))
            tasks.append(asyncio.create_task(fe.on_control(reader)))
        async with server:
            while not stop.is_set() and not any(t.done() for t in tasks):     # done: the supervisor is gone
                try:
                    await asyncio.wait_for(stop.wait(), 0.5)
                except asyncio.TimeoutError:
                    pass
            await fe.drain(10.0)         # every open stream gets its error event before the exit
        await runner.cleanup()

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
