"""OpenAI's Responses API (``POST /v1/responses``) over the chat machinery (torch-free).

A Responses request is translated into the chat request it means (``to_chat``): ``instructions``
→ a system message; ``input`` (a string, or a list of messages, ``function_call`` and
``function_call_output`` items) → messages; ``max_output_tokens``; ``tools`` (function tools,
flat) and ``tool_choice``; ``text.format`` → ``response_format``; vLLM's sampling extras
(``top_k``, ``min_p``, ``repetition_penalty``, ``seed``) pass through.  That request is then
checked, served and recovered after a crash exactly as a chat request is; its reply is shaped
into a Response: ``output`` holds a ``reasoning`` item (with ``--reasoning-parser``), a
``message`` with one ``output_text``, and a ``function_call`` item per tool call, in that order;
``status`` is ``incomplete`` (``max_output_tokens``) when the reply was cut.

Streamed, the chat chunks become Responses events (``Events``): ``response.created`` and
``response.in_progress``, then per item ``response.output_item.added``, its deltas
(``response.reasoning_text.delta``, ``response.content_part.added`` /
``response.output_text.delta``, ``response.function_call_arguments.delta``) and its
``.done`` events, then ``response.completed`` (or ``response.incomplete``) with the whole
Response, each event numbered by ``sequence_number``; no ``[DONE]``.

Stored (``store``, true by default as in OpenAI's API): the frontend keeps the Response and its
conversation (``response_store``); ``previous_response_id`` continues it (``to_chat``'s
``history``), ``GET`` / ``DELETE /v1/responses/{id}`` read and remove it.

Not served (a 400 naming the field): ``background``, built-in tools (web search, file search,
...), inputs other than text, ``reasoning`` settings, ``truncation: auto``, ``include``,
``conversation`` objects.
"""
from __future__ import annotations

import time

from .openai_checks import ApiError, bad

_PASS = ("model", "temperature", "top_p", "stream", "parallel_tool_calls", "user", "metadata",
         "top_k", "min_p", "repetition_penalty", "seed")
_NEUTRAL = {"store": (True, False), "previous_response_id": None, "background": (False,), "reasoning": (),
            "truncation": ("disabled",), "include": ([],), "prompt": (), "conversation": ()}
_KNOWN = set(_PASS) | set(_NEUTRAL) | {"input", "instructions", "max_output_tokens", "tools", "tool_choice", "text",
                                       "stream_options"}
_RENAMED = {"max_completion_tokens": "max_output_tokens", "messages": "input", "response_format": "text.format"}


def _text(where: str, content) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(where, "must be a string or a list of text parts")
    out = []
    for k, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") \
                or not isinstance(part.get("text"), str):
            raise bad(f"{where}[{k}]", 'only text parts ({"type": "input_text", "text": ...}) are supported')
        out.append(part["text"])
    return "".join(out)


def _messages(body: dict, history: list[dict]) -> list[dict]:
    msgs = []
    if body.get("instructions") is not None:
        if not isinstance(body["instructions"], str):
            raise bad("instructions", "must be a string")
        msgs.append({"role": "system", "content": body["instructions"]})
    msgs += history
    inp = body.get("input")
    if isinstance(inp, str):
        return msgs + [{"role": "user", "content": inp}]
    if not isinstance(inp, list) or not inp:
        raise bad("input", "must be a string or a non-empty list of items")
    for i, item in enumerate(inp):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and isinstance(item.get("role"), str):
            role = "system" if item["role"] == "developer" else item["role"]
            msgs.append({"role": role, "content": _text(f"{where}.content", item.get("content"))})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise bad(where, "a function_call needs string call_id, name and arguments")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = msgs[-1] if msgs else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") and not last["content"]:
                last["tool_calls"].append(call)          # consecutive calls: one assistant turn
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise bad(f"{where}.call_id", "must be a string")
            msgs.append({"role": "tool", "tool_call_id": item["call_id"],
                         "content": _text(f"{where}.output", item.get("output"))})
        elif kind == "reasoning":
            continue                                     # earlier reasoning is not sent back to the model
        else:
            raise bad(where, "must be a message, a function_call or a function_call_output item")
    return msgs


