"""Tool calls in replies (``serve/tool_calls.py``, torch-free): the Hermes blocks Qwen2.5 /
Qwen3 write, read into content and calls; whatever is not a call kept as content; and the
contract a stream relies on: every prefix's split is a prefix of the whole reply's split, so
the deltas a stream sends add up to the reply that is not streamed, for every way the text
can arrive."""
from __future__ import annotations

import json

import pytest

from gpu_anchor.serve.tool_calls import call_objects, parse, split

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
TIME = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "Europe/Paris"}}\n</tool_call>'

CASES = [
    # (reply, content, [(name, arguments)])
    ("It is sunny.", "It is sunny.", []),
    (WEATHER, "", [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    ("\n\n" + WEATHER, "", [("get_weather", {"city": "Paris", "unit": "celsius"})]),     # blanks beside a call
    ("\n\n", "\n\n", []),
    ("Let me check.\n\n" + WEATHER, "Let me check.\n\n", [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    ("<think>\nThe user wants weather.\n</think>\n\n" + WEATHER + "\n" + TIME,
     "<think>\nThe user wants weather.\n</think>\n\n",
     [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"zone": "Europe/Paris"})]),
    # text after the calls that is not blank is kept, after the content before them
    (WEATHER + "\nDone.", "\nDone.", [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    # not calls: kept verbatim
    ('<tool_call>{"name": "f", "arguments": {"x": </tool_call>', '<tool_call>{"name": "f", "arguments": {"x": </tool_call>', []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', []),
    # no arguments; arguments as a JSON string; unicode kept
    ('<tool_call>{"name": "now"}</tool_call>', "", [("now", {})]),
    ('<tool_call>{"name": "f", "arguments": "{\\"q\\": \\"café\\"}"}</tool_call>', "", [("f", {"q": "café"})]),
    # an unclosed block at the end: a call if its JSON is whole (cut before the closing tag) ...
    ('<tool_call>\n{"name": "now", "arguments": {}}\n', "", [("now", {})]),
    # ... else the text, as written (e.g. max_tokens reached inside it)
    ('Sure. <tool_call>\n{"name": "now", "argu', 'Sure. <tool_call>\n{"name": "now", "argu', []),
    # a tag's start at the end that is not a tag
    ("a < b and <tool", "a < b and <tool", []),
]


LLAMA = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
LLAMA_CASES = [
    ("It is sunny.", "It is sunny.", []),
    (LLAMA, "", [("get_weather", {"city": "Paris"})]),
    ("<|python_tag|>" + LLAMA, "", [("get_weather", {"city": "Paris"})]),         # the tag kept in the text
    ("\n " + LLAMA + "; " + LLAMA.replace("Paris", "Rome"), "",
     [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]),
    ('{"name": "now", "arguments": {}}', "", [("now", {})]),
    # not calls: the whole reply is content, as written
    ('{"name": "f", "parameters": {"x": ', '{"name": "f", "parameters": {"x": ', []),     # cut by max_tokens
    ('{"city": "Paris"}', '{"city": "Paris"}', []),
    (LLAMA + " and more", LLAMA + " and more", []),
    ("Sure: " + LLAMA, "Sure: " + LLAMA, []),                                      # not at the start: content
    ("<|python", "<|python", []),
    ("  ", "  ", []),
]


PY_CASES = [
    ("It is sunny.", "It is sunny.", []),
    ('[get_weather(city="Paris")]', "", [("get_weather", {"city": "Paris"})]),
    (' [get_weather(city="Paris"), get_time(utc=True, n=[1, 2.5], o={"k": None})]', "",
     [("get_weather", {"city": "Paris"}), ("get_time", {"utc": True, "n": [1, 2.5], "o": {"k": None}})]),
    ('<|python_start|>[now()]<|python_end|>', "", [("now", {})]),
    # not calls: the whole reply is content
    ('[get_weather(city="Par', '[get_weather(city="Par', []),                  # cut by max_tokens
    ('[get_weather("Paris")]', '[get_weather("Paris")]', []),                  # positional
    ('[os.system(cmd="ls")]', '[os.system(cmd="ls")]', []),                    # not a plain name
    ('[f(x=open("a"))]', '[f(x=open("a"))]', []),                              # not a literal: never run
    ("[1, 2]", "[1, 2]", []),
    ("[]", "[]", []),
    ('Sure: [f(a=1)]', 'Sure: [f(a=1)]', []),
]


MISTRAL_CASES = [
    ("It is sunny.", "It is sunny.", []),
    ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]', "",
     [("get_weather", {"city": "Paris"})]),
    (' [{"name": "f", "arguments": {}}, {"name": "g", "arguments": {"x": 1}}]', "", [("f", {}), ("g", {"x": 1})]),
    ('[{"name": "f", "arguments": {"x": ', '[{"name": "f", "arguments": {"x": ', []),     # cut by max_tokens
    ('[{"city": "Paris"}]', '[{"city": "Paris"}]', []),
    ("[1, 2] are numbers", "[1, 2] are numbers", []),
    ("[", "[", []),
]


@pytest.mark.parametrize("parser,text,content,calls", [("llama3_json", *c) for c in LLAMA_CASES]
                         + [("pythonic", *c) for c in PY_CASES] + [("mistral", *c) for c in MISTRAL_CASES])
def test_llama3_json_and_pythonic(parser, text, content, calls):
    got = parse(text, True, parser)
    assert got.content == content and [(n, json.loads(a)) for n, a in got.calls] == calls
    whole, sent, n_calls = got, "", 0
    for k in range(len(text) + 1):             # every prefix, as a stream sees it (monotone)
        part = parse(text[:k], False, parser)
        assert part.content.startswith(sent) and whole.content.startswith(part.content), (k, part)
        assert whole.calls[:len(part.calls)] == part.calls and len(part.calls) >= n_calls
        sent, n_calls = part.content, len(part.calls)
    assert len(parse(text, True, parser, max_calls=1).calls) == min(1, len(calls))


@pytest.mark.parametrize("text,content,calls", CASES)
def test_split(text, content, calls):
    got = split(text, final=True)
    assert got.content == content
    assert [(n, json.loads(a)) for n, a in got.calls] == calls


@pytest.mark.parametrize("text,content,calls", CASES)
def test_every_prefix_is_a_prefix_of_the_reply(text, content, calls):
    """A stream: at each arrival, the content sent so far and the calls sent so far only grow,
    and at the end equal the reply's; a partly written tag or open block is never sent as text."""
    whole = split(text, final=True)
    sent, n_calls = "", 0
    for k in range(len(text) + 1):
        part = split(text[:k], final=False)
        assert part.content.startswith(sent) and whole.content.startswith(part.content), (k, part)
        assert len(part.calls) >= n_calls and whole.calls[:len(part.calls)] == part.calls
        sent, n_calls = part.content, len(part.calls)


def test_held_back_while_undecided():
    assert split("Hello <tool_", final=False).content == "Hello "
    assert split("Hello <tool_", final=True).content == "Hello <tool_"
    assert split(WEATHER[:-3], final=False).calls == []
    assert split("\n\n", final=False).content == ""                 # a call may follow
    assert split("\n\nHi", final=False).content == "\n\nHi"
    assert split(WEATHER + "\n", final=False).content == ""      # a separator, or text: decided later
    assert split(WEATHER + "\nok", final=False).content == ""
    assert split(WEATHER + "\nok", final=True).content == "\nok"


def test_parallel_tool_calls_false_keeps_the_first():
    assert [n for n, _ in split(WEATHER + TIME, final=True, max_calls=1).calls] == ["get_weather"]
    assert split(WEATHER + TIME, final=False, max_calls=1).calls == split(WEATHER, final=True).calls


def test_call_objects_are_stable_and_numbered():
    calls = split(WEATHER + TIME, final=True).calls
    whole = call_objects(calls, "chatcmpl-abc")
    assert [c["id"] for c in whole] == ["chatcmpl-tool-chatcmpl-abc-0", "chatcmpl-tool-chatcmpl-abc-1"]
    assert whole[0]["type"] == "function" and json.loads(whole[0]["function"]["arguments"])["city"] == "Paris"
    streamed = call_objects(calls[1:], "chatcmpl-abc", start=1, streamed=True)
    assert streamed == [dict(whole[1], index=1)]


# ------------------------------------------------------------------ through the server and the openai client
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather now",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
# A Hermes-style template of our own: the tools, then the turns; an assistant's calls as blocks.
TOOL_TEMPLATE = (
    "{% if tools %}[tools]{% for t in tools %} {{ t.function | tojson }}{% endfor %}\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and m.tool_calls %}[assistant] {% for c in m.tool_calls %}<tool_call>"
    "{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}</tool_call>"
    "{% endfor %}\n"
    "{% else %}[{{ m.role }}] {{ m.content }}\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}[assistant] {% if think %}<think>\n{% endif %}{% endif %}")
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
ASK_TWO = [{"role": "user", "content": "And in Paris and Rome?"}]
CALL_TWO = CALL + '\n<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
ASK_THINK = [{"role": "user", "content": "Think first: the weather in Paris?"}]
THOUGHT = "\nThe user wants the weather: a tool call.\n"
THINK_CALL = "<think>" + THOUGHT + "</think>\n\n" + CALL
OPENED_REPLY = "Paris, then.\n</think>\n\nLet me look."     # the template opened <think> (think=True)
RESULT = "18 C, sunny"
ANSWER = "It is 18 C and sunny in Paris."


def _second_turn(call_id: str, arguments) -> list[dict]:
    return ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": call_id, "content": RESULT}]


def _teach(model_dir: str, examples: list[tuple[list[int], list[int]]], eos: int = 2) -> None:
    """Fine-tune the tiny model until greedy decoding writes each example's reply (then EOS)
    after its prompt: a model that calls a tool and then answers from its result."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    opt = torch.optim.Adam(m.parameters(), lr=3e-3)
    seqs = [(p, r + [eos]) for p, r in examples]

    def greedy(p, n):
        ids = list(p)
        with torch.no_grad():
            for _ in range(n):
                ids.append(int(m(torch.tensor([ids])).logits[0, -1].argmax()))
        return ids[len(p):]
    for step in range(1, 1001):
        loss = sum(F.cross_entropy(m(torch.tensor([p + r])).logits[0, len(p) - 1:-1], torch.tensor(r)) for p, r in seqs)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0 and all(greedy(p, len(r)) == r for p, r in seqs):
            break
    else:
        raise AssertionError(f"the tiny model did not learn its replies (loss {loss.item():.3g})")
    m.save_pretrained(model_dir)


@pytest.fixture(scope="module")
def tool_srv(tmp_path_factory):
    """A server with --enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3
    over a tiny model taught to call get_weather for the question (with two calls for two
    cities, after its reasoning when asked to think), to answer from the tool's result, and to
    go on from a reasoning its prompt opened."""
    from gpu_anchor.serve.tokenizer import Codec
    from gpu_anchor.testing.tiny import make_tiny_model
    from test_serve_api import MODEL, start_server
    from test_serve_http import own_daemon, stop_server
    with own_daemon(tmp_path_factory, "tools") as (d, sock):
        model = make_tiny_model(str(d / MODEL), "qwen3", seed=5)
        codec = Codec(model, 384, chat_template=TOOL_TEMPLATE)
        first = codec.encode(codec.chat(ASK, tools=TOOLS))
        second = codec.encode(codec.chat(_second_turn("x", {"city": "Paris"}), tools=TOOLS))
        two = codec.encode(codec.chat(ASK_TWO, tools=TOOLS))
        think = codec.encode(codec.chat(ASK_THINK, tools=TOOLS))
        opened = codec.encode(codec.chat(ASK, think=True))
        _teach(model, [(first, codec.encode(CALL)), (second, codec.encode(ANSWER)), (two, codec.encode(CALL_TWO)),
                       (think, codec.encode(THINK_CALL)), (opened, codec.encode(OPENED_REPLY))])
        proc, base, log_path = start_server(str(d), model, "--socket", sock, "--chat-template", TOOL_TEMPLATE,
                                            "--max-model-len", "1024", "--enable-auto-tool-choice",
                                            "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3")
        try:
            yield {"base": base, "model": model, "log": log_path, "codec": codec}
        finally:
            stop_server(proc)


def _client(base):
    import openai
    return openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)


def _streamed(chunks) -> dict:
    """A streamed chat reply put together as a client does: content, tool calls by index (each
    delta's pieces appended), finish reason."""
    content, thought, calls, finish = "", "", {}, None
    for ch in chunks:
        for c in ch.choices:
            d = c.delta
            content += d.content or ""
            thought += getattr(d, "reasoning", None) or ""
            for tc in d.tool_calls or ():
                slot = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                slot["id"] += tc.id or ""
                slot["name"] += tc.function.name or ""
                slot["arguments"] += tc.function.arguments or ""
            finish = c.finish_reason or finish
    return {"content": content, "reasoning": thought, "calls": [calls[k] for k in sorted(calls)], "finish": finish}


def test_an_agent_loop_through_the_openai_client(tool_srv):
    """The model calls the tool (``tool_calls``, ``finish_reason: tool_calls``, no content), the
    client runs it and sends the result back in the conversation (the assistant's calls, their
    arguments JSON text, rendered as the template writes them), and the model answers; streamed,
    the deltas add up to the same calls; ``tool_choice: none`` leaves the block as text."""
    c = _client(tool_srv["base"])
    r = c.chat.completions.create(model="tiny-qwen3", messages=ASK, tools=TOOLS, temperature=0)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None, ch
    (call,) = ch.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("chatcmpl-tool-")
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    # streamed: the same call, whole in one delta, under the id the stream gave it
    s = _streamed(c.chat.completions.create(model="tiny-qwen3", messages=ASK, tools=TOOLS, temperature=0, stream=True))
    assert s["finish"] == "tool_calls" and s["content"] == ""
    assert [(x["name"], x["arguments"]) for x in s["calls"]] == [(call.function.name, call.function.arguments)]
    # the SDK's own stream helper puts the same message together
    with c.chat.completions.stream(model="tiny-qwen3", messages=ASK, tools=TOOLS, temperature=0) as st:
        final = st.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and not final.message.content
    assert [(x.function.name, x.function.arguments) for x in final.message.tool_calls] == \
        [(call.function.name, call.function.arguments)]
    # the tool's result back: the server renders the client's messages as the template expects
    msgs = ASK + [ch.message.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    import urllib.request
    req = urllib.request.Request(tool_srv["base"] + "/tokenize", data=json.dumps(
        {"messages": msgs, "tools": TOOLS}).encode(), headers={"Content-Type": "application/json"})
    codec = tool_srv["codec"]
    want = codec.encode(codec.chat(_second_turn(call.id, {"city": "Paris"}), tools=TOOLS))
    assert json.loads(urllib.request.urlopen(req, timeout=60).read())["tokens"] == want
    r2 = c.chat.completions.create(model="tiny-qwen3", messages=msgs, tools=TOOLS, temperature=0)
    assert r2.choices[0].message.content == ANSWER and r2.choices[0].finish_reason == "stop"
    assert not r2.choices[0].message.tool_calls
    # tool_choice none: the tools are shown to the model, its reply is left as text
    r3 = c.chat.completions.create(model="tiny-qwen3", messages=ASK, tools=TOOLS, tool_choice="none", temperature=0)
    assert r3.choices[0].message.content == CALL and r3.choices[0].finish_reason == "stop"
    assert not r3.choices[0].message.tool_calls


def test_parallel_tool_calls(tool_srv):
    """Two calls in one reply, streamed and not; ``parallel_tool_calls: false`` returns the first
    (as vLLM)."""
    c = _client(tool_srv["base"])
    kw = dict(model="tiny-qwen3", messages=ASK_TWO, tools=TOOLS, temperature=0)
    both = c.chat.completions.create(**kw).choices[0].message.tool_calls
    assert [json.loads(x.function.arguments)["city"] for x in both] == ["Paris", "Rome"]
    assert len({x.id for x in both}) == 2
    s = _streamed(c.chat.completions.create(stream=True, **kw))
    assert [(x["name"], x["arguments"]) for x in s["calls"]] == [(x.function.name, x.function.arguments) for x in both]
    one = c.chat.completions.create(parallel_tool_calls=False, **kw).choices[0]
    assert [x.function.arguments for x in one.message.tool_calls] == [both[0].function.arguments]
    assert one.finish_reason == "tool_calls" and one.message.content is None
    s = _streamed(c.chat.completions.create(stream=True, parallel_tool_calls=False, **kw))
    assert [x["arguments"] for x in s["calls"]] == [both[0].function.arguments]


def test_reasoning_apart_from_the_answer(tool_srv):
    """``--reasoning-parser qwen3``: the ``<think>`` block comes back as the message's
    ``reasoning`` (and ``reasoning_content``, its older name), the tool call after it parsed;
    streamed, the reasoning deltas add up to it; ``include_reasoning: false`` drops it; a
    reasoning the prompt opened (a template that ends in ``<think>``) is found too; a reply
    without one has none."""
    c = _client(tool_srv["base"])
    kw = dict(model="tiny-qwen3", messages=ASK_THINK, tools=TOOLS, temperature=0)
    m = c.chat.completions.create(**kw).choices[0]
    assert m.message.reasoning == m.message.reasoning_content == THOUGHT
    assert m.message.content is None and m.finish_reason == "tool_calls"
    assert [json.loads(x.function.arguments) for x in m.message.tool_calls] == [{"city": "Paris"}]
    s = _streamed(c.chat.completions.create(stream=True, **kw))
    assert s["reasoning"] == THOUGHT and s["content"] == "" and [x["name"] for x in s["calls"]] == ["get_weather"]
    quiet = c.chat.completions.create(extra_body={"include_reasoning": False}, **kw).choices[0]
    assert getattr(quiet.message, "reasoning", None) is None and quiet.message.tool_calls
    kw = dict(model="tiny-qwen3", messages=ASK, temperature=0, extra_body={"chat_template_kwargs": {"think": True}})
    m = c.chat.completions.create(**kw).choices[0].message
    assert (m.reasoning, m.content) == ("Paris, then.\n", "\n\nLet me look.")
    s = _streamed(c.chat.completions.create(stream=True, **kw))
    assert (s["reasoning"], s["content"]) == ("Paris, then.\n", "\n\nLet me look.")
    m = c.chat.completions.create(model="tiny-qwen3", messages=ASK, tools=TOOLS, temperature=0).choices[0].message
    assert m.reasoning is None and m.tool_calls


def test_tool_call_stream_across_an_engine_sigkill(tool_srv):
    """An engine SIGKILLed while a stream is writing its reasoning and tool call: the stream goes
    on from the next engine and ends as the fault-free one did (the reasoning, the call, its id's
    form, the text after it)."""
    from test_serve_http import stream_across_engine_kill
    c, base = _client(tool_srv["base"]), tool_srv["base"]
    kw = dict(model="tiny-qwen3", messages=ASK_THINK, tools=TOOLS, temperature=0, max_tokens=300, stream=True,
              extra_body={"ignore_eos": True})      # a long stream: reasoning, the call, then text after it
    ref = _streamed(c.chat.completions.create(**kw))
    assert ref["calls"] and ref["calls"][0]["name"] == "get_weather" and ref["finish"] == "tool_calls"
    assert ref["reasoning"] == THOUGHT
    got = _streamed(stream_across_engine_kill(base, lambda: c.chat.completions.create(**kw)))
    strip = [dict(x, id=x["id"].rsplit("-", 1)[-1]) for x in got["calls"]]
    assert dict(got, calls=strip) == dict(ref, calls=[dict(x, id=x["id"].rsplit("-", 1)[-1]) for x in ref["calls"]])


def test_forced_replies_are_calls_decided_at_the_end():
    from gpu_anchor.serve.tool_calls import forced, tool_grammar_schema
    two = '[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {}}]'
    assert forced(two, False, None).calls == [] and forced(two, False, None).content == ""
    assert forced(two, True, None).calls == [("f", '{"a": 1}'), ("g", "{}")]
    assert forced('{"a": 1}', True, "f").calls == [("f", '{"a": 1}')]
    for cut, name in [('[{"name": "f", "param', None), ('{"a": ', "f")]:      # cut by max_tokens: content
        assert forced(cut, True, name).content == cut and not forced(cut, True, name).calls
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "g"}}]
    assert tool_grammar_schema(tools, "g", True) == {"type": "object", "properties": {}}
    req = tool_grammar_schema(tools, None, False)
    assert req["maxItems"] == 1 and [o["properties"]["name"]["enum"] for o in req["items"]["anyOf"]] == [["f"], ["g"]]


# ------------------------------------------------------------------ Llama 3's JSON calls (--tool-call-parser llama3_json)
LLAMA_TEMPLATE = ("{% if tools %}Tools: {% for t in tools %}{{ t.function | tojson }} {% endfor %}\n{% endif %}"
                  "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                  "{% if add_generation_prompt %}[assistant] {% endif %}")
HI = [{"role": "user", "content": "Hi there"}]
HELLO = "Hello! How can I help?"


PY_TWO = '[get_weather(city="Paris"), get_weather(city="Rome")]'
ASK_ROME = [{"role": "user", "content": "Weather in Rome?"}]
MISTRAL_ROME = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Rome"}}]'


@pytest.fixture(scope="module")
def llama_srv(tmp_path_factory):
    """A Llama model taught to answer the weather question with Llama 3's JSON call, the question
    about two cities with a pythonic list of calls, the one about Rome with Mistral's and a
    greeting with text; served with --tool-call-parser llama3_json, pythonic and mistral:
    ``{parser: base URL}``."""
    from gpu_anchor.serve.tokenizer import Codec
    from gpu_anchor.testing.tiny import make_tiny_model
    from test_serve_api import start_server
    from test_serve_http import own_daemon, stop_server
    with own_daemon(tmp_path_factory, "llama-tools") as (d, sock):
        model = make_tiny_model(str(d / "tiny-llama"), "llama", seed=4)
        codec = Codec(model, 384, chat_template=LLAMA_TEMPLATE)
        _teach(model, [(codec.encode(codec.chat(ASK, tools=TOOLS)), codec.encode(LLAMA)),
                       (codec.encode(codec.chat(ASK_TWO, tools=TOOLS)), codec.encode(PY_TWO)),
                       (codec.encode(codec.chat(ASK_ROME, tools=TOOLS)), codec.encode(MISTRAL_ROME)),
                       (codec.encode(codec.chat(HI, tools=TOOLS)), codec.encode(HELLO))])
        procs, bases = [], {}
        try:
            for parser in ("llama3_json", "pythonic", "mistral"):
                (d / parser).mkdir()
                proc, bases[parser], _ = start_server(
                    str(d / parser), model, "--socket", sock, "--chat-template", LLAMA_TEMPLATE, "--served-model-name",
                    "tiny-llama", "--max-model-len", "512", "--namespace", f"llama-{parser}",
                    "--enable-auto-tool-choice", "--tool-call-parser", parser)
                procs.append(proc)
            yield bases
        finally:
            for proc in procs:
                stop_server(proc)


def test_llama3_json_pythonic_and_mistral_calls_through_the_openai_client(llama_srv):
    c = _client(llama_srv["llama3_json"])
    kw = dict(model="tiny-llama", tools=TOOLS, temperature=0, max_tokens=120)
    r = c.chat.completions.create(messages=ASK, **kw)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None and ch.message.tool_calls, ch
    (call,) = ch.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    got = _streamed(c.chat.completions.create(messages=ASK, stream=True, **kw))
    assert [(x["name"], x["arguments"]) for x in got["calls"]] == [("get_weather", call.function.arguments)]
    assert got["content"] == "" and got["finish"] == "tool_calls"
    hi = c.chat.completions.create(messages=HI, **kw).choices[0]
    assert hi.message.content == HELLO and not hi.message.tool_calls and hi.finish_reason == "stop"
    assert _streamed(c.chat.completions.create(messages=HI, stream=True, **kw))["content"] == HELLO
    py = _client(llama_srv["pythonic"])
    two = py.chat.completions.create(messages=ASK_TWO, **kw).choices[0]
    assert two.finish_reason == "tool_calls" and two.message.content is None
    assert [(t.function.name, json.loads(t.function.arguments)) for t in two.message.tool_calls] == \
        [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
    got = _streamed(py.chat.completions.create(messages=ASK_TWO, stream=True, **kw))
    assert [(x["name"], x["arguments"]) for x in got["calls"]] == \
        [(t.function.name, t.function.arguments) for t in two.message.tool_calls]
    assert py.chat.completions.create(messages=HI, **kw).choices[0].message.content == HELLO
    mi = _client(llama_srv["mistral"]).chat.completions.create(messages=ASK_ROME, **kw).choices[0]
    assert mi.finish_reason == "tool_calls" and mi.message.content is None
    assert [(t.function.name, json.loads(t.function.arguments)) for t in mi.message.tool_calls] == \
        [("get_weather", {"city": "Rome"})]
