"""Structured output: replies constrained to a JSON schema, a regular expression, a choice or a
grammar, as a vLLM user asks for them — ``response_format`` (and the ``openai`` SDK's
``chat.completions.parse`` with a pydantic model), ``structured_outputs``, the older
``guided_*`` fields — through the stock ``openai`` client against a real server on the CPU;
streamed and not, n > 1, after a reasoning, and across an engine SIGKILL.  Below that: the
request fields' grammars on a real tokenizer, and the engine's matchers (their state is a
function of the tokens: a new matcher given the tokens at once gives the same masks).

The model has random weights: what it writes is whatever the grammar lets a random model write
(JSON with odd whitespace), so each reply is checked against the schema itself, independently
of llguidance.
"""
from __future__ import annotations

import datetime
import enum
import json
import os
import re
from typing import Literal

import pytest

pytest.importorskip("llguidance",
                    reason="structured output needs llguidance (gpu-anchor[serve]; make test installs it)")

import preloaded  # noqa: E402
from gpu_anchor.serve import structured_output  # noqa: E402
from gpu_anchor.serve.grammar_matchers import Grammars, words  # noqa: E402
from gpu_anchor.serve.openai_checks import ApiError  # noqa: E402
from gpu_anchor.serve.sequence import SamplingParams, Sequence  # noqa: E402
from gpu_anchor.testing.tiny import TEXT, make_tiny_model  # noqa: E402

MODEL = "tiny-qwen3"
# <think> opened by the prompt when asked (chat_template_kwargs), else a closed empty one, as Qwen3's
# template writes it with enable_thinking false
TEMPLATE = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% if think %}<think>{% else %}<think></think>{% endif %}"
            "{% endif %}")
COLORS = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
          "required": ["ok", "color"], "additionalProperties": False}
LONG = {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 60, "maxItems": 60}


