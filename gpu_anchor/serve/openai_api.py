"""The OpenAI / vLLM request surface: checking request bodies (torch-free; replies: ``openai_replies``).

Every field a request may carry is listed here with its check.  A field this server does not
know, a value of the wrong type or out of range, or a feature that vLLM has and this server
does not (beam search, ...) is an
``ApiError`` — HTTP 400 whose JSON names the field (``error.param``) — never a silent
default and never a 500.  The error and the value checks: ``openai_checks``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from . import structured_output
from .openai_checks import (ApiError, bad, bool_field, ids_field, int_field, is_int, logit_bias_field, number_field,
                            object_field)
from .sequence import MAX_LOGPROBS

MAX_N = 128      # choices per request (each is a sequence of its own in the engine)
MAX_BATCH = 256  # prompts per completions request
MAX_CHOICES = 1024   # prompts x n: the sequences one request may start
@dataclass
class Surface:
    """What the server offers every request, set at its start: the model names it answers to,
    the vocabulary, the reply parsers its options turned on, and the sampling defaults (the
    model's ``generation_config.json``, as vLLM's ``--generation-config auto``)."""
    served: list[str]
    vocab_size: int
    tool_parser: str | None = None                 # --tool-call-parser, with --enable-auto-tool-choice
    reasoning_parser: str | None = None            # --reasoning-parser
    defaults: dict = field(default_factory=dict)   # temperature, top_p, top_k, min_p, repetition_penalty, max_tokens
    structured: dict = field(default_factory=dict)  # --structured-outputs-config: disable_any_whitespace, enable_in_reasoning
    adapters: dict = field(default_factory=dict)    # --lora-modules: {name: directory}, each a model name too


@dataclass
class Request:
    """A checked completion or chat request."""
    chat: bool
    model: str
    prompts: list | None = None                    # completions: each text or token ids (a batch: several)
    messages: list[dict] | None = None             # chat
    max_tokens: int | None = None                  # None: up to the context length (or default_max_tokens)
    default_max_tokens: int | None = None          # chat: generation_config's max_new_tokens, when not given
    n: int = 1                                     # choices: one engine request each
    sampling: dict = field(default_factory=dict)   # SamplingParams fields but max_tokens and seed's default
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False                    # stream_options.include_usage: a last chunk with usage
    continuous_usage: bool = False                 # stream_options.continuous_usage_stats (vLLM): usage each chunk
    logprobs: int | None = None                    # None, or how many top log-probabilities per token
    prompt_logprobs: int | None = None             # vLLM's: the prompt's log-probabilities, k top ones each
    echo: bool = False
    include_stop_str: bool = False
    skip_special_tokens: bool = True
    tokens_as_ids: bool = False                    # return_tokens_as_token_ids (vLLM): "token_id:123"
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final: bool = False                   # continue_final_message (vLLM): continue the last message
    truncate: int | None = None                    # truncate_prompt_tokens (vLLM): keep the prompt's last k
    template_kwargs: dict = field(default_factory=dict)
    tools: list | None = None                      # chat: the tools, as the template gets them
    parse_tools: str | None = None                 # tool_choice "auto": the parser of the reply's tool calls
    max_tool_calls: int | None = None              # parallel_tool_calls false: 1 (as vLLM: the first)
    forced_tool: tuple | None = None               # tool_choice "required": (None,); a named function: (name,)
    reasoning: bool = False                        # chat, --reasoning-parser: <think> ... </think> apart
    include_reasoning: bool = True                 # vLLM's include_reasoning: false drops it
    thinking_opened: bool = False                  # the rendered prompt ends inside <think> (set when encoded)
    grammar_in_reasoning: bool = False             # the grammar constrains the reasoning too (enable_in_reasoning)


# Fields vLLM has that this server accepts only at their neutral value (None always passes).
_NEUTRAL = {
    "best_of": ((1,), "best_of > 1 is not supported"),
    "use_beam_search": ((False,), "beam search is not supported"),
    "length_penalty": ((1, 1.0), "length_penalty is not supported (beam search only)"),
    "suffix": (("",), "suffix is not supported"),
    "functions": (([],), "the legacy functions field is not supported: send tools"),
    "function_call": (("none",), "the legacy function_call field is not supported: send tools and tool_choice"),
    "spaces_between_special_tokens": ((True,), "only spaces_between_special_tokens=true is supported"),
    "store": ((False,), "this server does not store completions"),
}
# Fields that change nothing in the output (metadata): accepted after a type check.
_METADATA = {"user": str, "metadata": dict}
# true/false fields -> Request attribute
_FLAGS = {"stream": "stream", "echo": "echo", "add_generation_prompt": "add_generation_prompt",
          "continue_final_message": "continue_final",
          "skip_special_tokens": "skip_special_tokens", "include_stop_str_in_output": "include_stop_str",
          "return_tokens_as_token_ids": "tokens_as_ids", "add_special_tokens": "add_special_tokens"}


def _neutral(name: str, v) -> None:
    allowed, why = _NEUTRAL[name]
    if v is not None and not any(type(v) is type(a) and v == a or is_int(v) and is_int(a) and v == a
                                 for a in allowed):
        raise bad(name, why)


# ------------------------------------------------------------------ requests
_COMMON = {"model", "stream", "stream_options", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids",
           "ignore_eos", "max_tokens", "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty",
           "min_p", "min_tokens", "logit_bias", "n", "skip_special_tokens", "include_stop_str_in_output",
           "return_tokens_as_token_ids", "add_special_tokens", "truncate_prompt_tokens", "prompt_logprobs"} \
    | set(_NEUTRAL) | set(_METADATA) | set(structured_output.FIELDS)
_COMPLETION = _COMMON | {"prompt", "echo"}
_CHAT = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "add_generation_prompt",
                   "continue_final_message", "tools", "tool_choice", "parallel_tool_calls", "include_reasoning",
                   "chat_template_kwargs"}


def _model(body: dict, served: list[str]) -> str:
    model = body.get("model")
    if model is None:
        return served[0]
    if not isinstance(model, str):
        raise bad("model", f"must be a string, got {model!r}")
    if model not in served:
        raise ApiError(404, f"The model `{model}` does not exist.", "model")
    return model


def _known(body, fields) -> dict:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for k in body:
        if k not in fields:
            raise bad(k, "unknown field (this server refuses fields it would otherwise ignore)")
    return body


def parse_tokenize(body, served: list[str]) -> tuple[Request, bool]:
    """vLLM's ``/tokenize`` body: a ``prompt`` (text) or chat ``messages``; and whether it asks
    for ``token_strs``."""
    g = _known(body, {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                      "continue_final_message", "chat_template_kwargs", "return_token_strs", "tools"}).get
    chat = g("messages") is not None
    if chat == (g("prompt") is not None):
        raise bad("prompt", "give a prompt (text) or messages, one of them")
    r = Request(chat=chat, model=_model(body, served), add_special_tokens=not chat)
    if chat:
        r.messages = _messages(g("messages"))
        if g("add_generation_prompt") is not None:
            r.add_generation_prompt = bool_field("add_generation_prompt", g("add_generation_prompt"))
        if g("continue_final_message") is not None:
            r.continue_final = bool_field("continue_final_message", g("continue_final_message"))
        _continuing(r)
        _tools(r, g("tools"), "none", None)
        if g("chat_template_kwargs") is not None:
            r.template_kwargs = object_field("chat_template_kwargs", g("chat_template_kwargs"))
    elif isinstance(g("prompt"), str):
        r.prompts = [g("prompt")]
    else:
        raise bad("prompt", "must be a string")
    if g("add_special_tokens") is not None:
        r.add_special_tokens = bool_field("add_special_tokens", g("add_special_tokens"))
    return r, g("return_token_strs") is not None and bool_field("return_token_strs", g("return_token_strs"))


def _continuing(r: Request) -> None:
    if r.continue_final and r.add_generation_prompt:
        raise bad("continue_final_message", "needs add_generation_prompt=false (the reply continues the last "
                                            "message instead of starting a new one)")


def parse_detokenize(body, served: list[str], vocab_size: int) -> list[int]:
    """vLLM's ``/detokenize`` body: the ``tokens`` to turn into text."""
    _model(_known(body, {"model", "tokens"}), served)
    return ids_field("tokens", body.get("tokens"), vocab_size)


