"""Structured output, the request's side (torch-free): the fields that constrain a reply, as one grammar.

The fields, as vLLM takes them (chat and completions alike):

- ``response_format`` (OpenAI's): ``{"type": "text"}`` (nothing), ``{"type": "json_object"}`` (a
  JSON object), ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}`` (JSON
  valid under the schema; what the ``openai`` SDK's ``chat.completions.parse`` sends for a
  pydantic model);
- ``structured_outputs`` (vLLM's): one of ``{"json": schema}``, ``{"regex": ...}``,
  ``{"choice": [...]}``, ``{"grammar": ...}`` (Lark, or llama.cpp's GBNF) or
  ``{"json_object": true}``;
- ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``: vLLM's older names of
  the same, still sent by much client code.

At most one constraint per request.  ``grammar(body)`` is llguidance's grammar text for it (the
engine compiles it: ``grammar_matchers``), checked here: a schema, regular expression or grammar
llguidance cannot compile is an HTTP 400 naming the field and llguidance's message, before
anything reaches the engine.  JSON may hold whitespace between its tokens (vLLM's default)
unless ``structured_outputs.disable_any_whitespace`` is true; an object's properties come in the
schema's order (as OpenAI's structured outputs write them).
"""
from __future__ import annotations

import json

from .grammar_matchers import llguidance_problem
from .openai_checks import ApiError, bad

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
# vLLM's older per-request backend choice: the reply keeps to the same constraint whichever engine
# enforces it, so a named backend is accepted and llguidance enforces it
BACKENDS = ("auto", "xgrammar", "guidance", "outlines", "lm-format-enforcer")
FIELDS = ("response_format", "structured_outputs", "guided_decoding_backend", *GUIDED)
KINDS = ("json", "regex", "choice", "grammar", "json_object")


def _llguidance():
    why = llguidance_problem()
    if why:
        raise ApiError(400, why)
    try:
        import llguidance
    except ImportError:
        raise ApiError(400, "structured output needs llguidance on the server: pip install llguidance "
                            "(in gpu-anchor[serve])") from None
    return llguidance


def _compile(kind: str, value, where: str, compact: bool) -> str:
    """llguidance's grammar text for one constraint (``compact``: JSON without optional whitespace)."""
    L = _llguidance()
    options = {"whitespace_flexible": False} if compact else None
    if kind == "json_object":
        return L.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=options)
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise bad(where, f"is not valid JSON: {e}") from None
        if not isinstance(value, dict) and not isinstance(value, bool):
            raise bad(where, "must be a JSON schema (an object)")
        return L.LLMatcher.grammar_from_json_schema(value, defaults=options)
    if kind == "regex":
        if not isinstance(value, str) or not value:
            raise bad(where, "must be a non-empty regular expression")
        return L.LLMatcher.grammar_from_regex(value)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise bad(where, "must be a non-empty list of non-empty strings")
        return L.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value))
    if not isinstance(value, str) or not value.strip():
        raise bad(where, "must be a grammar (Lark, or GBNF)")
    from llguidance.gbnf_to_lark import any_to_lark
    try:
        lark = any_to_lark(value)
    except Exception as e:       # the GBNF converter's own error names the rule
        raise bad(where, f"does not parse as GBNF: {e}") from None
    return L.LLMatcher.grammar_from_lark(lark)


def _asked(body: dict) -> list[tuple[str, str, object]]:
    """Each constraint the body asks for: (kind, the field's name, value)."""
    out = []
    rf = body.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
            raise bad("response_format", 'must be {"type": "text"}, {"type": "json_object"} or '
                                         '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}')
        if rf["type"] == "json_object":
            out.append(("json_object", "response_format", True))
        elif rf["type"] == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict) or not isinstance(js.get("name", ""), str):
                raise bad("response_format.json_schema", 'must be {"name": ..., "schema": {...}}')
            # OpenAI's schema is optional ("any JSON object" without one); vLLM's older clients send "json_schema"
            schema = js.get("schema", js.get("json_schema", {"type": "object"}))
            out.append(("json", "response_format.json_schema.schema", schema))
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise bad("structured_outputs", "must be an object")
        for k, v in so.items():
            if k in KINDS:
                if v is not None and v is not False:
                    out.append((k, f"structured_outputs.{k}", v))
            elif k == "disable_any_whitespace":
                if not isinstance(v, bool) and v is not None:
                    raise bad("structured_outputs.disable_any_whitespace", "must be true or false")
            elif k not in ("disable_fallback", "disable_additional_properties") or v not in (None, False):
                raise bad(f"structured_outputs.{k}", "is not supported by this server (give one of "
                                                     f"{', '.join(KINDS)})")
    for name, kind in GUIDED.items():
        if body.get(name) is not None:
            out.append((kind, name, body[name]))
    return out


def compact(body: dict, default: bool = False) -> bool:
    """``structured_outputs.disable_any_whitespace`` (else the server's ``default``): JSON without
    optional whitespace."""
    so = body.get("structured_outputs")
    if isinstance(so, dict) and isinstance(so.get("disable_any_whitespace"), bool):
        return so["disable_any_whitespace"]
    return default


def tool_grammar(tools: list[dict], name: str | None, parallel: bool, compact: bool = False) -> str:
    """The grammar of a reply under ``tool_choice`` ``required`` (``name`` None) or naming a
    function (``tool_calls.tool_grammar_schema``); a tool's bad ``parameters`` schema is a 400."""
    from .tool_calls import tool_grammar_schema
    return _checked(_compile("json", tool_grammar_schema(tools, name, parallel), "tools", compact), "tools")


def _checked(text: str, where: str) -> str:
    why = _llguidance().LLMatcher.validate_grammar(text)
    if why:
        raise bad(where, f"llguidance cannot compile it: {why.strip()}")
    return text


def grammar(body: dict, compact_default: bool = False) -> str | None:
    """The request's constraint as llguidance grammar text, checked; None if it asks for none.
    ``compact_default``: the server's ``disable_any_whitespace``."""
    backend = body.get("guided_decoding_backend")
    if backend is not None and backend not in BACKENDS:
        raise bad("guided_decoding_backend", f"must be one of {', '.join(BACKENDS)} (llguidance enforces each)")
    asked = _asked(body)
    if not asked:
        return None
    if len(asked) > 1:
        raise bad(asked[1][1], f"one constraint per request: {asked[0][1]} and {asked[1][1]} were both given")
    kind, where, value = asked[0]
    return _checked(_compile(kind, value, where, compact(body, compact_default)), where)