def _tokenizer(path: str) -> None:
    """The tiny model's tokenizer, with <think> and </think> as tokens of their own, not special
    (kept in the decoded text), as Qwen3's are."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=382, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([TEXT], trainer)
    tok.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
    assert tok.get_vocab_size() == 384, tok.get_vocab_size()
    tok.save(os.path.join(path, "tokenizer.json"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("so-model")
    model = make_tiny_model(str(d / MODEL), "qwen3", seed=11)
    _tokenizer(model)
    return model


@pytest.fixture(scope="module")
def tok(model_dir):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))


def _colors_ok(v) -> bool:
    return isinstance(v, dict) and set(v) == {"ok", "color"} and isinstance(v["ok"], bool) \
        and v["color"] in ("red", "green", "blue")


# ------------------------------------------------------------------ request fields -> grammars
def _accepts(model_dir, grammar: str, text: str, tok) -> bool:
    """Does ``grammar`` accept ``text`` whole (its tokens consumed, then complete)?"""
    import llguidance
    with open(os.path.join(model_dir, "tokenizer.json")) as f:
        lt = llguidance.LLTokenizer(f.read(), n_vocab=384, eos_token=2)
    m = llguidance.LLMatcher(lt, grammar, log_level=0)
    return m.consume_tokens(tok.encode(text).ids) and m.is_accepting()


@pytest.mark.parametrize("body,yes,no", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": COLORS}}},
     ['{"ok": true, "color": "red"}', '{ "ok":false ,"color":"blue"}'],
     ['{"ok": 1, "color": "red"}', '{"ok": true}', '{"color": "red", "ok": true}']),      # the schema's order
    ({"response_format": {"type": "json_object"}}, ['{"a": [1, 2]}', "{}"], ["[1]", '"x"']),
    ({"structured_outputs": {"json": json.dumps(COLORS)}}, ['{"ok":false,"color":"green"}'], ['{"color":"pink","ok":true}']),
    ({"guided_json": COLORS}, ['{"ok":false,"color":"green"}'], ['{}']),
    ({"guided_regex": r"[0-9]{3}-[a-z]{2}", "guided_decoding_backend": "xgrammar"}, ["123-ab"], ["12-ab", "123-abc"]),
    ({"structured_outputs": {"choice": ['say "hi"', "new\nline", "back\\slash"]}},
     ['say "hi"', "new\nline", "back\\slash"], ["say hi", "new"]),
    ({"guided_grammar": 'root ::= "yes" | "no" " " [0-9]+'}, ["yes", "no 42"], ["no", "maybe"]),   # GBNF
    ({"structured_outputs": {"grammar": 'start: "a"+ "b"'}}, ["aab"], ["b"]),                         # Lark
    ({"guided_json": COLORS, "structured_outputs": {"disable_any_whitespace": True}},
     ['{"ok":false,"color":"green"}'], ['{"ok": false,"color":"green"}']),
])
def test_request_fields_become_the_grammar_they_ask_for(model_dir, tok, body, yes, no):
    g = structured_output.grammar(body)
    for text in yes:
        assert _accepts(model_dir, g, text, tok), text
    for text in no:
        assert not _accepts(model_dir, g, text, tok), text


def test_no_constraint_and_bad_ones():
    assert structured_output.grammar({}) is None
    assert structured_output.grammar({"response_format": {"type": "text"}}) is None
    assert structured_output.grammar({"structured_outputs": {"json_object": False}}) is None
    for body, field in [({"guided_regex": "(("}, "guided_regex"),
                        ({"guided_json": {"type": "object", "properties": {"x": {"$ref": "#/nope"}}}}, "guided_json"),
                        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
                        ({"guided_choice": "a"}, "guided_choice"),
                        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice")]:
        with pytest.raises(ApiError) as e:
            structured_output.grammar(body)
        assert e.value.param == field, (body, e.value.body())


# ------------------------------------------------------------------ the engine's matchers
def _seq(rid, grammar, out, after=None):
    return Sequence(rid, [5, 6], SamplingParams(max_tokens=64, grammar=grammar, grammar_after=after), output_ids=out)


def _allowed(masks, k, V=384) -> set[int]:
    return {t for t in range(V) if (int(masks[k, t // 32]) >> (t % 32)) & 1}


def test_an_llguidance_too_old_is_named_not_crashed_on(model_dir, monkeypatch, caplog):
    """llguidance before 1.7 takes one end-of-sequence token only (found on an H100 with 1.6.1:
    TypeError at ``LLTokenizer``, a hot standby dead while preparing).  With such a version
    installed, a constrained request is a 400 naming the version and the fix, and an engine's
    (a standby's) advance build of the vocabulary is skipped with a warning."""
    import logging

    from gpu_anchor.serve import grammar_matchers
    monkeypatch.setattr(grammar_matchers, "installed_llguidance", lambda: "1.6.1")
    with pytest.raises(ApiError, match=r"needs llguidance >= 1.7 on the server \(llguidance 1.6.1 is installed\): "
                                       r"pip install -U 'llguidance>=1.7'") as e:
        structured_output.grammar({"guided_json": COLORS})
    assert e.value.status == 400
    with caplog.at_level(logging.WARNING, logger="gpu_anchor.serve"):
        assert Grammars(model_dir, 384, [2]).prepare() is False
    assert "llguidance 1.6.1 is installed" in caplog.text
    monkeypatch.setattr(grammar_matchers, "installed_llguidance", lambda: "1.9.1")
    assert structured_output.grammar({"guided_json": COLORS}) and Grammars(model_dir, 384, [2]).prepare() is True


def test_matcher_state_is_a_function_of_the_tokens(model_dir, tok):
    """Masks taken token by token equal those of a new matcher given all the tokens at once (an
    engine that replaced a killed one), and after a rewind or another history under the same id."""
    g = structured_output.grammar({"guided_json": COLORS})
    text = tok.encode('{"ok": true, "color": "green"}').ids
    live = Grammars(model_dir, 384, [2])
    for i in range(len(text) + 1):
        rows, masks = live.bitmasks([_seq("a", g, text[:i])])
        fresh_rows, fresh = Grammars(model_dir, 384, [2]).bitmasks([_seq("a", g, text[:i])])
        assert rows == fresh_rows == [0] and (masks == fresh).all(), i
        if i < len(text):
            assert text[i] in _allowed(masks, 0)
    assert _allowed(masks, 0) == {2}                       # complete: EOS only
    rows, masks = live.bitmasks([_seq("a", g, text[:3])])  # rewound
    assert (masks == Grammars(model_dir, 384, [2]).bitmasks([_seq("a", g, text[:3])])[1]).all()
    other = tok.encode('{"color": "red"').ids                # another history of the same length class
    assert (live.bitmasks([_seq("a", g, other)])[1] == Grammars(model_dir, 384, [2]).bitmasks([_seq("a", g, other)])[1]).all()
    assert masks.shape == (1, words(384))


def test_rows_reasoning_and_refused_tokens(model_dir, tok):
    g = structured_output.grammar({"guided_regex": "[0-9]+"})
    end = tok.token_to_id("</think>")
    gm = Grammars(model_dir, 384, [2])
    free = Sequence("f", [5], SamplingParams(max_tokens=8))
    thinking = _seq("t", g, tok.encode("some thought").ids, after=end)
    answered = _seq("u", g, tok.encode("thought").ids + [end], after=end)
    rows, masks = gm.bitmasks([free, thinking, answered])
    assert rows == [2]                                     # the open reasoning is free; so is a plain row
    digits = _allowed(masks, 0)
    assert digits and all(re.fullmatch(r"[0-9]+", tok.decode([t])) for t in digits)
    bad = _seq("b", g, tok.encode("x").ids)                # a history the grammar refuses (a resync)
    assert _allowed(gm.bitmasks([bad])[1], 0) == {2}      # it may only end
    gm.forget({"u"})
    assert set(gm._m) == {"u"}


def test_engine_generate_keeps_to_the_grammar(model_dir, tok):
    """``Engine.generate`` with grammars on sampled rows beside a free one (the CPU engine)."""
    from gpu_anchor.serve.engine import Engine, EngineConfig
    eng = Engine(EngineConfig(model=model_dir, anchor=False, num_blocks=64, dtype="float64"))
    g_json = structured_output.grammar({"guided_json": COLORS})
    g_re = structured_output.grammar({"guided_regex": r"[0-9]{3}-[a-z]{2}"})
    ps = [SamplingParams(max_tokens=200, temperature=1.0, seed=s, grammar=g_json) for s in range(3)]
    ps += [SamplingParams(max_tokens=20, temperature=1.0, seed=7, grammar=g_re), SamplingParams(max_tokens=20)]
    outs = eng.generate([[5, 6, 7]] * 5, ps)
    for o in outs[:3]:
        assert o[-1] == 2 and _colors_ok(json.loads(tok.decode(o[:-1])))
    assert outs[3][-1] == 2 and re.fullmatch(r"[0-9]{3}-[a-z]{2}", tok.decode(outs[3][:-1]))
    assert not eng.grammars.held()                         # finished: matchers dropped


# ------------------------------------------------------------------ through the server and the openai client
@pytest.fixture(scope="module")
def so_srv(tmp_path_factory, model_dir):
    from test_serve_api import start_server
    from test_serve_http import own_daemon, stop_server
    with own_daemon(tmp_path_factory, "structured") as (d, sock):
        proc, base, log_path = start_server(str(d), model_dir, "--socket", sock, "--chat-template", TEMPLATE,
                                            "--reasoning-parser", "qwen3", "--max-model-len", "512",
                                            "--guided-decoding-backend", "xgrammar")     # vLLM's older option
        try:
            yield {"base": base, "log": log_path}
        finally:
            stop_server(proc)


def _client(base):
    import openai
    return openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)


