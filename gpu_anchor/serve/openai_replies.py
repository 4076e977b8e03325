"""The OpenAI / vLLM replies: JSON bodies (``reply``) and server-sent events (``stream``), torch-free.

They are built from the frontend's request records ``r``, one per choice: its checked request
``r.q`` (``openai_api``), the prompt ids ``r.prompt`` (and its text ``r.prompt_text``, if given
as text), the tokens ``r.out`` (with ``r.lps``, their log-probabilities, when asked, and
``r.plps``, the prompt's, with ``echo`` or ``prompt_logprobs``), ``r.finish`` / ``r.error`` /
``r.text`` (the text cut at a stop string), ``r.detok`` (the text of ``r.out`` as it grows) and
``r.changed`` (set when any of them changed).
"""
from __future__ import annotations

import json
import time

from . import reasoning, tool_calls
from .openai_checks import ApiError


def usage(prompt: int, completion: int, cached: int = 0) -> dict:
    """OpenAI's usage object; ``cached``: prompt tokens the engine found computed (prefix caching)."""
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def token_text(codec, tid: int, as_ids: bool) -> str:
    return f"token_id:{tid}" if as_ids else codec.token_text(tid)


def completion_logprobs(codec, ids: list[int], lps: list, as_ids: bool, offset: int) -> dict:
    """The completions API's ``logprobs`` object for ``ids`` (``lps[k] = (logprob, [[id, lp], ...])``,
    a prompt's with the rank after them); ``offset``: the text offset of the first token."""
    tokens = [token_text(codec, t, as_ids) for t in ids]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": [e[0] for e in lps],
            "top_logprobs": [{token_text(codec, i, as_ids): v for i, v in e[1]} for e in lps],
            "text_offset": offsets}


def chat_logprobs(codec, ids: list[int], lps: list, as_ids: bool) -> dict:
    """The chat API's ``logprobs`` object (``{"content": [...]}``) for ``ids``."""
    def entry(tid, lp):
        s = token_text(codec, tid, as_ids)
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}
    return {"content": [dict(entry(t, lp), top_logprobs=[entry(i, v) for i, v in top])
                        for t, (lp, top) in zip(ids, lps)]}


def _text(codec, r) -> str:
    return r.text if r.text is not None else codec.decode(r.out, r.q.skip_special_tokens)


def _echo(codec, r) -> str:
    return r.prompt_text if r.prompt_text is not None else codec.decode(r.prompt, r.q.skip_special_tokens)


def _logprobs(codec, r, a: int, b: int, offset: int) -> dict | None:
    """The ``logprobs`` object of output tokens ``a..b-1`` (None if the request did not ask)."""
    if r.q.logprobs is None:
        return None
    if r.q.chat:
        return chat_logprobs(codec, r.out[a:b], r.lps[a:b], r.q.tokens_as_ids)
    return completion_logprobs(codec, r.out[a:b], r.lps[a:b], r.q.tokens_as_ids, offset)


def _prompt_logprobs(codec, r) -> dict:
    """With ``echo``, the completions ``logprobs`` object of the prompt, as vLLM gives it: its
    first token has none (``None``), each other token its log-probability and top ones (as
    many as ``logprobs`` asks: the engine computed ``max(logprobs, prompt_logprobs)``)."""
    plps = [(lp, top[:r.q.logprobs]) for lp, top, _ in r.plps or ()]
    out = completion_logprobs(codec, r.prompt[1:], plps, r.q.tokens_as_ids,
                              len(token_text(codec, r.prompt[0], r.q.tokens_as_ids)))
    first = token_text(codec, r.prompt[0], r.q.tokens_as_ids)
    return {"tokens": [first] + out["tokens"], "token_logprobs": [None] + out["token_logprobs"],
            "top_logprobs": [None] + out["top_logprobs"], "text_offset": [0] + out["text_offset"]}


def vllm_prompt_logprobs(codec, r) -> list:
    """vLLM's ``prompt_logprobs`` of a choice: ``None`` for the first prompt token, then per token
    ``{"id": {"logprob", "rank", "decoded_token"}}``, the prompt's token first and then the
    ``prompt_logprobs`` most likely ones (ranked 1, 2, ...; the prompt's token once)."""
    out: list = [None]
    k = r.q.prompt_logprobs
    for tid, (lp, top, rank) in zip(r.prompt[1:], r.plps or ()):
        d = {str(tid): {"logprob": lp, "rank": rank, "decoded_token": token_text(codec, tid, r.q.tokens_as_ids)}}
        for j, (i, v) in enumerate(top[:k]):
            d.setdefault(str(i), {"logprob": v, "rank": j + 1, "decoded_token": token_text(codec, i, r.q.tokens_as_ids)})
        out.append(d)
    return out


