"""LoRA adapters loaded and unloaded while serving: the frontend's side (torch-free).

vLLM's ``POST /v1/load_lora_adapter`` (``{"lora_name", "lora_path"}``; ``"load_inplace": true``
replaces an adapter loaded while serving under that name, the requests on it going on with the
new weights, as in vLLM) and ``POST
/v1/unload_lora_adapter`` (``{"lora_name"}``), there when the server starts with
``--enable-lora`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` (as in vLLM).  The engine reads
and checks the adapter and writes it into a free slot (``Engine.load_lora_adapter``); only then
is its name served (``/v1/models``, a request's ``model``).

What an engine restart keeps: the engine journals each adapter it serves (``lora.py``, "What a
restart trusts"), and a new engine loads the ones loaded while serving again, into their slots,
before it restores the open requests, so a request on such an adapter resumes from its KV (a
hot standby loads them while it waits: ``TakeOver.follow_adapters``).  The
frontend also remembers the adapters it loaded with success and sends that table to each new
engine (``lora_sync``) before it re-sends the open requests: the engine keeps what it restored,
loads what it lacks, and unloads any it restored that the frontend had unloaded since.  The
adapter's files are read again then (a restarted engine that cannot read them any more logs
why and stops serving that name: its requests get an error, never the base model's tokens).
"""
from __future__ import annotations

import asyncio
import logging
import uuid

from aiohttp import web

from .openai_checks import ApiError, bad

log = logging.getLogger("gpu_anchor.serve.frontend")


class RuntimeAdapters:
    def __init__(self, fe) -> None:
        self.fe = fe
        self.loaded: dict[str, str] = {}      # name -> path, in load order: loaded with success, not unloaded
        self.calls: dict[str, asyncio.Future] = {}

    # ------------------------------------------------------------------ the engine's side
    def on_hello(self) -> None:
        """A new engine: the adapters loaded while serving (no answer awaited; a ``lora_done``
        with an error comes for each one it could not load)."""
        self.fe.send({"t": "lora_sync", "adapters": list(self.loaded.items())})

    def on_done(self, msg: dict) -> None:
        fut = self.calls.pop(msg.get("id"), None)
        if fut is not None:
            if not fut.done():
                fut.set_result(msg.get("error"))
        elif msg.get("error"):           # a change sent again to a new engine failed there
            log.warning("engine %s: %s", self.fe.engine_pid, msg["error"])
            name = msg.get("name")
            if name in self.fe.surface.adapters:
                self._forget(name)

    def on_lost(self) -> None:
        for fut in self.calls.values():
            if not fut.done():
                fut.set_result("the engine was lost before it answered; nothing changed, try again")
        self.calls.clear()

    async def _call(self, op: str, name: str, path: str | None, inplace: bool = False) -> None:
        if self.fe.writer is None:
            raise ApiError(503, "no engine is connected; try again when /health says ok")
        cid = uuid.uuid4().hex
        fut = self.calls[cid] = asyncio.get_running_loop().create_future()
        self.fe.send({"t": "lora_" + op, "id": cid, "name": name, "path": path, "inplace": inplace})
        error = await fut
        if error:
            raise ApiError(400, error)
        if op == "load":
            self.loaded[name] = path
        else:
            self.loaded.pop(name, None)

    def _forget(self, name: str) -> None:
        self.loaded.pop(name, None)
        self.fe.surface.adapters.pop(name, None)
        if name in self.fe.surface.served:
            self.fe.surface.served.remove(name)

    # ------------------------------------------------------------------ routes
    async def load(self, request):
        name, path, inplace = await self._names(request, "lora_path")
        if name == self.fe.model_name:
            raise ApiError(400, f"'{name}' is the base model's served name; name the adapter otherwise", "lora_name")
        if name in self.fe.surface.served and not inplace:
            raise ApiError(400, f"The lora adapter '{name}' has already been loaded.", "lora_name")
        await self._call("load", name, path, inplace)
        self.fe.surface.adapters[name] = path
        if name not in self.fe.surface.served:
            self.fe.surface.served.append(name)
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, request):
        name, _, _ = await self._names(request, None)
        if name not in self.fe.surface.adapters:
            raise ApiError(404, f"The lora adapter '{name}' cannot be found.", "lora_name")
        await self._call("unload", name, None)
        self._forget(name)
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    @staticmethod
    async def _names(request, path_field: str | None) -> tuple[str, str | None, bool]:
        """``(lora_name, the path field or None, load_inplace)`` of a checked request body."""
        try:
            body = await request.json()
        except Exception:
            raise ApiError(400, "the request body must be JSON") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        fields = ("lora_name", path_field) if path_field else ("lora_name",)
        for f in fields:
            if not isinstance(body.get(f), str) or not body[f]:
                raise bad(f, f"give {f} as a non-empty string")
        extra = set(body) - set(fields) - {"lora_int_id", "load_inplace"}
        if extra:
            raise bad(sorted(extra)[0], "not a field of this request")
        if not isinstance(body.get("load_inplace", False), bool):
            raise bad("load_inplace", "give load_inplace as true or false")
        return body["lora_name"], body.get(path_field) if path_field else None, body.get("load_inplace", False)


def add_routes(app: web.Application, adapters: RuntimeAdapters) -> None:
    app.router.add_post("/v1/load_lora_adapter", adapters.load)
    app.router.add_post("/v1/unload_lora_adapter", adapters.unload)