ASK = [{"role": "user", "content": "Which color?"}]


def test_pydantic_model_through_the_sdks_parse(so_srv):
    """The openai SDK's ``chat.completions.parse`` sends a strict json_schema for a pydantic model
    and parses the reply into it: it must parse, for every seed."""
    from pydantic import BaseModel, Field

    class Color(str, enum.Enum):
        red, green = "red", "green"

    class Answer(BaseModel):
        color: Color
        kind: Literal["warm", "cold"]
        day: datetime.date
        score: int = Field(ge=0, le=9)
        tags: list[Literal["a", "b"]] = Field(max_length=2)
    c = _client(so_srv["base"])
    for seed in range(3):
        r = c.chat.completions.parse(model=MODEL, messages=ASK, response_format=Answer, temperature=1.0, seed=seed,
                                     max_tokens=300)
        m = r.choices[0].message
        assert r.choices[0].finish_reason == "stop" and isinstance(m.parsed, Answer), m.content
        assert m.parsed == Answer.model_validate_json(m.content)


def test_json_object_json_schema_streamed_and_n(so_srv):
    c = _client(so_srv["base"])
    r = c.chat.completions.create(model=MODEL, messages=ASK, response_format={"type": "json_object"}, seed=1,
                                  temperature=1.0, max_tokens=200, n=2)
    for ch in r.choices:
        if ch.finish_reason == "stop":
            assert isinstance(json.loads(ch.message.content), dict)
    fmt = {"type": "json_schema", "json_schema": {"name": "colors", "schema": COLORS, "strict": True}}
    whole = c.chat.completions.create(model=MODEL, messages=ASK, response_format=fmt, seed=2, temperature=1.0,
                                      max_tokens=300)
    text = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model=MODEL, messages=ASK, response_format=fmt, seed=2, temperature=1.0, max_tokens=300, stream=True)
        if ch.choices)
    assert text == whole.choices[0].message.content and _colors_ok(json.loads(text))
    free = c.chat.completions.create(model=MODEL, messages=ASK, seed=2, temperature=1.0, max_tokens=30)
    assert free.choices[0].message.content != text          # the grammar is what made it JSON


