"""The frontend's HTTP side: the OpenAI-compatible routes, ``/health``, ``/metrics`` and
``/admin/migrate`` over a ``frontend.Frontend`` (the engine side: open requests, the engine
connection, replays).  A request is checked (``openai_api``), encoded, submitted to the
frontend and answered as JSON or an SSE stream (``openai_replies``); every error leaves as OpenAI-shaped JSON."""
from __future__ import annotations

import asyncio
import hmac
import logging
import random
import uuid

from aiohttp import web

from . import openai_api as api
from . import openai_replies as replies
from . import openai_responses
from . import lora_runtime, reasoning
from . import wire
from .openai_checks import ApiError, bad
from .tokenizer import TemplateError

log = logging.getLogger("gpu_anchor.serve.frontend")


class Routes:
    def __init__(self, fe) -> None:
        self.fe = fe

    @web.middleware
    async def guard(self, request, handler):
        """The API key, and errors as OpenAI-shaped JSON (never a traceback)."""
        try:
            if self.fe.api_key and request.path.startswith(("/v1/", "/admin/")):
                got = request.headers.get("Authorization", "").encode()
                if not hmac.compare_digest(got, b"Bearer " + self.fe.api_key.encode()):
                    raise ApiError(401, "missing or wrong API key (send Authorization: Bearer KEY)")
            return await handler(request)
        except ApiError as e:
            return web.json_response(e.body(), status=e.status)
        except web.HTTPException:
            raise
        except Exception:
            log.exception("%s %s failed", request.method, request.path)
            return web.json_response(ApiError(500, "internal server error (logged by the server)").body(),
                                     status=500)

    async def _body(self, request) -> dict:
        try:
            return await request.json()
        except Exception:
            raise ApiError(400, "the request body must be JSON") from None

    async def completions(self, request):
        return await self._serve(request, chat=False)

    async def chat(self, request):
        return await self._serve(request, chat=True)

    def _encode(self, q: api.Request, prompt=None) -> list[int]:
        """The token ids of the chat's messages, or of ``prompt`` (one of a completion's)."""
        if q.chat:
            try:
                kwargs = dict(q.template_kwargs, **({"tools": q.tools} if q.tools else {}))
                text = self.fe.codec.chat(q.messages, q.add_generation_prompt, q.continue_final, **kwargs)
            except TemplateError as e:
                raise bad("messages", str(e)) from None
            q.thinking_opened = q.reasoning and reasoning.opened(text)
            if q.reasoning and q.sampling.get("grammar") is not None and not q.grammar_in_reasoning:
                self._grammar_after(q, text)
            return self.fe.codec.encode(text, q.add_special_tokens)
        return self.fe.codec.encode(prompt, q.add_special_tokens) if isinstance(prompt, str) else prompt

    def _grammar_after(self, q: api.Request, text: str) -> None:
        """With a reasoning parser, the grammar constrains the answer: the tokens after the reply's
        ``</think>``, unless the prompt closed the reasoning itself (``grammar_matchers``)."""
        if text.rfind(reasoning.END) > text.rfind(reasoning.START):
            return
        end = self.fe.codec.token_id(reasoning.END)
        if end is None:
            raise bad("response_format", f"structured output with --reasoning-parser needs {reasoning.END} to be one "
                                         "token of the model's vocabulary (it is not): serve this model without "
                                         "--reasoning-parser")
        q.sampling["grammar_after"] = end

    def _prompt_ids(self, q: api.Request, prompt=None) -> list[int]:
        """``_encode``, its last ``truncate_prompt_tokens`` if given, checked: some tokens, fewer
        than the context length."""
        ids, where = self._encode(q, prompt), "messages" if q.chat else "prompt"
        if q.truncate is not None:
            ids = ids[-q.truncate:]
        if not ids:
            raise bad(where, "encodes to no tokens")
        if len(ids) >= self.fe.max_model_len:
            raise bad(where, f"{len(ids)} tokens; the context length is {self.fe.max_model_len}")
        return ids

    def _params(self, q: api.Request, prompt_len: int) -> dict:
        rest = self.fe.max_model_len - prompt_len
        max_tokens = q.max_tokens if q.max_tokens is not None else min(rest, q.default_max_tokens or rest)
        if prompt_len + max_tokens > self.fe.max_model_len:
            raise bad("max_completion_tokens" if q.chat and q.max_tokens is not None else "max_tokens",
                      f"the prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the context length "
                      f"{self.fe.max_model_len}")
        if q.sampling.get("min_tokens", 0) > max_tokens:
            raise bad("min_tokens", f"{q.sampling['min_tokens']} is more than max_tokens ({max_tokens})")
        params = dict(q.sampling, max_tokens=max_tokens, logprobs=q.logprobs)
        if params["temperature"] > 0 and params["seed"] is None:
            params["seed"] = random.getrandbits(62)   # fixed now: a replay after a crash draws the same tokens
        from .sequence import SamplingParams
        try:
            SamplingParams.from_dict(params)          # the engine's own check, to fail here and not there
        except (ValueError, TypeError) as e:
            raise ApiError(400, str(e)) from None
        return params

    async def responses(self, request):
        """OpenAI's Responses API, served as the chat request it means (``openai_responses``),
        continuing a stored response's conversation and stored in turn (``response_store``)."""
        body = await self._body(request)
        openai_responses.check(body)
        prev = body.get("previous_response_id")
        chat_body = openai_responses.to_chat(body, self.fe.responses.history(prev) if prev is not None else ())
        # the conversation before this reply, as a later previous_response_id continues it
        before = [dict(m) for m in chat_body["messages"][1 if body.get("instructions") is not None else 0:]]
        try:
            q = api.parse(chat_body, True, self.fe.surface)
        except ApiError as e:
            raise openai_responses.renamed(e) from None
        keep = None if body.get("store") is False else (lambda response: self.fe.responses.put(response, before))
        return await self._serve(request, True, q, body, keep)

    async def stored_response(self, request):
        return web.json_response(self.fe.responses.get(request.match_info["rid"]).response)

    async def delete_response(self, request):
        return web.json_response(self.fe.responses.delete(request.match_info["rid"]))

    async def _serve(self, request, chat: bool, q: api.Request | None = None, responses_body: dict | None = None,
                     on_response=None):
        """A completions or chat request (``q``: already parsed, from a Responses request whose
        body is ``responses_body``: its reply is shaped as a Response, which ``on_response``
        gets when it is finished)."""
        q = q or api.parse(await self._body(request), chat, self.fe.surface)
        if q.sampling.get("grammar") is not None and self.fe.codec.kind != "tokenizer.json":
            raise ApiError(400, "structured output needs the model's tokenizer.json (this server decodes bytes)")
        if self.fe.failed:
            raise ApiError(503, self.fe.failed)
        # every prompt checked before any is submitted: a bad one fails the request whole
        prompts = [(None, self._prompt_ids(q))] if q.chat else [(p, self._prompt_ids(q, p)) for p in q.prompts]
        todo = [(text, ids, self._params(q, len(ids))) for text, ids in prompts]
        rs = []
        for text, ids, params in todo:
            # choice i: a request of its own, seeded seed + i (greedy choices are alike, as in vLLM)
            for i in range(q.n):
                r = self.fe.submit(ids, dict(params, seed=None if params["seed"] is None else params["seed"] + i), q)
                r.prompt_text = text if isinstance(text, str) else None
                rs.append(r)
        try:
            if q.stream:
                events = None if responses_body is None else openai_responses.Events(responses_body, rs[0].rid,
                                                                                      on_response)
                return await replies.stream(request, self.fe.codec, rs, q.n, events)
            for r in rs:
                while r.finish is None:
                    r.changed.clear()
                    await r.changed.wait()
                if r.error:
                    raise ApiError(r.error_status, r.error)
            out = replies.reply(self.fe.codec, rs, q.n)
            if responses_body is not None:
                out = openai_responses.reply(responses_body, out)
                if on_response is not None:
                    on_response(out)
            return web.json_response(out)
        finally:
            for r in rs:
                self.fe.drop(r)

    async def tokenize(self, request):
        """vLLM's ``POST /tokenize``: the token ids a completion's ``prompt`` or a chat's
        ``messages`` (through the chat template) would be, without generating."""
        q, strs = api.parse_tokenize(await self._body(request), [self.fe.model_name])
        ids = self._encode(q, None if q.chat else q.prompts[0])
        return web.json_response({"count": len(ids), "max_model_len": self.fe.max_model_len, "tokens": ids,
                                  "token_strs": [self.fe.codec.token_text(t) for t in ids] if strs else None})

    async def detokenize(self, request):
        """vLLM's ``POST /detokenize``: ``tokens`` as text (special tokens kept)."""
        ids = api.parse_detokenize(await self._body(request), [self.fe.model_name], self.fe.vocab_size)
        return web.json_response({"prompt": self.fe.codec.decode(ids, skip_special_tokens=False)})

    async def migrate(self, request):
        """``POST /admin/migrate {"device", "socket"?}``: move the live engine there (see
        ``gpu-anchor migrate``).  Answers after the cut-over, with its timings."""
        body = await self._body(request)
        if not isinstance(body, dict) or not isinstance(body.get("device"), str):
            raise bad("device", "give the destination device, e.g. cuda:1 or cpu")
        if self.fe.writer is None:
            raise ApiError(503, "no engine is connected")
        mid = uuid.uuid4().hex
        fut = self.fe.migrations[mid] = asyncio.get_running_loop().create_future()
        self.fe.send({"t": "migrate", "mid": mid, "device": body["device"], "socket": body.get("socket")})
        res = await fut
        return web.json_response(res, status=400 if res.get("error") else 200)

    def _model_card(self, name: str) -> dict:
        """The base model's card, or a LoRA adapter's (its parent the base, its root the
        adapter's directory, as vLLM lists them)."""
        path = self.fe.surface.adapters.get(name)
        card = {"id": name, "object": "model", "created": 0, "owned_by": "gpu-anchor",
                "max_model_len": self.fe.max_model_len}
        return card if path is None else dict(card, root=path, parent=self.fe.model_name)

    async def models(self, request):
        return web.json_response({"object": "list", "data": [self._model_card(n) for n in self.fe.surface.served]})

    async def model(self, request):
        if request.match_info["name"] not in self.fe.surface.served:
            raise ApiError(404, f"The model `{request.match_info['name']}` does not exist.", "model")
        return web.json_response(self._model_card(request.match_info["name"]))

    async def health(self, request):
        up = self.fe.writer is not None and not self.fe.failed
        # starting: no engine connected yet; loading: one is building; engine_down: lost, the next one
        # comes; failed: none will (a crash loop, or the server is stopping)
        status = "failed" if self.fe.failed else "ok" if up else "loading" if self.fe.loading else \
            "starting" if not self.fe.connects else "engine_down"
        body = {"status": status, **({"reason": self.fe.failed} if self.fe.failed else {}),
                "engine_pid": self.fe.engine_pid, "engine_restarts": max(0, self.fe.connects - 1),
                "open_requests": len(self.fe.reqs), "last_recovery": self.fe.last_timings,
                "token_mismatches": self.fe.mismatches, "last_migration": self.fe.last_migration,
                "last_state_loss": self.fe.state_loss}
        if self.fe.loading and not up:
            body["loading"] = dict(self.fe.loading, message=wire.describe_loading(self.fe.loading))
        return web.json_response(body, status=200 if up else 503)

    async def version(self, request):
        """vLLM's ``GET /version``: this server's version (open, as vLLM's)."""
        from gpu_anchor import __version__
        return web.json_response({"version": __version__})

    async def ping(self, request):
        """vLLM's ``/ping`` (SageMaker's health check): 200 while an engine serves, else 503."""
        up = self.fe.writer is not None and not self.fe.failed
        return web.json_response({} if up else {"status": "unavailable"}, status=200 if up else 503)

    async def metrics_page(self, request):
        m = self.fe.metrics
        m.open.set(len(self.fe.reqs))
        if self.fe.writer is None:                 # no engine: every open request waits for one
            m.running.set(0)
            m.waiting.set(sum(r.finish is None for r in self.fe.reqs.values()))
        data, ctype = m.exposition(request.headers.get("Accept"))
        return web.Response(body=data, headers={"Content-Type": ctype})


def make_app(fe) -> web.Application:
    """The aiohttp application serving ``fe``."""
    routes = Routes(fe)
    app = web.Application(client_max_size=64 << 20, middlewares=[routes.guard])
    app.router.add_post("/v1/completions", routes.completions)
    app.router.add_post("/v1/chat/completions", routes.chat)
    app.router.add_post("/v1/responses", routes.responses)
    app.router.add_get("/v1/responses/{rid}", routes.stored_response)
    app.router.add_delete("/v1/responses/{rid}", routes.delete_response)
    app.router.add_get("/v1/models", routes.models)
    app.router.add_get("/v1/models/{name:.+}", routes.model)   # hub ids hold a slash
    app.router.add_post("/tokenize", routes.tokenize)
    app.router.add_post("/detokenize", routes.detokenize)
    app.router.add_get("/health", routes.health)
    app.router.add_get("/version", routes.version)
    app.router.add_get("/ping", routes.ping)
    app.router.add_post("/ping", routes.ping)
    app.router.add_get("/metrics", routes.metrics_page)
    app.router.add_post("/admin/migrate", routes.migrate)
    if fe.runtime_lora is not None:
        lora_runtime.add_routes(app, fe.runtime_lora)
    return app