def _joined(a: dict, b: dict) -> dict:
    return {k: a[k] + b[k] for k in a}


def _prompt_text_len(lp: dict) -> int:
    return lp["text_offset"][-1] + len(lp["tokens"][-1])


def _usage(rs: list, n: int) -> dict:
    """Every prompt once (``rs`` holds ``n`` choices per prompt), every choice's tokens."""
    return usage(sum(len(r.prompt) for r in rs[::n]), sum(len(r.out) for r in rs),
                 sum(r.cached_tokens for r in rs[::n]))


def _calls(q, text: str, final: bool):
    """The reply's content and tool calls: parsed (``tool_choice`` auto) or, under a forced tool
    choice, what the grammar made the model write (``tool_calls.forced``)."""
    if q.forced_tool:
        return tool_calls.forced(text, final, q.forced_tool[0])
    return tool_calls.parse(text, final, q.parse_tools, q.max_tool_calls)


def _calls_finish(q, finish: str) -> str:
    """A reply that made calls ends in ``tool_calls``; under a named tool choice in its own
    reason (``stop``), as OpenAI and vLLM answer it."""
    return finish if q.forced_tool and q.forced_tool[0] is not None else "tool_calls"


def reply(codec, rs: list, n: int = 1) -> dict:
    """The JSON body of a finished, non-streamed request: choice ``i`` from ``rs[i]`` (prompt
    ``i // n``'s choice ``i % n``, as vLLM numbers them)."""
    q, choices = rs[0].q, []
    for i, r in enumerate(rs):
        lp = _logprobs(codec, r, 0, len(r.out), 0)
        if lp is not None and q.echo:
            head = _prompt_logprobs(codec, r)
            lp = _joined(head, _logprobs(codec, r, 0, len(r.out), _prompt_text_len(head)))
        if q.chat:
            message, finish = {"role": "assistant", "content": _text(codec, r)}, r.finish
            if q.reasoning:
                thought, message["content"] = reasoning.split(message["content"], True, q.thinking_opened)
            if q.parse_tools or q.forced_tool:
                found = _calls(q, message["content"], True)
                message["content"] = found.content
                if found.calls:         # as vLLM: no content is null, and the reply ends in its calls
                    message = {"role": "assistant", "content": found.content or None,
                               "tool_calls": tool_calls.call_objects(found.calls, r.rid)}
                    finish = _calls_finish(q, finish)
            if q.reasoning and q.include_reasoning:     # vLLM's name and its older one
                message["reasoning"] = message["reasoning_content"] = thought or None
            choices.append({"index": i, "message": message, "logprobs": lp, "finish_reason": finish})
        else:
            choices.append({"index": i, "text": (_echo(codec, r) if q.echo else "") + _text(codec, r),
                            "logprobs": lp, "finish_reason": r.finish})
            if q.prompt_logprobs is not None:
                choices[-1]["prompt_logprobs"] = vllm_prompt_logprobs(codec, r)
    body = {"id": rs[0].rid, "object": "chat.completion" if q.chat else "text_completion",
            "created": int(time.time()), "model": q.model, "choices": choices,
            "usage": _usage(rs, n)}
    if q.chat and q.prompt_logprobs is not None:    # vLLM: one list for the request's one prompt
        body["prompt_logprobs"] = vllm_prompt_logprobs(codec, rs[0])
    return body


