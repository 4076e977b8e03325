"""The OpenAI-compatible HTTP frontend: its own process, torch-free, owns client connections.

    python -m gpu_anchor.serve.frontend --engine-socket PATH --model-dir DIR [--port 8000]

Routes: ``/v1/completions``, ``/v1/chat/completions`` (JSON or SSE streams), ``/v1/models``,
``/health``, ``/metrics`` (Prometheus text), ``POST /admin/migrate`` (``gpu-anchor migrate``:
the engine moves in place, the connection stays).  The engine process connects to
``--engine-socket``; when it dies, open streams stay open and new requests queue.  When an
engine (re)connects, its ``hello`` lists the requests it restored; every other open request
is re-sent with the tokens its client already has.  Tokens carry their index, so
duplicates from a replay are dropped — and compared: a replayed token that differs from
the delivered one counts in ``gpu_anchor_serve_token_mismatch_total`` (must stay 0).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import sys
import time
import uuid

from aiohttp import web

from . import wire
from .tokenizer import Codec

log = logging.getLogger("gpu_anchor.serve.frontend")


class Req:
    def __init__(self, rid, prompt, params, stop):
        self.rid, self.prompt, self.params, self.stop = rid, prompt, params, stop
        self.out: list[int] = []
        self.finish: str | None = None
        self.error: str | None = None
        self.changed = asyncio.Event()
        self.resyncing = False       # a replay disagreed: ignore the engine until it adopts ours
        self.text: str | None = None     # final text when a stop string cut it
        self.t0 = time.monotonic()


class Frontend:
    def __init__(self, codec: Codec, model_name: str, max_model_len: int) -> None:
        self.codec, self.model_name, self.max_model_len = codec, model_name, max_model_len
        self.reqs: dict[str, Req] = {}
        self.writer = None
        self.engine_pid = None
        self.m = dict(requests=0, finished=0, tokens=0, connects=0, mismatch=0, dup=0, errors=0)
        self.last_timings: dict = {}
        self.down_since = time.monotonic()
        self.migrations: dict[str, asyncio.Future] = {}   # mid -> cut-over report
        self.last_migration: dict = {}

    # ------------------------------------------------------------- engine side
    def _send(self, obj) -> None:
        if self.writer is not None:
            self.writer.write(wire.encode(obj))

    def _add_msg(self, r: Req) -> dict:
        return {"t": "add", "rid": r.rid, "prompt": r.prompt, "params": r.params, "out": r.out}

    async def on_engine(self, reader, writer) -> None:
        try:
            hello = await wire.read(reader)
        except Exception:
            writer.close()
            return
        if self.writer is not None:            # a stale connection: the new engine wins
            self.writer.close()
        self.engine_pid = hello["pid"]
        self.m["connects"] += 1
        self.last_timings = dict(hello.get("timings", {}), down_s=time.monotonic() - self.down_since)
        for note in hello.get("notes", []):
            log.warning("engine %s: %s", self.engine_pid, note)
        held = set(hello["rids"])
        self.writer = writer
        for r in self.reqs.values():
            r.resyncing = False          # the new engine replays; a mismatch re-triggers it
        for rid in held - set(self.reqs):
            self._send({"t": "abort", "rid": rid})
        for r in list(self.reqs.values()):
            if r.rid not in held and r.finish is None:
                self._send(self._add_msg(r))
        try:
            while True:
                msg = await wire.read(reader)
                if msg["t"] == "toks":
                    for rid, i, ids, fin in msg["ev"]:
                        self._apply(rid, i, ids, fin)
                elif msg["t"] == "err":
                    r = self.reqs.get(msg["rid"])
                    if r is not None:
                        r.error, r.finish = msg["msg"], "error"
                        r.changed.set()
                elif msg["t"] == "readd_ok":
                    r = self.reqs.get(msg["rid"])
                    if r is not None:
                        r.resyncing = False
                elif msg["t"] == "stats":
                    self.last_timings.update({k: v for k, v in msg.items() if k != "t"})
                elif msg["t"] in ("migrated", "migrate_done"):
                    self.last_migration = dict(msg, phase=msg["t"])
                    fut = self.migrations.pop(msg.get("mid"), None) if msg["t"] == "migrated" else None
                    if fut is not None and not fut.done():
                        fut.set_result(msg)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            if self.writer is writer:
                for fut in self.migrations.values():
                    if not fut.done():
                        fut.set_result({"error": "the engine died during the migration; it restarts where "
                                                 "its state was last complete"})
                self.migrations.clear()
                self.writer = None
                self.engine_pid = None
                self.down_since = time.monotonic()
                log.warning("engine disconnected; %d open request(s) wait for the next one", len(self.reqs))
            writer.close()

    def _apply(self, rid, i, ids, fin) -> None:
        r = self.reqs.get(rid)
        if r is None or r.finish is not None or r.resyncing:
            return
        for j, t in enumerate(ids):
            k = i + j
            if k < len(r.out):
                self.m["dup"] += 1
                if r.out[k] != t:
                    # The client has token r.out[k]: make the engine continue from what was
                    # delivered (it recomputes the KV), never from its own different replay.
                    self.m["mismatch"] += 1
                    log.error("request %s: replayed token %d is %d, delivered %d; resyncing", rid, k, t,
                              r.out[k])
                    r.resyncing = True
                    self._send(dict(self._add_msg(r), t="readd"))
                    return
            elif k == len(r.out):
                r.out.append(t)
                self.m["tokens"] += 1
        if r.stop:
            text = self.codec.decode(r.out)
            cut = min((text.find(s) for s in r.stop if s in text), default=-1)
            if cut >= 0:
                r.text = text[:cut]
                fin = "stop"
                self._send({"t": "abort", "rid": rid})
        if fin:
            r.finish = fin
        r.changed.set()

    def submit(self, prompt, params, stop) -> Req:
        r = Req(f"cmpl-{uuid.uuid4().hex}", prompt, params, stop)
        self.reqs[r.rid] = r
        self.m["requests"] += 1
        self._send(self._add_msg(r))
        return r

    def drop(self, r: Req) -> None:
        if self.reqs.pop(r.rid, None) is not None:
            if r.finish is None:
                self._send({"t": "abort", "rid": r.rid})
            else:
                self.m["finished"] += 1

    # ------------------------------------------------------------- HTTP side
    def _params(self, body: dict, prompt_len: int) -> tuple[dict, list[str]]:
        if body.get("n", 1) != 1:
            raise web.HTTPBadRequest(text=_err("only n=1 is supported"), content_type="application/json")
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
        if max_tokens is None:
            max_tokens = max(1, min(256, self.max_model_len - prompt_len - 1))
        temperature = body.get("temperature")
        seed = body.get("seed")
        temperature = 1.0 if temperature is None else float(temperature)
        if temperature > 0 and seed is None:   # fixed now, so a replay after a crash draws the same tokens
            seed = random.getrandbits(62)
        params = {"max_tokens": int(max_tokens), "temperature": temperature,
                  "top_p": float(body.get("top_p") if body.get("top_p") is not None else 1.0),
                  "top_k": int(body.get("top_k") or 0), "seed": seed,
                  "stop_token_ids": list(body.get("stop_token_ids") or []),
                  "ignore_eos": bool(body.get("ignore_eos", False))}
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else list(stop)
        try:
            from .sequence import SamplingParams
            SamplingParams.from_dict(params)
        except (ValueError, TypeError) as e:
            raise web.HTTPBadRequest(text=_err(str(e)), content_type="application/json")
        if prompt_len + params["max_tokens"] > self.max_model_len:
            raise web.HTTPBadRequest(text=_err(f"prompt ({prompt_len}) + max_tokens ({params['max_tokens']}) "
                                               f"exceeds the context length {self.max_model_len}"),
                                     content_type="application/json")
        return params, stop

    async def _body(self, request) -> dict:
        try:
            body = await request.json()
        except Exception:
            raise web.HTTPBadRequest(text=_err("body must be JSON"), content_type="application/json")
        if not isinstance(body, dict):
            raise web.HTTPBadRequest(text=_err("body must be a JSON object"), content_type="application/json")
        return body

    async def completions(self, request):
        body = await self._body(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = self.codec.encode(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            ids = prompt
        else:
            raise web.HTTPBadRequest(text=_err("prompt must be a non-empty string or a list of token ids"),
                                     content_type="application/json")
        if not ids:
            raise web.HTTPBadRequest(text=_err("the prompt encodes to no tokens"), content_type="application/json")
        return await self._serve(request, body, ids, chat=False)

    async def chat(self, request):
        body = await self._body(request)
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise web.HTTPBadRequest(text=_err("messages must be a non-empty list"), content_type="application/json")
        try:
            ids = self.codec.encode(self.codec.chat(msgs))
        except ValueError as e:
            raise web.HTTPBadRequest(text=_err(str(e)), content_type="application/json")
        return await self._serve(request, body, ids, chat=True)

    async def _serve(self, request, body, ids, chat: bool):
        params, stop = self._params(body, len(ids))
        r = self.submit(ids, params, stop)
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"
        try:
            if not body.get("stream"):
                while r.finish is None:
                    r.changed.clear()
                    await r.changed.wait()
                if r.error:
                    return web.json_response({"error": {"message": r.error, "type": "invalid_request_error"}},
                                             status=400)
                text = r.text if r.text is not None else self.codec.decode(r.out)
                choice = ({"index": 0, "message": {"role": "assistant", "content": text},
                           "finish_reason": r.finish} if chat else
                          {"index": 0, "text": text, "finish_reason": r.finish, "logprobs": None})
                return web.json_response({"id": r.rid, "object": kind, "created": created,
                                          "model": self.model_name, "choices": [choice],
                                          "usage": _usage(len(ids), len(r.out))})
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await resp.prepare(request)
            obj = kind + ".chunk" if chat else kind
            first = True
            sent = ""
            hold = max((len(x) for x in r.stop), default=1) - 1   # a stop string may still be forming

            async def emit(delta: str, fin):
                nonlocal first
                if chat:
                    d = {"content": delta} if delta else {}
                    if first:
                        d["role"] = "assistant"
                    choice = {"index": 0, "delta": d, "finish_reason": fin}
                else:
                    choice = {"index": 0, "text": delta, "finish_reason": fin, "logprobs": None}
                first = False
                chunk = {"id": r.rid, "object": obj, "created": created, "model": self.model_name,
                         "choices": [choice]}
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")

            n_seen = 0
            while True:
                r.changed.clear()
                done = r.finish is not None
                if r.error:
                    await resp.write(b"data: " + json.dumps({"error": {"message": r.error}}).encode() + b"\n\n")
                    break
                if len(r.out) > n_seen or done:
                    n_seen = len(r.out)
                    target = r.text if r.text is not None else self.codec.decode(r.out)
                    if not done:
                        target = target[:len(target) - hold] if hold else target
                        target = target.rstrip("\ufffd")   # incomplete UTF-8: wait for the next token
                    delta = target[len(sent):] if target.startswith(sent) else ""
                    # one chunk per token batch even when its text is held back or empty
                    # (special tokens, partial UTF-8): clients see progress token by token
                    sent += delta
                    await emit(delta, r.finish if done else None)
                if done:
                    break
                await r.changed.wait()
            await resp.write(b"data: [DONE]\n\n")
            return resp
        finally:
            self.drop(r)

    async def migrate(self, request):
        """``POST /admin/migrate {"device", "socket"?}``: move the live engine there (see
        ``gpu-anchor migrate``).  Answers after the cut-over, with its timings."""
        body = await self._body(request)
        if not isinstance(body.get("device"), str):
            raise web.HTTPBadRequest(text=_err("give the destination device, e.g. cuda:1 or cpu"),
                                     content_type="application/json")
        if self.writer is None:
            return web.json_response({"error": {"message": "no engine is connected"}}, status=503)
        mid = uuid.uuid4().hex
        fut = self.migrations[mid] = asyncio.get_running_loop().create_future()
        self._send({"t": "migrate", "mid": mid, "device": body["device"], "socket": body.get("socket")})
        res = await fut
        return web.json_response(res, status=400 if res.get("error") else 200)

    async def models(self, request):
        return web.json_response({"object": "list", "data": [{"id": self.model_name, "object": "model",
                                                              "created": 0, "owned_by": "gpu-anchor"}]})

    async def health(self, request):
        up = self.writer is not None
        return web.json_response({"status": "ok" if up else "engine_down", "engine_pid": self.engine_pid,
                                  "engine_restarts": max(0, self.m["connects"] - 1), "open_requests": len(self.reqs),
                                  "last_recovery": self.last_timings, "token_mismatches": self.m["mismatch"],
                                  "last_migration": self.last_migration},
                                 status=200 if up else 503)

    async def metrics(self, request):
        p = "gpu_anchor_serve_"
        lines = [f"# TYPE {p}requests_total counter", f"{p}requests_total {self.m['requests']}",
                 f"# TYPE {p}requests_finished_total counter", f"{p}requests_finished_total {self.m['finished']}",
                 f"# TYPE {p}requests_open gauge", f"{p}requests_open {len(self.reqs)}",
                 f"# TYPE {p}generated_tokens_total counter", f"{p}generated_tokens_total {self.m['tokens']}",
                 f"# TYPE {p}replayed_tokens_total counter", f"{p}replayed_tokens_total {self.m['dup']}",
                 f"# TYPE {p}token_mismatch_total counter", f"{p}token_mismatch_total {self.m['mismatch']}",
                 f"# TYPE {p}engine_up gauge", f"{p}engine_up {int(self.writer is not None)}",
                 f"# TYPE {p}engine_restarts_total counter",
                 f"{p}engine_restarts_total {max(0, self.m['connects'] - 1)}",
                 f"# TYPE {p}last_recovery_seconds gauge"]
        for k, v in sorted(self.last_timings.items()):
            if isinstance(v, (int, float)):
                lines.append(f'{p}last_recovery_seconds{{phase="{k}"}} {v:.6f}')
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")


def _err(msg: str) -> str:
    return json.dumps({"error": {"message": msg, "type": "invalid_request_error"}})


def _usage(p: int, c: int) -> dict:
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def make_app(fe: Frontend) -> web.Application:
    app = web.Application(client_max_size=64 << 20)
    app.router.add_post("/v1/completions", fe.completions)
    app.router.add_post("/v1/chat/completions", fe.chat)
    app.router.add_get("/v1/models", fe.models)
    app.router.add_get("/health", fe.health)
    app.router.add_get("/metrics", fe.metrics)
    app.router.add_post("/admin/migrate", fe.migrate)
    return app


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="gpu_anchor.serve.frontend")
    ap.add_argument("--engine-socket", required=True)
    ap.add_argument("--tokenizer", default=None, help="directory with tokenizer.json (else byte fallback)")
    ap.add_argument("--vocab-size", type=int, required=True)
    ap.add_argument("--model-name", required=True)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--port-file", default=None, help="write the bound port here (use with --port 0)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s frontend %(levelname)s %(message)s")
    fe = Frontend(Codec(args.tokenizer, args.vocab_size), args.model_name, args.max_model_len)

    async def run():
        if os.path.exists(args.engine_socket):
            os.unlink(args.engine_socket)
        server = await asyncio.start_unix_server(fe.on_engine, path=args.engine_socket)
        runner = web.AppRunner(make_app(fe), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, args.host, args.port)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        if args.port_file:
            tmp = args.port_file + ".tmp"
            with open(tmp, "w") as f:
                f.write(str(port))
            os.replace(tmp, args.port_file)
        log.info("listening on http://%s:%d", args.host, port)
        async with server:
            await asyncio.Event().wait()

    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