def test_completions_choice_regex_and_grammar(so_srv):
    c = _client(so_srv["base"])
    r = c.completions.create(model=MODEL, prompt="The color is", max_tokens=20, temperature=1.0, seed=3, n=4,
                             extra_body={"structured_outputs": {"choice": ["red", "green", "light blue"]}})
    assert {ch.text for ch in r.choices} <= {"red", "green", "light blue"}
    assert all(ch.finish_reason == "stop" for ch in r.choices)
    r = c.completions.create(model=MODEL, prompt="Code:", max_tokens=20, temperature=1.0, seed=4,
                             extra_body={"guided_regex": r"[A-Z]{2}-[0-9]{4}"})
    assert re.fullmatch(r"[A-Z]{2}-[0-9]{4}", r.choices[0].text)
    r = c.completions.create(model=MODEL, prompt="Answer:", max_tokens=20, temperature=1.0, seed=5,
                             extra_body={"structured_outputs": {"grammar": 'root ::= ("yes" | "no") "!"'}})
    assert r.choices[0].text in ("yes!", "no!")


def test_constrained_after_the_reasoning(so_srv, tok):
    """With --reasoning-parser, a prompt that opened the reasoning leaves it free: the grammar
    holds from the token after </think> (here pushed by logit_bias), and the answer is the JSON."""
    end = tok.token_to_id("</think>")
    c = _client(so_srv["base"])
    r = c.chat.completions.create(model=MODEL, messages=ASK, temperature=1.0, seed=6, max_tokens=300,
                                  response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": COLORS}},
                                  logit_bias={str(end): 100},
                                  extra_body={"chat_template_kwargs": {"think": True},
                                              "structured_outputs": {"disable_any_whitespace": True}})
    m = r.choices[0].message
    assert not getattr(m, "reasoning", None) and _colors_ok(json.loads(m.content)), m
    assert m.content == m.content.strip() and "\n" not in m.content