def parse(body, chat: bool, surface: Surface) -> Request:
    """Check a request body of ``/v1/chat/completions`` (``chat``) or ``/v1/completions``; a
    sampling field it leaves out takes ``surface.defaults``' value, else vLLM's default."""
    served, vocab_size, d = surface.served, surface.vocab_size, surface.defaults
    _known(body, _CHAT if chat else _COMPLETION)
    for k in _NEUTRAL:
        if k in body:
            _neutral(k, body[k])
    for k, t in _METADATA.items():
        if body.get(k) is not None and not isinstance(body[k], t):
            raise bad(k, f"must be a {t.__name__}")
    # chat: the template writes the special tokens (vLLM's defaults)
    r = Request(chat=chat, model=_model(body, served), add_special_tokens=not chat)
    g = body.get
    for name, attr in _FLAGS.items():
        if g(name) is not None:                     # unknown to this endpoint: refused above
            setattr(r, attr, bool_field(name, g(name)))
    if chat:
        r.messages = _messages(g("messages"))
        _continuing(r)
        _tools(r, g("tools"), g("tool_choice"), surface.tool_parser)
        if g("parallel_tool_calls") is not None and not bool_field("parallel_tool_calls", g("parallel_tool_calls")):
            r.max_tool_calls = 1
        r.reasoning = surface.reasoning_parser is not None
        if g("include_reasoning") is not None:
            r.include_reasoning = bool_field("include_reasoning", g("include_reasoning"))
    else:
        r.prompts = _prompts(g("prompt"), vocab_size)
    # sampling
    s = r.sampling
    if r.model in surface.adapters:                 # a LoRA adapter's name: its tokens go through it
        s["lora"] = r.model
    s["temperature"] = d.get("temperature", 1.0) if g("temperature") is None else \
        number_field("temperature", g("temperature"), 0.0, 100.0)
    s["top_p"] = d.get("top_p", 1.0) if g("top_p") is None else number_field("top_p", g("top_p"), 0.0, 1.0, lo_open=True)
    top_k = d.get("top_k", 0) if g("top_k") is None else int_field("top_k", g("top_k"), -1)
    s["top_k"] = max(0, top_k)                      # -1 and 0 both mean "no top-k", as in vLLM
    s["seed"] = None if g("seed") is None else int_field("seed", g("seed"), -(1 << 63), (1 << 63) - 1)
    s["stop_token_ids"] = [] if g("stop_token_ids") is None else ids_field("stop_token_ids", g("stop_token_ids"),
                                                                        1 << 62)
    s["ignore_eos"] = False if g("ignore_eos") is None else bool_field("ignore_eos", g("ignore_eos"))
    for name in ("presence_penalty", "frequency_penalty"):
        if g(name) is not None:
            s[name] = number_field(name, g(name), -2.0, 2.0)
    if g("repetition_penalty") is not None:
        s["repetition_penalty"] = number_field("repetition_penalty", g("repetition_penalty"), 0.0, 100.0, lo_open=True)
    elif "repetition_penalty" in d:
        s["repetition_penalty"] = d["repetition_penalty"]
    if g("min_p") is not None:
        s["min_p"] = number_field("min_p", g("min_p"), 0.0, 1.0)
    elif "min_p" in d:
        s["min_p"] = d["min_p"]
    if g("min_tokens") is not None:
        s["min_tokens"] = int_field("min_tokens", g("min_tokens"), 0)
    if g("logit_bias") is not None:
        s["logit_bias"] = logit_bias_field(g("logit_bias"), vocab_size)
    compact = surface.structured.get("disable_any_whitespace", False)
    grammar = structured_output.grammar(body, compact)
    if r.forced_tool is not None:
        if grammar is not None:
            raise bad("tool_choice", "a forced tool choice constrains the reply to its calls: not with "
                                     "response_format / structured_outputs")
        grammar = structured_output.tool_grammar(r.tools, r.forced_tool[0], r.max_tool_calls != 1,
                                                 structured_output.compact(body, compact))
    if grammar is not None:
        if s.get("min_tokens"):
            raise bad("min_tokens", "not with structured output: the grammar decides where the reply may end")
        s["grammar"] = grammar
        r.grammar_in_reasoning = surface.structured.get("enable_in_reasoning", False)
    if g("n") is not None:
        r.n = int_field("n", g("n"), 1, MAX_N)
    if g("truncate_prompt_tokens") is not None:
        r.truncate = int_field("truncate_prompt_tokens", g("truncate_prompt_tokens"), 1)
    if not chat and len(r.prompts) * r.n > MAX_CHOICES:
        raise bad("n", f"{len(r.prompts)} prompt(s) x n={r.n} is more than {MAX_CHOICES} sequences in one request")
    for name in (("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)):
        if g(name) is not None:                     # max_completion_tokens wins (OpenAI's newer name)
            r.max_tokens = int_field(name, g(name), 1)
            break
    else:
        r.max_tokens = None if chat else 16         # vLLM's defaults: the context for chat, 16 for completions
        if chat:
            r.default_max_tokens = d.get("max_tokens")
    stop = g("stop")
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(x, str) and x for x in stop):
            raise bad("stop", "must be a non-empty string or a list of them")
        r.stop = stop
    so = g("stream_options")
    if so is not None:
        object_field("stream_options", so)
        if not r.stream:
            raise bad("stream_options", "only allowed with stream=true")
        for k, v in so.items():
            if k == "include_usage":
                r.include_usage = v is not None and bool_field("stream_options.include_usage", v)
            elif k == "continuous_usage_stats":
                r.continuous_usage = v is not None and bool_field("stream_options.continuous_usage_stats", v)
            else:
                raise bad(f"stream_options.{k}", "unknown field")
    # output shaping
    lp = g("logprobs")
    if chat:
        want = lp is not None and bool_field("logprobs", lp)
        top = g("top_logprobs")
        if top is not None:
            top = int_field("top_logprobs", top, 0, MAX_LOGPROBS)
            if not want:
                raise bad("top_logprobs", "needs logprobs=true")
        r.logprobs = (top or 0) if want else None
        if g("chat_template_kwargs") is not None:
            r.template_kwargs = object_field("chat_template_kwargs", g("chat_template_kwargs"))
    else:
        if lp is not None:
            if isinstance(lp, bool):
                raise bad("logprobs", "must be an integer (how many top log-probabilities per token) or null")
            r.logprobs = int_field("logprobs", lp, 0, MAX_LOGPROBS)
    if g("prompt_logprobs") is not None:
        v = g("prompt_logprobs")
        if is_int(v) and v == -1:
            raise bad("prompt_logprobs", f"-1 (every token of the vocabulary) is not supported: at most "
                                         f"{MAX_LOGPROBS} top log-probabilities per prompt token")
        r.prompt_logprobs = int_field("prompt_logprobs", v, 0, MAX_LOGPROBS)
        if r.stream:
            raise bad("prompt_logprobs", "not available with stream=true (as in vLLM); for completions, "
                                         "echo=true with logprobs streams the prompt's log-probabilities")
    # the engine computes the prompt's log-probabilities once, for the larger of the two asks
    asks = [k for k in (r.prompt_logprobs, r.logprobs if r.echo else None) if k is not None]
    if asks:
        s["prompt_logprobs"] = max(asks)
    return r


def _tools(r: Request, tools, choice, tool_parser: str | None) -> None:
    """``tools`` and ``tool_choice``: the tools go to the chat template; with ``auto`` (the
    default when tools are given) the reply's tool calls are parsed, which needs the server's
    ``--enable-auto-tool-choice`` (as in vLLM); ``required`` or a named function constrain the
    reply to calls (``structured_output.tool_grammar``)."""
    if tools is not None:
        if not isinstance(tools, list):
            raise bad("tools", "must be a list")
        for i, t in enumerate(tools):
            f = t.get("function") if isinstance(t, dict) else None
            if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(f, dict) \
                    or not isinstance(f.get("name"), str) or not f["name"]:
                raise bad(f"tools[{i}]", 'must be {"type": "function", "function": {"name": ..., ...}}')
            if f.get("parameters") is not None and not isinstance(f["parameters"], dict):
                raise bad(f"tools[{i}].function.parameters", "must be a JSON schema object")
        r.tools = tools or None
    if choice is None:
        choice = "auto" if r.tools else "none"
    if choice == "none":
        return
    if choice == "required" or isinstance(choice, dict):     # the reply constrained to calls (forced_tool)
        if not r.tools:
            raise bad("tool_choice", f"{json.dumps(choice)} needs tools")
        name = None
        if isinstance(choice, dict):
            f = choice.get("function") if choice.get("type") == "function" else None
            name = f.get("name") if isinstance(f, dict) else None
            if name not in {t["function"]["name"] for t in r.tools}:
                raise bad("tool_choice", 'must be "none", "auto", "required" or {"type": "function", "function": '
                                         '{"name": <one of the tools>}}')
        r.forced_tool = (name,)
        return
    if choice != "auto":
        raise bad("tool_choice", 'must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}')
    if not r.tools:
        raise bad("tool_choice", "\"auto\" needs tools")
    if tool_parser is None:
        raise bad("tool_choice", '"auto" tool choice requires the server to run with --enable-auto-tool-choice and '
                                 "--tool-call-parser (as in vLLM)")
    r.parse_tools = tool_parser


def _prompts(p, vocab_size: int) -> list:
    """A prompt (text, or token ids) or a batch of them (a list of texts or of token-id lists)."""
    if isinstance(p, str) or isinstance(p, list) and p and all(is_int(t) for t in p):
        p = [p]
    if not isinstance(p, list) or not p or len(p) > MAX_BATCH:
        raise bad("prompt", f"must be a string, a non-empty list of token ids, or a batch of 1 to {MAX_BATCH} of them")
    out = []
    for k, x in enumerate(p):
        where = "prompt" if len(p) == 1 else f"prompt[{k}]"
        if isinstance(x, str):
            out.append(x)
        elif isinstance(x, list) and x and all(is_int(t) for t in x):
            out.append(ids_field(where, x, vocab_size))
        else:
            raise bad("prompt", f"{where} must be a string or a non-empty list of token ids")
    return out


def _messages(msgs) -> list[dict]:
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "must be a non-empty list")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(where, "each message must be an object with a string role")
        c = m.get("content")
        if isinstance(c, list):
            parts = []
            for j, part in enumerate(c):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad(f"{where}.content[{j}]", "only text parts ({\"type\": \"text\", \"text\": ...}) are "
                                                       "supported")
                parts.append(part["text"])
            m = dict(m, content="".join(parts))
        elif c is not None and not isinstance(c, str):
            raise bad(f"{where}.content", "must be a string, a list of text parts or null")
        if m.get("tool_calls") is not None:
            m = dict(m, tool_calls=_message_tool_calls(where, m["tool_calls"]))
        out.append(m)
    return out


def _message_tool_calls(where: str, calls) -> list[dict]:
    """An assistant message's ``tool_calls``, their ``arguments`` (JSON text) read into objects:
    chat templates write them out themselves (as transformers and vLLM hand them over)."""
    if not isinstance(calls, list):
        raise bad(f"{where}.tool_calls", "must be a list")
    out = []
    for k, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise bad(f"{where}.tool_calls[{k}]", 'must be {"id": ..., "type": "function", "function": '
                                                  '{"name": ..., "arguments": "<JSON>"}}')
        args = f.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                raise bad(f"{where}.tool_calls[{k}].function.arguments", "is not valid JSON") from None
        out.append(dict(c, function=dict(f, arguments=args)))
    return out
