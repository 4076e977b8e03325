"""Stored Responses (``store``, ``previous_response_id``, ``GET`` / ``DELETE /v1/responses/{id}``),
torch-free.

OpenAI's Responses API keeps a conversation on the server: a response stored (``store`` true, the
API's default) can be continued by a later request's ``previous_response_id``, whose ``input``
then only adds to it (a tool's output, the next user turn).  The frontend keeps what that needs
per stored response: the Response itself, and the conversation up to and including its output
as chat messages (``Stored.messages``), so a continuation is the chat request of
``stored messages + new input`` (``openai_responses.to_chat``).  Instructions are not carried
over, as in OpenAI's API: each request's own ``instructions`` (if any) lead its prompt.

The store lives in the frontend process, so it outlives engine SIGKILLs and engine restarts
(a stored response is read back after one in ``tests/test_serve_responses.py``); it holds the
last ``capacity`` responses (least recently stored or continued first out) and is lost with the
frontend.  An id it no longer holds is a 404 naming it, never a silent fresh conversation.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from .openai_checks import ApiError

CAPACITY = 1024


@dataclass
class Stored:
    response: dict            # the Response, as returned
    messages: list[dict]      # the conversation through its output, as chat messages (no instructions)


def output_messages(output: list[dict]) -> list[dict]:
    """A Response's output items as the chat messages that continue a conversation: the text
    as an assistant message, the function calls as its tool calls (reasoning is not sent back)."""
    text = "".join(part.get("text", "") for item in output if item["type"] == "message"
                   for part in item.get("content") or ())
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    msg = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        msg["tool_calls"] = calls
    return [msg]


class ResponseStore:
    def __init__(self, capacity: int = CAPACITY) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, rid: str, field: str | None = None) -> Stored:
        """The stored response ``rid``; a 404 naming it (and ``field``, the request's field that
        named it) if the store does not hold it."""
        s = self._items.get(rid)
        if s is None:
            held = f" (this server keeps the last {self.capacity} stored responses)" if self._items else ""
            raise ApiError(404, f"Response with id '{rid}' not found{held}.", field)
        return s

    def history(self, rid: str) -> list[dict]:
        """The messages a request with ``previous_response_id = rid`` continues (a 404 if unknown)."""
        s = self.get(rid, "previous_response_id")
        self._items.move_to_end(rid)
        return [dict(m) for m in s.messages]

    def put(self, response: dict, messages: list[dict]) -> None:
        """Store a finished Response with the conversation before its output (``messages``)."""
        self._items[response["id"]] = Stored(response, messages + output_messages(response["output"]))
        self._items.move_to_end(response["id"])
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def delete(self, rid: str) -> dict:
        self.get(rid)
        del self._items[rid]
        return {"id": rid, "object": "response", "deleted": True}