def _tools(body: dict, chat: dict) -> None:
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise bad("tools", "must be a list")
        out = []
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("name"), str):
                raise bad(f"tools[{i}]", 'only function tools ({"type": "function", "name": ..., "parameters": '
                                         '{...}}) are served; built-in tools are not')
            f = {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}
            out.append({"type": "function", "function": f})
        chat["tools"] = out
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise bad("tool_choice", 'must be "none", "auto", "required" or {"type": "function", "name": ...}')
        choice = {"type": "function", "function": {"name": choice["name"]}}
    if choice is not None:
        chat["tool_choice"] = choice


def check(body) -> None:
    """The fields of a Responses request this server knows and serves; ``ApiError`` names one
    that is not."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for k in body:
        if k not in _KNOWN:
            raise bad(k, "unknown field (this server refuses fields it would otherwise ignore)")
    for k, allowed in _NEUTRAL.items():
        if body.get(k) is not None and allowed is not None and body[k] not in allowed:
            raise bad(k, "is not supported by this server (it runs no background responses, serves no built-in "
                         "tools, and takes no reasoning settings)")
    if body.get("previous_response_id") is not None and not isinstance(body["previous_response_id"], str):
        raise bad("previous_response_id", "must be a string")


def to_chat(body, history: list[dict] = ()) -> dict:
    """The chat request a Responses request means (module doc), continuing ``history`` (the
    messages of its ``previous_response_id``); ``ApiError`` names the Responses field."""
    check(body)
    chat = {k: body[k] for k in _PASS if k in body}
    chat["messages"] = _messages(body, list(history))
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    _tools(body, chat)
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if body.get("text") is not None and not isinstance(body["text"], dict):
        raise bad("text", 'must be {"format": {...}}')
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.get("name", "response"), "schema": fmt.get("schema", {"type": "object"})}}
    elif fmt is not None:
        chat["response_format"] = fmt
    if body.get("stream"):
        chat["stream_options"] = {"include_usage": True}      # the usage of response.completed
    return chat


def renamed(e: ApiError) -> ApiError:
    """A chat field's error under the Responses field's name."""
    for chat_name, name in _RENAMED.items():
        if e.param and e.param.startswith(chat_name):
            param = name + e.param[len(chat_name):]
            return ApiError(e.status, e.message.replace(e.param, param, 1), param)
    return e


# ------------------------------------------------------------------ replies
def _usage(u: dict | None) -> dict:
    u = u or {"prompt_tokens": 0, "completion_tokens": 0}
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": u["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["prompt_tokens"] + u["completion_tokens"]}


def _response(body: dict, rid: str, created: int, output: list, finish: str | None, usage, status=None) -> dict:
    cut = finish == "length"
    return {"id": "resp_" + rid.split("-", 1)[-1], "object": "response", "created_at": created,
            "status": status or ("incomplete" if cut else "completed"), "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if cut and status is None else None,
            "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "model": body.get("model"), "output": output, "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": body.get("previous_response_id"), "reasoning": None,
            "store": body.get("store") is not False,
            "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
            "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
            "truncation": "disabled", "usage": None if usage is None else _usage(usage), "user": body.get("user"),
            "metadata": body.get("metadata") or {}}


def _reasoning_item(rid: str, text: str, status: str = "completed") -> dict:
    return {"type": "reasoning", "id": f"rs_{rid}", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def _message_item(rid: str, text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": f"msg_{rid}", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if text is not None
            else []}


def _call_item(rid: str, call: dict, arguments: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": f"fc_{call['id']}", "call_id": call["id"],
            "name": call["function"]["name"], "arguments": arguments, "status": status}


def reply(body: dict, chat_reply: dict) -> dict:
    """The Response of a finished chat reply (``openai_replies.reply``'s body, one choice)."""
    choice, rid = chat_reply["choices"][0], chat_reply["id"]
    m, output = choice["message"], []
    if m.get("reasoning"):
        output.append(_reasoning_item(rid, m["reasoning"]))
    if m.get("content") or not m.get("tool_calls"):
        output.append(_message_item(rid, m.get("content") or ""))
    output += [_call_item(rid, c, c["function"]["arguments"]) for c in m.get("tool_calls") or ()]
    return _response(body, rid, chat_reply["created"], output, choice["finish_reason"], chat_reply["usage"])


class Events:
    """Chat chunks (``openai_replies.stream``'s, one choice) in, Responses events out."""

    def __init__(self, body: dict, rid: str, on_done=None) -> None:
        """``on_done(response)``: called with the finished Response (to store it)."""
        self.body, self.rid, self.created, self.on_done = body, rid, int(time.time()), on_done
        self.seq, self.items, self.open = 0, [], None
        self.finish = None

    def _ev(self, kind: str, **kw) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **kw}

    def start(self) -> list[dict]:
        r = _response(self.body, self.rid, self.created, [], None, None, status="in_progress")
        return [self._ev("response.created", response=r), self._ev("response.in_progress", response=r)]

    def _add(self, item: dict) -> list[dict]:
        self.items.append(item)
        self.open = item["type"]
        return [self._ev("response.output_item.added", output_index=len(self.items) - 1, item=dict(item))]

    def _close(self) -> list[dict]:
        if self.open is None:
            return []
        i, item, out = len(self.items) - 1, self.items[-1], []
        ids = {"item_id": item["id"], "output_index": i}
        if item["type"] == "reasoning":
            out.append(self._ev("response.reasoning_text.done", **ids, content_index=0,
                                text=item["content"][0]["text"]))
        elif item["type"] == "message":
            part = item["content"][0]
            out += [self._ev("response.output_text.done", **ids, content_index=0, text=part["text"], logprobs=[]),
                    self._ev("response.content_part.done", **ids, content_index=0, part=part)]
        item["status"] = "completed"
        self.open = None
        return out + [self._ev("response.output_item.done", output_index=i, item=item)]

    def convert(self, chunk: dict) -> list[dict]:
        if "error" in chunk:
            e = chunk["error"]
            return [self._ev("error", code=str(e.get("code")), message=e.get("message"), param=e.get("param"))]
        if not chunk.get("choices"):                    # the usage chunk: the last
            out = self._close()
            if not self.items:                          # an empty reply is an empty message
                out += self._add(_message_item(self.rid, "", "in_progress")) + self._close()
            r = _response(self.body, self.rid, self.created, self.items, self.finish, chunk.get("usage"))
            if self.on_done is not None:
                self.on_done(r)
            return out + [self._ev("response.incomplete" if r["status"] == "incomplete" else "response.completed",
                                   response=r)]
        c = chunk["choices"][0]
        d, out = c.get("delta") or {}, []
        if d.get("reasoning"):
            if self.open != "reasoning":
                out += self._close() + self._add(_reasoning_item(self.rid, "", "in_progress"))
            self.items[-1]["content"][0]["text"] += d["reasoning"]
            out.append(self._ev("response.reasoning_text.delta", item_id=self.items[-1]["id"],
                                output_index=len(self.items) - 1, content_index=0, delta=d["reasoning"]))
        if d.get("content"):
            if self.open != "message":
                out += self._close() + self._add(_message_item(self.rid, None, "in_progress"))
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                self.items[-1]["content"].append(part)
                out.append(self._ev("response.content_part.added", item_id=self.items[-1]["id"],
                                    output_index=len(self.items) - 1, content_index=0, part=dict(part)))
            self.items[-1]["content"][0]["text"] += d["content"]
            out.append(self._ev("response.output_text.delta", item_id=self.items[-1]["id"],
                                output_index=len(self.items) - 1, content_index=0, delta=d["content"], logprobs=[]))
        for call in d.get("tool_calls") or ():            # each call comes whole (tool_calls.split)
            out += self._close() + self._add(_call_item(self.rid, call, "", "in_progress"))
            ids = {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}
            args = call["function"]["arguments"]
            self.items[-1]["arguments"] = args
            out += [self._ev("response.function_call_arguments.delta", **ids, delta=args),
                    self._ev("response.function_call_arguments.done", **ids, arguments=args)]
            out += self._close()
        if c.get("finish_reason"):
            self.finish = c["finish_reason"]
        return out