def test_constrained_stream_across_an_engine_sigkill(so_srv):
    """An engine SIGKILLed while a constrained stream is being written: the next engine's matcher
    is rebuilt from the delivered tokens, and the stream ends as the fault-free one did."""
    from test_serve_http import stream_across_engine_kill
    c, base = _client(so_srv["base"]), so_srv["base"]
    kw = dict(model=MODEL, prompt="Sixty colors:", max_tokens=480, temperature=1.0, seed=8, stream=True,
              extra_body={"guided_json": LONG, "structured_outputs": {"disable_any_whitespace": True}})
    ref = "".join(ch.choices[0].text for ch in c.completions.create(**kw))
    assert len(json.loads(ref)) == 60
    got = stream_across_engine_kill(base, lambda: c.completions.create(**kw))
    assert "".join(ch.choices[0].text for ch in got) == ref


def test_server_structured_outputs_config(tmp_path_factory, model_dir):
    """``--structured-outputs-config``: ``disable_any_whitespace`` makes JSON replies compact unless
    a request says otherwise; ``enable_in_reasoning`` constrains an opened reasoning too (it is then
    the JSON); bad settings stop the server at start with a message naming them."""
    import sys

    from test_serve_api import start_server
    from test_serve_http import own_daemon, stop_server
    for bad, said in [('{"backend": "magic"}', "backend"), ('{"whitespace": 1}', "whitespace"), ("{", "JSON")]:
        r = preloaded.run([sys.executable, "-m", "gpu_anchor.serve", model_dir, "--device", "cpu",
                           "--structured-outputs-config", bad], timeout=120, preload=preloaded.HF)
        assert r.returncode == 2 and said in r.stderr, r.stderr[-2000:]
    fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": COLORS}}
    with own_daemon(tmp_path_factory, "so-config") as (d, sock):
        proc, base, _ = start_server(str(d), model_dir, "--socket", sock, "--chat-template", TEMPLATE,
                                     "--reasoning-parser", "qwen3", "--max-model-len", "512",
                                     "--structured-outputs-config",
                                     '{"backend": "guidance", "disable_any_whitespace": true, "enable_in_reasoning": true}')
        try:
            c = _client(base)
            for seed in range(3):
                m = c.chat.completions.create(model=MODEL, messages=ASK, response_format=fmt, temperature=1.0,
                                              seed=seed, max_tokens=100).choices[0].message
                v = json.loads(m.content)
                assert _colors_ok(v) and m.content == json.dumps(v, separators=(",", ":"))
            m = c.chat.completions.create(model=MODEL, messages=ASK, response_format=fmt, temperature=1.0, seed=1,
                                          max_tokens=100, extra_body={"chat_template_kwargs": {"think": True}}
                                          ).choices[0].message
            assert _colors_ok(json.loads(m.reasoning)) and not m.content      # the reasoning was constrained
            loose = c.chat.completions.create(model=MODEL, messages=ASK, response_format=fmt, temperature=1.0, seed=0,
                                              max_tokens=300, extra_body={"structured_outputs": {
                                                  "disable_any_whitespace": False}}).choices[0].message.content
            assert _colors_ok(json.loads(loose)) and loose != json.dumps(json.loads(loose), separators=(",", ":"))
        finally:
            stop_server(proc)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"]}}}]
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}


def _call_ok(name: str, arguments: str) -> bool:
    a = json.loads(arguments)
    return name == "get_weather" and a == {"city": a["city"]} and a["city"] in ("Paris", "Rome") \
        or name == "get_time" and a == {"utc": a["utc"]} and isinstance(a["utc"], bool)