async def stream(request, codec, rs: list, n: int = 1, events=None):
    """Serve ``rs`` (the request's choices) as server-sent events: per choice, one chunk per
    batch of its tokens from the engine (text held back while a stop string or a UTF-8
    character may still be forming), the choices' chunks interleaved as they come; then the
    usage chunk if asked, then ``[DONE]``.  ``events``: an ``openai_responses.Events`` that turns
    the chunks into the Responses API's events (written with their ``event:`` names, no ``[DONE]``)."""
    import asyncio

    from aiohttp import web
    q = rs[0].q
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    head = {"id": rs[0].rid, "object": "chat.completion.chunk" if q.chat else "text_completion",
            "created": int(time.time()), "model": q.model}

    one_at_a_time = asyncio.Lock()         # the choices' writers take turns: whole events

    async def send(obj: dict, name: str | None = None) -> None:
        await resp.write((f"event: {name}\n" if name else "").encode() + b"data: " + json.dumps(obj).encode() + b"\n\n")

    async def write(obj: dict) -> None:
        async with one_at_a_time:
            if events is None:
                await send(obj)
            else:
                for ev in events.convert(obj):
                    await send(ev, ev["type"])

    try:
        for ev in events.start() if events is not None else ():
            await send(ev, ev["type"])
        await asyncio.gather(*(_events(codec, r, head, write, i) for i, r in enumerate(rs)))
        if q.include_usage and not any(r.error for r in rs):
            await write(dict(head, choices=[], usage=_usage(rs, n)))
        if events is None:
            await resp.write(b"data: [DONE]\n\n")
    except ConnectionResetError:      # the client went away; the caller aborts the request
        pass
    return resp


async def _events(codec, r, head: dict, write, index: int = 0) -> None:
    """The chunks of ``stream`` for choice ``index`` (``r``), written as it progresses."""
    q = r.q
    sent = ""                     # text sent so far
    n_sent = 0                    # tokens covered by the chunks sent so far
    offset = 0                    # text offset of the next token (completions' logprobs)
    hold = max((len(x) for x in r.stop), default=1) - 1   # a stop string may still be forming
    calls_sent = 0                # tool calls sent (chat with tool_choice "auto")
    thought_sent = ""             # reasoning sent (chat with --reasoning-parser)

    if q.echo:                    # the prompt first, as vLLM streams it
        lp = None
        if q.logprobs is not None:    # its log-probabilities come with the first token
            while r.plps is None and r.finish is None:
                r.changed.clear()
                await r.changed.wait()
            if not r.error:
                lp = _prompt_logprobs(codec, r)
                offset = _prompt_text_len(lp)
        await write(dict(head, choices=[{"index": index, "text": _echo(codec, r), "logprobs": lp,
                                         "finish_reason": None}]))
    while True:
        r.changed.clear()
        done = r.finish is not None
        if r.error:
            await write(ApiError(r.error_status, r.error).body())
            break
        if len(r.out) > n_sent or done:
            n = len(r.out)
            # while it runs, the text grown a window at a time; at the end, the reply's own text
            target = _text(codec, r) if done or r.text is not None else r.detok.update(r.out)
            if not done:
                target = target[:len(target) - hold] if hold else target
                target = target.rstrip("\ufffd")   # incomplete UTF-8: wait for the next token
            calls, thought = [], ""
            if q.reasoning:           # the reasoning and the rest, as each is decided (reasoning.split)
                whole, target = reasoning.split(target, done, q.thinking_opened)
                thought, thought_sent = whole[len(thought_sent):], whole
            if q.parse_tools or q.forced_tool:      # content and whole tool calls, as each is decided
                found = _calls(q, target, done)
                target, calls = found.content, found.calls[calls_sent:]
            delta = target[len(sent):] if target.startswith(sent) else ""
            # one chunk per token batch even when its text is held back or empty
            # (special tokens, partial UTF-8): clients see progress token by token
            sent += delta
            lp = _logprobs(codec, r, n_sent, n, offset) if n > n_sent else None
            if lp is not None and not q.chat:
                offset += sum(len(t) for t in lp["tokens"])
            if calls:
                calls = tool_calls.call_objects(calls, r.rid, calls_sent, streamed=True)
                calls_sent += len(calls)
            fin = (_calls_finish(q, r.finish) if calls_sent else r.finish) if done else None
            if q.chat:
                d = {"content": delta} if delta else {}
                if n_sent == 0:
                    d = {"role": "assistant", **d}
                if thought and q.include_reasoning:
                    d["reasoning"] = d["reasoning_content"] = thought
                if calls:
                    d["tool_calls"] = calls
                choice = {"index": index, "delta": d, "logprobs": lp, "finish_reason": fin}
            else:
                choice = {"index": index, "text": delta, "logprobs": lp, "finish_reason": fin}
            chunk = dict(head, choices=[choice])
            if q.continuous_usage:
                chunk["usage"] = usage(len(r.prompt), n, r.cached_tokens)
            n_sent = n
            await write(chunk)
        if done:
            break
        await r.changed.wait()
