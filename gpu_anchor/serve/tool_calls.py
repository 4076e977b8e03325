"""Tool calls in a model's reply, in the Hermes format and Llama 3's JSON one (torch-free).

Qwen2.5 / Qwen3, the Hermes models and many fine-tunes answer a chat whose template lists
``tools`` with blocks like::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

``split(text, final)`` turns such a reply into the chat API's ``content`` and ``tool_calls``
(vLLM's ``--tool-call-parser hermes``; ``split_json_calls`` is ``llama3_json``'s,
``split_python_calls`` ``pythonic``'s, ``split_mistral_calls`` ``mistral``'s; ``parse`` picks by
the parser's name).  The contract:

- ``calls``: each ``<tool_call>`` block whose JSON is an object with a string ``name`` and an
  object ``arguments`` (or none: ``{}``; a string holding a JSON object is read), in order,
  as ``(name, arguments as JSON text)``.
- ``content``: in the order of the text, any text before, between or after blocks that is not
  blank (blanks beside a call, such as Qwen3's ``\n\n`` after its reasoning, are dropped), and
  each block that is not a call (bad JSON, no ``name``; an unclosed block at the end)
  verbatim: nothing the model wrote is lost silently.  A reply with no block is its content.
- **Monotone**: for any text ``t`` and any longer text ``t + u``, ``split(t, False)``'s
  content is a prefix of ``split(t + u, final)``'s, and its calls are the first of its calls.
  What is still undecided (a tag being written, an open block, blanks that a block may follow,
  text after a block that the next block may show to be a separator) is held back until it is
  decided or ``final``.  So a
  stream sends the differences, and what it sends adds up to the reply that is not streamed.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"     # Llama 3's: what follows is a call (when kept in the text)
PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"     # Llama 4's, around pythonic calls
MISTRAL_CALLS = "[TOOL_CALLS]"     # Mistral's, before its JSON list of calls (a special token: often dropped)
PARSERS = ("hermes", "llama3_json", "pythonic", "mistral")     # --tool-call-parser values this server has


@dataclass
class Split:
    content: str = ""
    calls: list[tuple[str, str]] = field(default_factory=list)


def partial_tag(s: str, tag: str) -> int:
    """How many characters at the end of ``s`` may be the start of ``tag``."""
    for k in range(min(len(tag) - 1, len(s)), 0, -1):
        if s.endswith(tag[:k]):
            return k
    return 0


def _object_call(obj) -> tuple[str, str] | None:
    """``{"name": ..., "arguments" (or Llama's "parameters"): {...}}`` as (name, arguments as JSON text)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):           # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


def _call(body: str) -> tuple[str, str] | None:
    try:
        return _object_call(json.loads(body))
    except ValueError:
        return None


def split(text: str, final: bool, max_calls: int | None = None) -> Split:
    """``text`` (a reply so far; ``final``: all of it) as content and tool calls (module doc);
    ``max_calls``: the calls after the first ``max_calls`` are dropped (``parallel_tool_calls``
    false, as vLLM does it: the model is not stopped, its further calls are not returned)."""
    out, pos, first = Split(), 0, True
    content = []
    while True:
        i = text.find(OPEN, pos)
        if i < 0:
            rest = text[pos:]
            if first and final:         # no block at all: the reply is its content
                content.append(rest)
            elif first:                 # sent as it comes, but a tag being written, or blanks alone
                piece = rest[:len(rest) - partial_tag(rest, OPEN)]
                if piece.strip():
                    content.append(piece)
            elif final and rest.strip():
                content.append(rest)
            break
        gap = text[pos:i]
        if gap.strip():
            content.append(gap)
        first = False
        j = text.find(CLOSE, i + len(OPEN))
        if j < 0:                       # an open block: decided at the end
            if final:
                call = _call(text[i + len(OPEN):])
                if call:
                    out.calls.append(call)
                else:
                    content.append(text[i:])
            break
        call = _call(text[i + len(OPEN):j])
        if call:
            out.calls.append(call)
        else:
            content.append(text[i:j + len(CLOSE)])
        pos = j + len(CLOSE)
    out.content = "".join(content)
    if max_calls is not None:
        del out.calls[max_calls:]
    return out


def split_json_calls(text: str, final: bool) -> Split:
    """Llama 3.1 / 3.2's JSON tool calls (vLLM's ``llama3_json``): a reply that starts, after
    blanks, with ``<|python_tag|>`` or ``{`` is one call ``{"name": ..., "parameters": {...}}``
    or several separated by ``;``, decided at the end (held back until then); if any piece is
    not a call, the whole reply is content.  A reply that starts otherwise is content, sent as
    it comes (blanks, or the tag being written, held back).  Monotone as ``split``."""
    head = text.lstrip()
    if not head or not final and PYTHON_TAG.startswith(head):
        return Split(content=text if final else "")
    if not (head.startswith(PYTHON_TAG) or head.startswith("{")):
        return Split(content=text)
    if not final:
        return Split()
    body, calls, at, dec = head.removeprefix(PYTHON_TAG), [], 0, json.JSONDecoder()
    while True:
        while at < len(body) and body[at].isspace():
            at += 1
        if at == len(body) and calls:
            return Split(calls=calls)
        try:
            obj, at = dec.raw_decode(body, at)
        except ValueError:
            return Split(content=text)
        call = _object_call(obj)
        if call is None:
            return Split(content=text)
        calls.append(call)
        while at < len(body) and body[at].isspace():
            at += 1
        if at < len(body):
            if body[at] != ";":
                return Split(content=text)
            at += 1


def _python_calls(body: str) -> list[tuple[str, str]] | None:
    """``[f(a=1, b="x"), g()]`` as calls, or None: a list of calls by name with keyword arguments
    whose values are Python literals (read with ``ast.literal_eval``, never run)."""
    import ast
    try:
        tree = ast.parse(body.strip(), mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for c in tree.elts:
        if not isinstance(c, ast.Call) or not isinstance(c.func, ast.Name) or c.args \
                or any(k.arg is None for k in c.keywords):
            return None
        try:
            args = {k.arg: ast.literal_eval(k.value) for k in c.keywords}
            calls.append((c.func.id, json.dumps(args, ensure_ascii=False)))
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return None
    return calls


def split_python_calls(text: str, final: bool) -> Split:
    """Calls written as a Python list (vLLM's ``pythonic``: Llama 3.2 and 4, ToolACE):
    ``[get_weather(city="Paris"), get_time()]``, the whole reply (after blanks, or after
    ``<|python_start|>`` and before ``<|python_end|>`` when the tokenizer keeps them); decided at
    the end; a reply that is not such a list is content.  Monotone as ``split``."""
    head = text.lstrip()
    if not head or not final and PYTHON_START.startswith(head):
        return Split(content=text if final else "")
    if not (head.startswith("[") or head.startswith(PYTHON_START)):
        return Split(content=text)
    if not final:
        return Split()
    calls = _python_calls(head.removeprefix(PYTHON_START).strip().removesuffix(PYTHON_END))
    return Split(calls=calls) if calls else Split(content=text)


def split_mistral_calls(text: str, final: bool) -> Split:
    """Mistral 7B v0.3's calls (vLLM's ``mistral``, its JSON form): ``[TOOL_CALLS]`` (when the
    tokenizer keeps it in the text) and a JSON list of ``{"name", "arguments"}``, the whole reply;
    decided at the end; a reply that is not such a list is content.  Monotone as ``split``."""
    head = text.lstrip()
    if not head or not final and (MISTRAL_CALLS.startswith(head) or head == "["):
        return Split(content=text if final else "")
    if not (head.startswith(MISTRAL_CALLS) or head.startswith("[{") or head.startswith("[ ")):
        return Split(content=text)
    if not final:
        return Split()
    try:
        items = json.loads(head.removeprefix(MISTRAL_CALLS))
    except ValueError:
        return Split(content=text)
    calls = [_object_call(c) for c in items] if isinstance(items, list) and items else [None]
    return Split(calls=calls) if all(calls) else Split(content=text)


def parse(text: str, final: bool, parser: str = "hermes", max_calls: int | None = None) -> Split:
    """The reply's content and calls by ``--tool-call-parser`` ``parser``."""
    if parser == "hermes":
        return split(text, final, max_calls)
    out = {"llama3_json": split_json_calls, "pythonic": split_python_calls,
           "mistral": split_mistral_calls}[parser](text, final)
    if max_calls is not None:
        del out.calls[max_calls:]
    return out


def forced(text: str, final: bool, name: str | None) -> Split:
    """A reply written under ``tool_choice`` ``required`` (``name`` None: a JSON list of
    ``{"name", "parameters"}``, ``tool_grammar``) or naming function ``name`` (the reply is its
    arguments), as content and calls.  The calls are decided at the end (nothing before:
    monotone); a reply that is not what the grammar wrote (cut by ``max_tokens``) is content."""
    if not final:
        return Split()
    if name is not None:
        try:
            json.loads(text)
        except ValueError:
            return Split(content=text)
        return Split(calls=[(name, text.strip())])
    try:
        items = json.loads(text)
        calls = [(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in items]
    except (ValueError, TypeError, KeyError):
        return Split(content=text)
    return Split(calls=calls)


def tool_grammar_schema(tools: list[dict], name: str | None, parallel: bool = True) -> dict:
    """The JSON schema a reply under a forced ``tool_choice`` is constrained to (as vLLM's):
    the named function's parameters, or for ``required`` a list of one call or more (at most one
    without ``parallel``), each ``{"name": <a tool's>, "parameters": <its parameters>}``."""
    def params(t):
        return t["function"].get("parameters") or {"type": "object", "properties": {}}
    if name is not None:
        return params(next(t for t in tools if t["function"]["name"] == name))
    one = [{"properties": {"name": {"type": "string", "enum": [t["function"]["name"]]}, "parameters": params(t)},
            "required": ["name", "parameters"]} for t in tools]
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": one}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def call_objects(calls: list[tuple[str, str]], rid: str, start: int = 0, streamed: bool = False) -> list[dict]:
    """The API's ``tool_calls`` entries for ``calls`` (numbered from ``start``): ids derived from
    the request's, so that a stream replayed after a crash sends the same ones."""
    out = []
    for k, (name, args) in enumerate(calls, start):
        entry = {"id": f"chatcmpl-tool-{rid}-{k}", "type": "function", "function": {"name": name, "arguments": args}}
        out.append(dict(entry, index=k) if streamed else entry)
    return out