def test_forced_tool_choice_required_and_named(so_srv):
    """``tool_choice: "required"`` and a named function (no tool parser needed, as in vLLM): the
    reply is constrained to calls of the tools, returned as ``tool_calls``; streamed through the
    SDK's helper the same; ``parallel_tool_calls: false`` makes it one call."""
    c = _client(so_srv["base"])
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, temperature=1.0, max_tokens=400, extra_body=COMPACT)
    for seed in range(3):
        r = c.chat.completions.create(tool_choice="required", seed=seed, **kw)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and ch.message.content is None and ch.message.tool_calls, ch
        assert all(_call_ok(t.function.name, t.function.arguments) for t in ch.message.tool_calls)
        with c.chat.completions.stream(tool_choice="required", seed=seed, **kw) as st:
            final = st.get_final_completion().choices[0]
        assert [(t.function.name, t.function.arguments) for t in final.message.tool_calls] == \
            [(t.function.name, t.function.arguments) for t in ch.message.tool_calls]
        one = c.chat.completions.create(tool_choice="required", parallel_tool_calls=False, seed=seed, **kw)
        assert len(one.choices[0].message.tool_calls) == 1
    named = {"type": "function", "function": {"name": "get_time"}}
    r = c.chat.completions.create(tool_choice=named, seed=4, **kw)
    ch = r.choices[0]
    (call,) = ch.message.tool_calls
    assert ch.finish_reason == "stop" and call.function.name == "get_time" and _call_ok("get_time", call.function.arguments)
    assert call.id.startswith("chatcmpl-tool-")


# ------------------------------------------------------------------ on the GPU
@pytest.mark.gpu
def test_grammar_masks_on_cuda(model_dir, tok, cuda_daemon):
    """On CUDA (graphs, asynchronous scheduling on by default): the mask gives the CPU's logits
    bit for bit; constrained rows keep to their grammar beside free rows, their steps run
    synchronously, and the free rows' steps still run ahead when no constrained row is left."""
    import torch
    from gpu_anchor.serve.engine import Engine, EngineConfig
    from gpu_anchor.serve.logit_adjust import adjust_logits
    g_json = structured_output.grammar({"guided_json": COLORS, "structured_outputs": {"disable_any_whitespace": True}})
    gm = Grammars(model_dir, 384, [2])
    seqs = [_seq("a", g_json, tok.encode('{"ok":').ids), Sequence("b", [5], SamplingParams()),
            _seq("c", g_json, [])]
    allowed = gm.bitmasks(seqs)
    x = torch.randn(3, 384, generator=torch.Generator().manual_seed(1))
    ps, prompts, outs = [s.params for s in seqs], [s.prompt_ids for s in seqs], [s.output_ids for s in seqs]
    cpu = adjust_logits(x, ps, prompts, outs, [3, 0, 0], [2], allowed=allowed)
    assert torch.equal(adjust_logits(x.cuda(), ps, prompts, outs, [3, 0, 0], [2], allowed=allowed).cpu(), cpu)
    assert torch.equal(cpu[1], x[1]) and torch.isinf(cpu[0]).sum() > 300
    eng = Engine(EngineConfig(model=model_dir, device="cuda:0", dtype="bfloat16", block_size=16, num_blocks=256,
                              socket=cuda_daemon[0], namespace="structured"))
    ps = [SamplingParams(max_tokens=120, temperature=1.0, seed=s, grammar=g_json) for s in range(4)]
    ps += [SamplingParams(max_tokens=160, temperature=1.0, seed=9, ignore_eos=True) for _ in range(4)]
    outs = eng.generate([[5, 6, 7, 8]] * 8, ps)
    for o in outs[:4]:
        assert o[-1] == 2 and _colors_ok(json.loads(tok.decode(o[:-1])))
    assert all(len(o) == 160 for o in outs[4:])
    assert eng.step_counts["sync"] > 0 and eng.step_counts["async"] > 0, eng.step_counts
