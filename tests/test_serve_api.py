"""The vLLM-compatible surface of ``gpu-anchor serve``, through the stock ``openai`` client and
plain HTTP against a real server on the CPU: every invalid field is a 400 naming it, an unknown
model a 404, the API key a 401; ``stream_options``; ``logprobs`` / ``top_logprobs`` checked
against transformers' own forward pass; penalties against transformers' ``generate`` and forward; ``echo``; ``/tokenize`` and ``/detokenize``; ``/metrics`` read with Prometheus' parser;
the loading progress and the ready line; and the options (``--tensor-parallel-size``,
``--max-batched-tokens`` alias, KV sizing from ``--gpu-memory-utilization``, ``--chat-template``).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

import preloaded
from gpu_anchor.testing.tiny import make_tiny_model
from test_serve_http import _get, own_daemon, scrape, stop_server

KEY = "test-key-123"
MODEL = "tiny-qwen3"
# A template of our own: a chat prompt's tokens show which template rendered it.
TEMPLATE = ("{% if messages[0]['role'] == 'bad' %}{{ raise_exception('bad is not a role') }}{% endif %}"
            "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")
SERVE = ["--device", "cpu", "--dtype", "float64", "--block-size", "4", "--num-blocks", "400",
         "--max-num-batched-tokens", "32", "--max-model-len", "256", "--cpu-threads", "1"]


def start_server(d, model, *extra, env=None):
    """``gpu-anchor serve`` with a user's arguments (through ``tests/preloaded.py``); returns (process,
    base URL, log path)."""
    port_file, log_path = os.path.join(d, "port"), os.path.join(d, "serve.log")
    if os.path.exists(port_file):
        os.unlink(port_file)
    proc = preloaded.Popen([sys.executable, "-m", "gpu_anchor.serve", model, "--port", "0", "--port-file",
                            port_file, *SERVE, *extra], stdout=subprocess.DEVNULL,
                           stderr=open(log_path, "ab"), env=env, preload=preloaded.HF)
    deadline = time.time() + 180
    while not os.path.exists(port_file):
        assert proc.poll() is None and time.time() < deadline, open(log_path).read()[-3000:]
        time.sleep(0.1)
    base = f"http://127.0.0.1:{open(port_file).read()}"
    while _get(base + "/health")[0] != 200:
        assert proc.poll() is None and time.time() < deadline, open(log_path).read()[-3000:]
        time.sleep(0.05)
    return proc, base, log_path


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    """The module's server, with a daemon and a socket directory of its own: its job record and
    job lock land there, not in the default directory that other servers on this host use."""
    with own_daemon(tmp_path_factory, "api") as (d, sock):
        model = make_tiny_model(str(d / MODEL), "qwen3", seed=3)
        proc, base, log_path = start_server(str(d), model, "--socket", sock, "--api-key", KEY,
                                            "--chat-template", TEMPLATE)
        try:
            yield {"base": base, "model": model, "log": log_path}
        finally:
            stop_server(proc)


def post(base, path, body, key=KEY):
    """(status, parsed JSON or SSE events)."""
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            text = r.read().decode()
            status = r.status
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    if text.startswith("data: "):
        events = [x[len("data: "):] for x in text.split("\n\n") if x.startswith("data: ")]
        assert events[-1] == "[DONE]"
        return status, [json.loads(x) for x in events[:-1]]
    return status, json.loads(text)


def client(base, key=KEY):
    import openai
    return openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0)


# ------------------------------------------------------------------ 400 naming the field
C, CH = "/v1/completions", "/v1/chat/completions"
P = {"model": MODEL, "prompt": "hello world", "max_tokens": 4}
M = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
BAD = [
    (C, dict(P, temperature="hot"), "temperature"),
    (C, dict(P, temperature=-1), "temperature"),
    (C, dict(P, max_tokens=-5), "max_tokens"),
    (C, dict(P, max_tokens=0), "max_tokens"),
    (C, dict(P, max_tokens="ten"), "max_tokens"),
    (C, dict(P, max_tokens=10_000), "max_tokens"),
    (CH, dict(M, max_completion_tokens=True), "max_completion_tokens"),
    (C, dict(P, n=0), "n"),
    (CH, dict(M, n=129), "n"),
    (C, dict(P, best_of=3), "best_of"),
    (C, dict(P, top_p=0), "top_p"),
    (C, dict(P, top_p=1.5), "top_p"),
    (C, dict(P, top_k="x"), "top_k"),
    (C, dict(P, seed=1.5), "seed"),
    (C, dict(P, stop=5), "stop"),
    (C, dict(P, stop=["ok", ""]), "stop"),
    (C, dict(P, stop_token_ids=["a"]), "stop_token_ids"),
    (C, dict(P, stream="yes"), "stream"),
    (C, dict(P, stream_options={"include_usage": True}), "stream_options"),
    (C, dict(P, stream=True, stream_options={"include_usage": "yes"}), "stream_options.include_usage"),
    (C, dict(P, stream=True, stream_options={"nope": True}), "stream_options.nope"),
    (C, dict(P, logprobs=50), "logprobs"),
    (C, dict(P, logprobs=True), "logprobs"),
    (C, dict(P, echo="yes"), "echo"),
    (C, dict(P, prompt_logprobs=21), "prompt_logprobs"),
    (C, dict(P, prompt_logprobs=-1), "prompt_logprobs"),
    (CH, dict(M, prompt_logprobs=True), "prompt_logprobs"),
    (C, dict(P, prompt_logprobs=1, stream=True), "prompt_logprobs"),
    (CH, dict(M, top_logprobs=2), "top_logprobs"),
    (CH, dict(M, logprobs=True, top_logprobs=21), "top_logprobs"),
    (CH, dict(M, logprobs=3), "logprobs"),
    (C, dict(P, presence_penalty=2.5), "presence_penalty"),
    (CH, dict(M, frequency_penalty="1"), "frequency_penalty"),
    (C, dict(P, repetition_penalty=0), "repetition_penalty"),
    (C, dict(P, min_p=1.5), "min_p"),
    (C, dict(P, min_tokens=-1), "min_tokens"),
    (C, dict(P, logit_bias={"hello": 10}), "logit_bias"),
    (C, dict(P, logit_bias={"5": 101}), "logit_bias"),
    (CH, dict(M, logit_bias={"100000": 1}), "logit_bias"),
    (C, dict(P, logit_bias=[5, 10]), "logit_bias"),
    (C, dict(P, suffix="end"), "suffix"),
    (CH, dict(M, tools=[{"type": "function", "function": {"name": "f"}}]), "tool_choice"),  # no --enable-auto-tool-choice
    (CH, dict(M, tool_choice="required"), "tool_choice"),                                  # no tools
    (CH, dict(M, tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="sometimes"), "tool_choice"),
    (CH, dict(M, tools=[{"type": "function", "function": {"name": "f"}}],
              tool_choice={"type": "function", "function": {"name": "g"}}), "tool_choice"),   # not a tool
    (CH, dict(M, tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="required",
              response_format={"type": "json_object"}), "tool_choice"),
    (CH, dict(M, tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
              tool_choice="required"), "tools"),
    (CH, dict(M, tools=[{"type": "function"}], tool_choice="none"), "tools[0]"),
    (CH, dict(M, tools={"name": "f"}), "tools"),
    (CH, dict(M, tool_choice="auto"), "tool_choice"),
    (CH, dict(M, functions=[{"name": "f"}]), "functions"),
    (CH, dict(M, messages=[{"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]),
     "messages[0].tool_calls[0].function.arguments"),
    (C, dict(P, tools=[]), "tools"),                        # a chat field, unknown to completions
    (CH, dict(M, response_format={"type": "xml"}), "response_format"),
    (CH, dict(M, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}),
     "response_format.json_schema.schema"),
    (C, dict(P, guided_json="{not json"), "guided_json"),
    (C, dict(P, guided_regex="a(b"), "guided_regex"),
    (C, dict(P, guided_choice=[]), "guided_choice"),
    (C, dict(P, structured_outputs={"grammar": "root ::= (\"a\""}), "structured_outputs.grammar"),
    (C, dict(P, structured_outputs={"grammar": "start: foo"}), "structured_outputs.grammar"),
    (C, dict(P, structured_outputs={"whitespace_pattern": " "}), "structured_outputs.whitespace_pattern"),
    (C, dict(P, structured_outputs={"json": {"type": "object"}, "regex": "x"}), "structured_outputs.regex"),
    (CH, dict(M, response_format={"type": "json_object"}, guided_regex="x"), "guided_regex"),
    (C, dict(P, guided_regex="[0-9]+", min_tokens=2), "min_tokens"),
    (C, dict(P, guided_regex="[0-9]+", guided_decoding_backend="magic"), "guided_decoding_backend"),
    (C, dict(P, foo=1), "foo"),
    (CH, dict(M, echo=True), "echo"),                       # a completions field, unknown to chat
    (C, dict(P, prompt=["one", 5]), "prompt"),
    (C, dict(P, prompt=["one", []]), "prompt"),
    (C, dict(P, prompt=["x"] * 257), "prompt"),
    (C, dict(P, prompt=["x"] * 9, n=128), "n"),
    (C, dict(P, prompt=[1, 2, 99999]), "prompt"),
    (C, dict(P, prompt={"text": "x"}), "prompt"),
    (C, dict(P, prompt=""), "prompt"),
    (C, dict(P, model=7), "model"),
    (C, dict(P, user=5), "user"),
    (CH, dict(M, parallel_tool_calls="no"), "parallel_tool_calls"),
    (CH, dict(M, include_reasoning=1), "include_reasoning"),
    (CH, dict(M, messages="hi"), "messages"),
    (CH, dict(M, messages=[]), "messages"),
    (CH, dict(M, messages=[{"content": "no role"}]), "messages[0]"),
    (CH, dict(M, messages=[{"role": "user", "content": 5}]), "messages[0].content"),
    (CH, dict(M, messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     "messages[0].content[0]"),
    (CH, dict(M, messages=[{"role": "bad", "content": "x"}]), "messages"),   # the template refuses it
    (CH, dict(M, chat_template_kwargs=[1]), "chat_template_kwargs"),
]


@pytest.mark.parametrize("path,body,field", BAD, ids=[f"{f}:{json.dumps(b)[:60]}" for _, b, f in BAD])
def test_invalid_field_is_400_naming_it(srv, path, body, field):
    status, reply = post(srv["base"], path, body)
    assert status == 400, reply
    err = reply["error"]
    assert err["param"] == field and field in err["message"] and err["code"] == 400, err
    assert "Traceback" not in err["message"]


def test_bad_bodies_and_the_openai_client(srv):
    import openai
    base = srv["base"]
    assert post(base, C, b"{not json")[0] == 400
    assert post(base, C, b"[1, 2]")[0] == 400
    c = client(base)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL, prompt="x", max_tokens=4, temperature="hot")
    assert "temperature" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                  extra_body={"use_beam_search": True})
    assert "beam search" in str(e.value)


def test_unknown_model_is_404(srv):
    import openai
    c = client(srv["base"])
    with pytest.raises(openai.NotFoundError) as e:
        c.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    assert "gpt-4" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}], stream=True)
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("gpt-4")
    assert c.models.retrieve(MODEL).id == MODEL
    status, reply = post(srv["base"], C, {"prompt": "hello", "max_tokens": 2})      # no model: the served one
    assert status == 200 and reply["model"] == MODEL


def test_api_key(srv):
    import openai
    base = srv["base"]
    for key in (None, "wrong"):
        status, reply = post(base, C, P, key=key)
        assert status == 401 and reply["error"]["code"] == 401
        assert _get(base + "/v1/models")[0] == 401
    with pytest.raises(openai.AuthenticationError):
        client(base, key="wrong").completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert post(base, "/admin/migrate", {"device": "cpu"}, key=None)[0] == 401      # migration needs it too
    assert _get(base + "/health")[0] == 200 and _get(base + "/metrics")[0] == 200    # as vLLM: open
    from gpu_anchor import __version__
    assert _get(base + "/ping")[0] == 200 and json.loads(_get(base + "/version")[1]) == {"version": __version__}
    assert client(base).completions.create(model=MODEL, prompt="x", max_tokens=2,       # no EOS drawn: 2 tokens
                                           extra_body={"ignore_eos": True}).usage.completion_tokens == 2


# ------------------------------------------------------------------ streaming options
def test_include_usage_and_continuous_usage(srv):
    c = client(srv["base"])
    kw = dict(model=MODEL, prompt="The quick brown fox", max_tokens=9, temperature=0, extra_body={"ignore_eos": True})
    whole = c.completions.create(**kw)
    chunks = list(c.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    last = chunks[-1]
    u, w = last.usage.model_dump(), whole.usage.model_dump()
    # the same prompt again: prefix caching found its whole blocks computed (all but the last token's)
    assert u.pop("prompt_tokens_details")["cached_tokens"] == (w["prompt_tokens"] - 1) // 4 * 4
    w.pop("prompt_tokens_details")
    assert last.choices == [] and u == w
    assert all(ch.usage is None for ch in chunks[:-1])
    assert "".join(ch.choices[0].text for ch in chunks[:-1]) == whole.choices[0].text
    plain = list(c.completions.create(stream=True, **kw))
    assert all(ch.usage is None and ch.choices for ch in plain)
    msgs = [{"role": "user", "content": "Hello world!"}]
    cont = list(c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0, stream=True,
                                          stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [ch.usage.completion_tokens for ch in cont]
    assert counts == sorted(counts) and cont[-1].choices == [] and counts[-1] == cont[-2].usage.completion_tokens
    assert cont[0].choices[0].delta.role == "assistant"


# ------------------------------------------------------------------ logprobs, echo, chat template
def _hf_logprobs(model_dir, prompt_ids, out_ids):
    """log-softmax of transformers' own forward over prompt + output, at each output token."""
    import torch
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    ids = torch.tensor([prompt_ids + out_ids])
    with torch.no_grad():
        lp = torch.log_softmax(m(ids).logits[0].float(), dim=-1)
    return lp[len(prompt_ids) - 1:len(prompt_ids) + len(out_ids) - 1]


def test_logprobs_match_transformers(srv):
    from gpu_anchor.serve.tokenizer import Codec
    c, model = client(srv["base"]), srv["model"]
    codec = Codec(model, 384)
    prompt = "The quick brown fox jumps"
    r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=3,
                             extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    lp = r.choices[0].logprobs
    out = [int(t.split(":")[1]) for t in lp.tokens]
    assert len(out) == r.usage.completion_tokens == 8 and codec.decode(out) == r.choices[0].text
    ref = _hf_logprobs(model, codec.encode(prompt), out)
    for k, t in enumerate(out):
        assert abs(lp.token_logprobs[k] - ref[k, t].item()) < 1e-4
        top = sorted(lp.top_logprobs[k].items(), key=lambda kv: -kv[1])
        want = ref[k].topk(3)
        assert [int(s.split(":")[1]) for s, _ in top] == want.indices.tolist()
        assert max(abs(v - w) for (_, v), w in zip(top, want.values.tolist())) < 1e-4
        assert lp.token_logprobs[k] == top[0][1]                   # greedy: the chosen one is the top one
    # streamed, the same numbers; the text offsets add up
    chunks = list(c.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=3,
                                       stream=True, extra_body={"ignore_eos": True}))
    toks = [t for ch in chunks for t in (ch.choices[0].logprobs.tokens if ch.choices[0].logprobs else [])]
    vals = [t for ch in chunks for t in (ch.choices[0].logprobs.token_logprobs if ch.choices[0].logprobs else [])]
    offs = [t for ch in chunks for t in (ch.choices[0].logprobs.text_offset if ch.choices[0].logprobs else [])]
    assert toks == [codec.token_text(t) for t in out] and vals == lp.token_logprobs
    assert offs == [sum(len(x) for x in toks[:k]) for k in range(len(toks))]
    # chat, sampled with a seed: the chosen token's log-probability is still the model's
    msgs = [{"role": "user", "content": "Hello world!"}]
    ch = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0.9, seed=11,
                                   logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True,
                                                                              "return_tokens_as_token_ids": True})
    content = ch.choices[0].logprobs.content
    got = [int(e.token.split(":")[1]) for e in content]
    assert len(got) == 6 and all(len(e.top_logprobs) == 2 for e in content)
    chat_ids = codec.encode(Codec(model, 384, chat_template=TEMPLATE).chat(msgs))
    assert ch.usage.prompt_tokens == len(chat_ids)
    ref = _hf_logprobs(model, chat_ids, got)
    assert max(abs(e.logprob - ref[k, t].item()) for k, (e, t) in enumerate(zip(content, got))) < 1e-4
    streamed = list(c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0.9, seed=11,
                                              logprobs=True, stream=True, extra_body={"ignore_eos": True}))
    assert [e.logprob for x in streamed if x.choices[0].logprobs for e in x.choices[0].logprobs.content] == \
        [e.logprob for e in content]
    # no logprobs asked: none given
    assert c.completions.create(model=MODEL, prompt="x", max_tokens=2).choices[0].logprobs is None


def _hf_greedy(model_dir, prompt_ids, n, presence=0.0, frequency=0.0, bias=None, min_tokens=0, stop=()):
    """Greedy decoding with transformers' forward and OpenAI's definitions: ``bias`` added to
    the logits, then the two penalties over the generated tokens (logit -= presence * (count > 0)
    + frequency * count); ``stop`` ids end it, and cannot be drawn before ``min_tokens``."""
    import torch
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    out = []
    with torch.no_grad():
        while len(out) < n and not (out and out[-1] in stop):
            logits = m(torch.tensor([prompt_ids + out])).logits[0, -1]
            if len(out) < min_tokens:
                logits[list(stop)] = float("-inf")
            for t, v in (bias or {}).items():
                logits[t] += v
            counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.shape[0]).double()
            logits = logits - frequency * counts - presence * (counts > 0).double()
            out.append(int(logits.argmax()))
    return out


def test_penalties_match_transformers(srv):
    """``repetition_penalty`` (an extra field, as with vLLM) against transformers' own
    ``generate(repetition_penalty=...)``, and ``presence_penalty`` / ``frequency_penalty`` (the
    openai client's parameters) against a greedy loop over transformers' forward with OpenAI's
    definition; each changes the tokens, streamed or not.  Refused with a 400 before."""
    import torch
    from transformers import AutoModelForCausalLM
    from gpu_anchor.serve.tokenizer import Codec
    c, model = client(srv["base"]), srv["model"]
    ids = Codec(model, 384).encode("The quick brown fox jumps")
    extra = {"ignore_eos": True, "return_tokens_as_token_ids": True}

    def tokens(r):
        return [int(t.split(":")[1]) for t in r.choices[0].logprobs.tokens]
    plain = tokens(c.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0, logprobs=0,
                                        extra_body=extra))
    rep = tokens(c.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0, logprobs=0,
                                      extra_body=dict(extra, repetition_penalty=1.5)))
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float64)
    want = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, repetition_penalty=1.5,
                       eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    assert rep == want and rep != plain
    pen = tokens(c.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0, logprobs=0,
                                      presence_penalty=0.7, frequency_penalty=0.9, extra_body=extra))
    assert pen == _hf_greedy(model, ids, 12, presence=0.7, frequency=0.9) and pen != plain
    streamed = c.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0, stream=True, logprobs=0,
                                    presence_penalty=0.7, frequency_penalty=0.9, extra_body=extra)
    assert [int(t.split(":")[1]) for ch in streamed if ch.choices[0].logprobs
            for t in ch.choices[0].logprobs.tokens] == pen


def test_logit_bias_min_tokens_and_min_p(srv):
    """``logit_bias`` (the openai client's parameter: a ban and a push) and ``min_tokens`` (a stop
    token the plain run draws early is held off until then) against the greedy loop over
    transformers' forward, and a stop string held off as vLLM does; ``min_p`` sampled with a seed draws the same tokens twice.  Each was
    refused with a 400 before."""
    from gpu_anchor.serve.tokenizer import Codec
    c, model = client(srv["base"]), srv["model"]
    ids = Codec(model, 384).encode("The quick brown fox jumps")
    extra = {"ignore_eos": True, "return_tokens_as_token_ids": True}

    def run(**kw):
        r = c.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=kw.pop("temperature", 0),
                                 logprobs=0, **kw)
        return [int(t.split(":")[1]) for t in r.choices[0].logprobs.tokens], r.choices[0].finish_reason
    plain, _ = run(extra_body=extra)
    bias = {plain[0]: -100, plain[3]: 4.5}
    biased, _ = run(logit_bias={str(t): v for t, v in bias.items()}, extra_body=extra)
    assert biased == _hf_greedy(model, ids, 10, bias=bias) and biased[0] != plain[0]
    k = next(k for k in range(1, 10) if plain[k] not in plain[:k])
    stopped, why = run(extra_body=dict(extra, stop_token_ids=[plain[k]]))
    assert stopped == plain[:k + 1] and why == "stop"
    held, _ = run(extra_body=dict(extra, stop_token_ids=[plain[k]], min_tokens=k + 3))
    assert held == _hf_greedy(model, ids, 10, min_tokens=k + 3, stop=(plain[k],)) and len(held) >= k + 3
    assert plain[k] not in held[:k + 2]
    # a stop string counts once it ends past the first min_tokens tokens' text (vLLM's rule)
    codec = Codec(model, 384)
    text = codec.decode(plain)
    j = next(j for j in range(1, 9) if codec.decode(plain[:j + 1]).strip() != codec.decode(plain[:j]).strip())
    stop = codec.decode(plain[:j + 1])[len(codec.decode(plain[:j])):]
    early = c.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0, stop=[stop], extra_body=extra)
    assert early.choices[0].text == text[:text.find(stop)] and early.choices[0].finish_reason == "stop"
    late = c.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0, stop=[stop],
                                extra_body=dict(extra, min_tokens=j + 2))
    floor = len(codec.decode(plain[:j + 2]))
    at = text.find(stop, max(0, floor - len(stop) + 1))
    assert late.choices[0].text == (text[:at] if at >= 0 else text) and len(late.choices[0].text) > len(early.choices[0].text)
    sampled = [run(temperature=1.5, seed=4, extra_body=dict(extra, min_p=0.3))[0] for _ in range(2)]
    assert sampled[0] == sampled[1] and len(sampled[0]) == 10


def test_stop_strings_over_several_tokens(srv):
    """A stop string written over several tokens, each arriving in a step of its own: found
    across them (the frontend searches only the text added since its last look, keeping a stop
    string's length of it), cut before it or kept with ``include_stop_str_in_output``; streamed,
    the same text, the stop string never sent."""
    from gpu_anchor.serve.tokenizer import Codec
    c, model = client(srv["base"]), srv["model"]
    codec, prompt = Codec(model, 384), "The quick brown fox jumps over"
    kw = dict(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    out = [int(t.split(":")[1]) for t in c.completions.create(
        logprobs=0, **dict(kw, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    ).choices[0].logprobs.tokens]
    text = codec.decode(out)
    a = len(codec.decode(out[:6]))
    stop = text[a:len(codec.decode(out[:10]))]             # four tokens' text, from the seventh token
    assert len(stop) > 3 and text.find(stop) == a
    for keep in (False, True):
        want = text[:a + len(stop)] if keep else text[:a]
        extra = {"ignore_eos": True, "include_stop_str_in_output": keep}
        r = c.completions.create(stop=[stop], **dict(kw, extra_body=extra))
        assert r.choices[0].text == want and r.choices[0].finish_reason == "stop", keep
        chunks = list(c.completions.create(stop=[stop], stream=True, **dict(kw, extra_body=extra)))
        assert "".join(ch.choices[0].text for ch in chunks) == want and chunks[-1].choices[0].finish_reason == "stop"


def test_n_choices(srv):
    """``n`` choices (refused with a 400 before): choice i is the request seeded ``seed + i``,
    so each equals the one-choice request with that seed, streamed or not, and greedy choices are
    alike; usage counts the prompt once and every choice's tokens."""
    c = client(srv["base"])
    extra = {"ignore_eos": True}
    msgs = [{"role": "user", "content": "fox dog"}]
    many = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0.9, seed=21, n=3,
                                     extra_body=extra)
    one = [c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0.9, seed=21 + i,
                                     extra_body=extra) for i in range(3)]
    assert [ch.index for ch in many.choices] == [0, 1, 2]
    assert [ch.message.content for ch in many.choices] == [o.choices[0].message.content for o in one]
    assert len({ch.message.content for ch in many.choices}) > 1
    assert many.usage.prompt_tokens == one[0].usage.prompt_tokens
    assert many.usage.completion_tokens == sum(o.usage.completion_tokens for o in one) == 24
    chunks = list(c.completions.create(model=MODEL, prompt="hello world", max_tokens=6, temperature=0.8, seed=5, n=2,
                                       stream=True, stream_options={"include_usage": True}, extra_body=extra))
    text = {0: "", 1: ""}
    for ch in chunks[:-1]:
        for choice in ch.choices:
            text[choice.index] += choice.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert sum(ch.choices[0].finish_reason == "length" for ch in chunks[:-1]) == 2
    for i in (0, 1):
        assert text[i] == c.completions.create(model=MODEL, prompt="hello world", max_tokens=6, temperature=0.8,
                                               seed=5 + i, extra_body=extra).choices[0].text
    greedy = c.completions.create(model=MODEL, prompt="hello world", max_tokens=6, temperature=0, n=2, extra_body=extra)
    assert greedy.choices[0].text == greedy.choices[1].text
    # stop strings cut each choice on its own, as they cut each one-choice request
    texts = [o.choices[0].message.content for o in one]
    stop = next(t[2:4] for t in texts if len(t) >= 4)
    cut = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0.9, seed=21, n=3, stop=[stop],
                                    extra_body=extra)
    assert [ch.message.content for ch in cut.choices] == [
        c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0.9, seed=21 + i, stop=[stop],
                                  extra_body=extra).choices[0].message.content for i in range(3)]
    assert any(ch.finish_reason == "stop" for ch in cut.choices)


def test_batched_prompts(srv):
    """A completions request with a batch of prompts (text and token ids; refused with a 400
    before): choice ``k * n + i`` is prompt k's choice i, each equal to that prompt's request
    alone, streamed or not, echo included; usage counts each prompt once."""
    from gpu_anchor.serve.tokenizer import Codec
    c, codec = client(srv["base"]), Codec(srv["model"], 384)
    prompts = ["fox dog", codec.encode("hello world numbers"), "the journal"]
    extra = {"ignore_eos": True}
    batch = c.completions.create(model=MODEL, prompt=prompts, max_tokens=5, temperature=0.7, seed=3, n=2, echo=True,
                                 extra_body=extra)
    assert [ch.index for ch in batch.choices] == list(range(6))
    alone = [c.completions.create(model=MODEL, prompt=p, max_tokens=5, temperature=0.7, seed=3, n=2, echo=True,
                                  extra_body=extra) for p in prompts]
    assert [ch.text for ch in batch.choices] == [ch.text for a in alone for ch in a.choices]
    assert batch.choices[0].text.startswith("fox dog") and batch.choices[4].text.startswith("the journal")
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == 30
    chunks = list(c.completions.create(model=MODEL, prompt=prompts, max_tokens=5, temperature=0.7, seed=3, n=2,
                                       stream=True, stream_options={"include_usage": True}, extra_body=extra))
    text = dict.fromkeys(range(6), "")
    for ch in chunks[:-1]:
        text[ch.choices[0].index] += ch.choices[0].text
    assert [text[k] for k in range(6)] == [c.completions.create(model=MODEL, prompt=p, max_tokens=5, temperature=0.7,
                                                                 seed=3 + i, extra_body=extra).choices[0].text
                                           for p in prompts for i in range(2)]
    assert chunks[-1].usage.prompt_tokens == batch.usage.prompt_tokens


def test_tokenize_and_detokenize(srv):
    """vLLM's ``/tokenize`` (a prompt, or chat messages through the server's template: the count a
    chat completion's usage reports) and ``/detokenize``; bad bodies are a 400 naming the field."""
    from gpu_anchor.serve.tokenizer import Codec
    base, codec = srv["base"], Codec(srv["model"], 384)
    status, got = post(base, "/tokenize", {"model": MODEL, "prompt": "hello world", "return_token_strs": True})
    want = codec.encode("hello world", True)
    assert status == 200 and got == {"count": len(want), "max_model_len": 256, "tokens": want,
                                     "token_strs": [codec.token_text(t) for t in want]}
    msgs = [{"role": "user", "content": "fox dog"}]
    status, chat = post(base, "/tokenize", {"messages": msgs})
    used = client(base).chat.completions.create(model=MODEL, messages=msgs, max_tokens=1).usage.prompt_tokens
    assert status == 200 and chat["count"] == used and chat["token_strs"] is None
    assert post(base, "/detokenize", {"model": MODEL, "tokens": want}) == (200, {"prompt": codec.decode(want, False)})
    for path, body, field in [("/tokenize", {"prompt": "x", "messages": msgs}, "prompt"),
                              ("/tokenize", {"prompt": 5}, "prompt"), ("/tokenize", {"text": "x"}, "text"),
                              ("/detokenize", {"tokens": [1, 99999]}, "tokens"), ("/detokenize", {"tokens": "x"}, "tokens")]:
        status, err = post(base, path, body)
        assert status == 400 and err["error"]["param"] == field, (path, body, err)
    assert post(base, "/tokenize", {"model": "gpt-4", "prompt": "x"})[0] == 404


def _hf_prompt_logprobs(model_dir, ids):
    """log-softmax of transformers' forward over ``ids``: row p is the distribution of token p + 1."""
    import torch
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    with torch.no_grad():
        return torch.log_softmax(m(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_echo_with_logprobs_scores_the_prompt_as_transformers_does(srv):
    """``echo`` with ``logprobs`` (refused with a 400 before), as lm-evaluation-harness scores a
    continuation: the prompt's tokens come with their log-probabilities (the first with none)
    and top ones, equal to transformers' forward, over a prompt longer than a step (prefilled in
    chunks); then the output's, their text offsets running on; the same streamed."""
    from gpu_anchor.serve.tokenizer import Codec
    c, model = client(srv["base"]), srv["model"]
    codec = Codec(model, 384)
    prompt = " ".join(["the quick brown fox jumps over the lazy dog"] * 6)
    ids = codec.encode(prompt, True)
    assert len(ids) > 32                             # the server's --max-num-batched-tokens
    r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, logprobs=2, echo=True,
                             extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    lp = r.choices[0].logprobs
    got = [int(t.split(":")[1]) for t in lp.tokens]
    assert got[:len(ids)] == ids and len(got) == len(ids) + 3 and r.choices[0].text.startswith(prompt)
    ref = _hf_prompt_logprobs(model, got)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for k in range(1, len(got)):
        assert abs(lp.token_logprobs[k] - ref[k - 1, got[k]].item()) < 1e-4, k
        top = sorted(lp.top_logprobs[k].items(), key=lambda kv: -kv[1])
        assert [int(t.split(":")[1]) for t, _ in top] == ref[k - 1].topk(2).indices.tolist()
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:k]) for k in range(len(got))]
    chunks = list(c.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, logprobs=2, echo=True,
                                       stream=True, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True}))
    streamed = [x for ch in chunks if ch.choices and ch.choices[0].logprobs for x in
                zip(ch.choices[0].logprobs.tokens, ch.choices[0].logprobs.token_logprobs,
                    ch.choices[0].logprobs.text_offset)]
    assert streamed == list(zip(lp.tokens, lp.token_logprobs, lp.text_offset))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == r.choices[0].text
    # lm-evaluation-harness's loglikelihood request: one token generated, the continuation scored
    context, continuation = "fox dog", " engine block"
    r = c.completions.create(model=MODEL, prompt=context + continuation, max_tokens=1, temperature=0, logprobs=1,
                             echo=True, seed=1234)
    n = len(codec.encode(context + continuation, True)) - len(codec.encode(context, True))
    ref = _hf_prompt_logprobs(model, codec.encode(context + continuation, True))
    whole = codec.encode(context + continuation, True)
    want = sum(ref[k - 1, whole[k]].item() for k in range(len(whole) - n, len(whole)))
    assert abs(sum(r.choices[0].logprobs.token_logprobs[len(whole) - n:len(whole)]) - want) < 1e-4


def _check_prompt_logprobs(got, ref, ids, k, codec):
    """vLLM's ``prompt_logprobs`` list against transformers' log-softmax ``ref`` over ``ids``."""
    assert got[0] is None and len(got) == len(ids)
    for p in range(1, len(ids)):
        row, entry = ref[p - 1], got[p]
        mine = entry[str(ids[p])]
        assert abs(mine["logprob"] - row[ids[p]].item()) < 1e-4, p
        assert mine["rank"] == int((row >= row[ids[p]]).sum()) and mine["decoded_token"] == codec.token_text(ids[p])
        top = row.topk(k)
        assert list(entry)[0] == str(ids[p])          # the prompt's token first, as vLLM lists it
        want = {str(i): r + 1 for r, i in enumerate(top.indices.tolist())}
        assert {t: e["rank"] for t, e in entry.items() if t in want} == want
        assert set(entry) == want.keys() | {str(ids[p])}
        for t, v in zip(top.indices.tolist(), top.values.tolist()):
            assert abs(entry[str(t)]["logprob"] - v) < 1e-4


def test_prompt_logprobs_as_vllm_gives_them(srv):
    """vLLM's ``prompt_logprobs`` (refused with a 400 before): per choice on completions, once per
    request on chat; each prompt token's log-probability, rank and text with the k most likely
    tokens, equal to transformers' forward, over a prompt prefilled in chunks; beside ``echo``
    with a different ``logprobs``; per prompt of a batch; 0 gives the prompt's tokens alone."""
    from gpu_anchor.serve.tokenizer import Codec
    c, model = client(srv["base"]), srv["model"]
    codec = Codec(model, 384)
    prompt = " ".join(["a stitch in time saves nine"] * 6)
    ids = codec.encode(prompt, True)
    assert len(ids) > 32                             # the server's --max-num-batched-tokens
    r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0,
                             extra_body={"prompt_logprobs": 3}).to_dict()
    ref = _hf_prompt_logprobs(model, ids)
    _check_prompt_logprobs(r["choices"][0]["prompt_logprobs"], ref, ids, 3, codec)
    assert r["choices"][0]["logprobs"] is None
    # beside echo + logprobs=1: each keeps its own count
    r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, echo=True, logprobs=1,
                             extra_body={"prompt_logprobs": 4}).to_dict()
    _check_prompt_logprobs(r["choices"][0]["prompt_logprobs"], ref, ids, 4, codec)
    assert all(len(t) == 1 for t in r["choices"][0]["logprobs"]["top_logprobs"][1:])
    # 0: the prompt's own tokens only
    r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body={"prompt_logprobs": 0}).to_dict()
    assert [list(e) for e in r["choices"][0]["prompt_logprobs"][1:]] == [[str(t)] for t in ids[1:]]
    # a batch with n = 2: every choice has its own prompt's
    batch = ["the lazy dog", "over the hill and far away"]
    r = c.completions.create(model=MODEL, prompt=batch, max_tokens=2, n=2, temperature=0.8, seed=5,
                             extra_body={"prompt_logprobs": 2}).to_dict()
    for i, ch in enumerate(r["choices"]):
        b = codec.encode(batch[i // 2], True)
        _check_prompt_logprobs(ch["prompt_logprobs"], _hf_prompt_logprobs(model, b), b, 2, codec)
    # chat: one list, at the top of the reply
    msgs = [{"role": "user", "content": "Hello world! How are you?"}]
    r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2,
                                  extra_body={"prompt_logprobs": 2}).to_dict()
    chat_ids = codec.encode(Codec(model, 384, chat_template=TEMPLATE).chat(msgs))
    _check_prompt_logprobs(r["prompt_logprobs"], _hf_prompt_logprobs(model, chat_ids), chat_ids, 2, codec)
    assert "prompt_logprobs" not in r["choices"][0]


def test_continue_final_message(srv):
    """vLLM's ``continue_final_message`` (refused with a 400 before): the prompt is the chat
    rendered up to the last message's content, as transformers' ``apply_chat_template(...,
    continue_final_message=True)`` renders it, and the reply continues that message: the tokens
    of a completion of that text.  Without ``add_generation_prompt=false`` it is a 400."""
    from transformers import AutoTokenizer
    from gpu_anchor.serve.tokenizer import Codec
    c, model = client(srv["base"]), srv["model"]
    msgs = [{"role": "user", "content": "fox dog"}, {"role": "assistant", "content": "The engine block"}]
    want = AutoTokenizer.from_pretrained(model).apply_chat_template(msgs, chat_template=TEMPLATE, tokenize=False,
                                                                     add_generation_prompt=False,
                                                                     continue_final_message=True)
    assert want.endswith("The engine block")
    ids = Codec(model, 384).encode(want)
    status, tok = post(srv["base"], "/tokenize", {"messages": msgs, "continue_final_message": True,
                                                  "add_generation_prompt": False})
    assert status == 200 and tok["tokens"] == ids
    extra = {"ignore_eos": True, "continue_final_message": True, "add_generation_prompt": False}
    r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0, extra_body=extra)
    plain = c.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens == len(ids) and r.choices[0].message.content == plain.choices[0].text
    status, err = post(srv["base"], CH, dict(M, messages=msgs, continue_final_message=True))
    assert status == 400 and err["error"]["param"] == "continue_final_message"


def test_chat_templates_render_as_transformers_renders_them(srv):
    """What a template may use under transformers' ``apply_chat_template`` renders the same text
    here: ``tojson`` without sorted keys or HTML escapes (tool schemas: Jinja's own filter
    sorted and escaped them), ``{% break %}``, ``{% generation %}`` (both failed to parse),
    ``strftime_now``."""
    from transformers import AutoTokenizer
    from gpu_anchor.serve.tokenizer import Codec
    template = ("{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
                "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
                "{% if m.role == 'assistant' %}{% generation %}<a>{{ m.content }}</a>{% endgeneration %}"
                "{% else %}[{{ m.role }}] {{ m.content }}{% endif %}\n{% endfor %}"
                "{{ strftime_now('%Y') }}{% if add_generation_prompt %}<a>{% endif %}")
    tools = [{"type": "function", "function": {"name": "lookup", "description": "a < b & 'c' caf\u00e9",
                                               "parameters": {"type": "object", "properties": {"z": {}, "a": {}}}}}]
    msgs = [{"role": "user", "content": "fox"}, {"role": "assistant", "content": "dog"},
            {"role": "user", "content": "never rendered: the loop breaks"}]
    want = AutoTokenizer.from_pretrained(srv["model"]).apply_chat_template(msgs, tools=tools, chat_template=template,
                                                                           tokenize=False, add_generation_prompt=True)
    assert '"description": "a < b & \'c\' caf\u00e9"' in want and "never" not in want
    assert Codec(srv["model"], 384, chat_template=template).chat(msgs, tools=tools) == want
    with_tools = "{% for t in tools %}{{ t | tojson }}\n{% endfor %}" + TEMPLATE
    want = AutoTokenizer.from_pretrained(srv["model"]).apply_chat_template(msgs[:1], tools=tools, tokenize=False,
                                                                           chat_template=with_tools,
                                                                           add_generation_prompt=True)
    assert Codec(srv["model"], 384, chat_template=with_tools).chat(msgs[:1], tools=tools) == want


def test_truncate_prompt_tokens(srv):
    """vLLM's ``truncate_prompt_tokens`` (refused with a 400 before): the prompt's last k tokens
    are the request's prompt, for completions and chat alike."""
    from gpu_anchor.serve.tokenizer import Codec
    c, codec = client(srv["base"]), Codec(srv["model"], 384)
    ids = codec.encode("the quick brown fox jumps over the lazy dog and the engine block", True)
    extra = {"ignore_eos": True}
    cut = c.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0,
                               extra_body=dict(extra, truncate_prompt_tokens=4))
    last = c.completions.create(model=MODEL, prompt=ids[-4:], max_tokens=5, temperature=0, extra_body=extra)
    assert cut.usage.prompt_tokens == 4 and cut.choices[0].text == last.choices[0].text
    msgs = [{"role": "user", "content": "fox dog engine block"}]
    chat = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3, extra_body={"truncate_prompt_tokens": 3})
    assert chat.usage.prompt_tokens == 3
    assert post(srv["base"], C, dict(P, truncate_prompt_tokens=0))[1]["error"]["param"] == "truncate_prompt_tokens"


def test_echo(srv):
    c = client(srv["base"])
    kw = dict(model=MODEL, prompt="Hello world! How", max_tokens=5, temperature=0)
    plain = c.completions.create(**kw).choices[0].text
    assert c.completions.create(echo=True, **kw).choices[0].text == "Hello world! How" + plain
    chunks = list(c.completions.create(echo=True, stream=True, **kw))
    assert chunks[0].choices[0].text == "Hello world! How"
    assert "".join(ch.choices[0].text for ch in chunks) == "Hello world! How" + plain


def test_chat_template_from_the_command_line(srv):
    from gpu_anchor.serve.tokenizer import Codec
    codec = Codec(srv["model"], 384)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    r = client(srv["base"]).chat.completions.create(model=MODEL, messages=msgs, max_tokens=2)
    assert r.usage.prompt_tokens == len(codec.encode("[system] Be brief.\n[user] Hello\n[assistant] "))
    status, reply = post(srv["base"], CH, dict(M, messages=msgs, add_generation_prompt=False))
    assert status == 200 and reply["usage"]["prompt_tokens"] == len(codec.encode("[system] Be brief.\n[user] Hello\n"))


# ------------------------------------------------------------------ metrics, loading, ready
def test_metrics_vllm_names(srv):
    base = srv["base"]
    before = scrape(base)
    c = client(base)
    n = [c.completions.create(model=MODEL, prompt="fox " * (i + 1), max_tokens=4 + i, temperature=0,
                              extra_body={"ignore_eos": True}).usage.completion_tokens for i in range(3)]
    deadline = time.time() + 30
    while True:
        m = scrape(base)
        if m["vllm:num_requests_running"] == 0 or time.time() > deadline:
            break
        time.sleep(0.1)

    def d(k):
        return m[k] - before.get(k, 0.0)
    assert d("vllm:time_to_first_token_seconds_count") == 3 and d("vllm:e2e_request_latency_seconds_count") == 3
    assert d("vllm:inter_token_latency_seconds_count") == sum(n) - 3
    assert d("vllm:generation_tokens_total") == sum(n) and d('vllm:request_success_total{finished_reason="length"}') == 3
    assert d("vllm:request_generation_tokens_sum") == sum(n)
    assert d("vllm:request_time_per_output_token_seconds_count") == 3
    assert m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
    assert 0.0 <= m["vllm:kv_cache_usage_perc"] <= 1.0
    assert m["gpu_anchor_serve_engine_up"] == 1 and m["gpu_anchor_serve_engine_loading"] == 0
    assert m['gpu_anchor_serve_last_recovery_seconds{phase="bind_s"}'] >= 0
    # an OpenMetrics scraper gets OpenMetrics
    req = urllib.request.Request(base + "/metrics", headers={"Accept": "application/openmetrics-text"})
    with urllib.request.urlopen(req) as r:
        assert r.headers["Content-Type"].startswith("application/openmetrics-text") and r.read().endswith(b"# EOF\n")


def test_a_hub_id_from_the_local_cache(tmp_path_factory):
    """vLLM's ``serve Qwen/Qwen3-8B``: a Hugging Face Hub id is read from the local cache (here
    one made by hand, offline, so nothing is downloaded), served under the id, its tokenizer
    from the snapshot; ``--revision`` picks another snapshot; an id that is not there is a
    clear error before anything starts (it was "no model directory or config file")."""
    from gpu_anchor.serve.tokenizer import Codec
    h1, h2 = "1" * 40, "2" * 40
    with own_daemon(tmp_path_factory, "hub") as (d, sock):
        repo = d / "hf" / "models--tiny-org--tiny-qwen3"
        make_tiny_model(str(repo / "snapshots" / h1), "qwen3", seed=3)
        make_tiny_model(str(repo / "snapshots" / h2), "qwen3", seed=4)
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(h1)
        (repo / "refs" / "v2").write_text(h2)
        env = dict(os.environ, HF_HUB_CACHE=str(d / "hf"), HF_HUB_OFFLINE="1")
        r = preloaded.run([sys.executable, "-m", "gpu_anchor.serve", "tiny-org/missing", "--socket", sock, *SERVE],
                          env=env, timeout=300, preload=preloaded.HF)
        assert r.returncode == 2 and "not in the local Hugging Face cache" in r.stderr, r.stderr[-2000:]
        assert "hf download tiny-org/missing" in r.stderr
        for rev, h in ((None, h1), ("v2", h2)):
            proc, base, _ = start_server(str(d), "tiny-org/tiny-qwen3", "--socket", sock,
                                         *(("--revision", rev) if rev else ()), env=env)
            try:
                c = client(base, "none")
                assert [m.id for m in c.models.list().data] == ["tiny-org/tiny-qwen3"]
                assert c.models.retrieve("tiny-org/tiny-qwen3").id == "tiny-org/tiny-qwen3"
                snap = str(repo / "snapshots" / h)
                ids = Codec(snap, 384).encode("The quick brown fox")
                out = c.completions.create(model="tiny-org/tiny-qwen3", prompt="The quick brown fox", max_tokens=6,
                                           temperature=0, extra_body={"ignore_eos": True})
                assert out.choices[0].text == Codec(snap, 384).decode(_hf_greedy(snap, ids, 6)), rev
            finally:
                stop_server(proc)


def test_a_mistral_model_served_as_transformers_runs_it(tmp_path_factory):
    """Mistral (7B v0.2 / v0.3, Small): its greedy reply through ``gpu-anchor serve`` and the
    ``openai`` client equals transformers' ``generate``."""
    from gpu_anchor.serve.tokenizer import Codec
    with own_daemon(tmp_path_factory, "mistral") as (d, sock):
        model = make_tiny_model(str(d / "tiny-mistral"), "mistral", seed=6)
        proc, base, _ = start_server(str(d), model, "--socket", sock)
        try:
            ids = Codec(model, 384).encode("The quick brown fox")
            out = client(base, "none").completions.create(model="tiny-mistral", prompt="The quick brown fox",
                                                          max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
            assert out.choices[0].text == Codec(model, 384).decode(_hf_greedy(model, ids, 8))
        finally:
            stop_server(proc)


def test_sampling_defaults_from_the_generation_config(tmp_path_factory):
    """vLLM's ``--generation-config auto`` (its default): a request that leaves a sampling field
    out gets the model's recommendation from ``generation_config.json`` (here temperature 0:
    the reply is transformers' greedy one; max_new_tokens: a chat reply's length), and the
    server says so at start; the file's ``eos_token_id`` ends replies too; ``--generation-config
    vllm`` keeps vLLM's own (temperature 1)."""
    from gpu_anchor.serve.tokenizer import Codec
    with own_daemon(tmp_path_factory, "gencfg") as (d, sock):
        model = make_tiny_model(str(d / MODEL), "qwen3", seed=3)
        path = os.path.join(model, "generation_config.json")
        with open(path) as f:
            cfg = json.load(f)
        prompt, codec = "The quick brown fox", Codec(model, 384)
        greedy_ids = _hf_greedy(model, codec.encode(prompt), 6)
        greedy = codec.decode(greedy_ids)
        k = next(i for i in range(1, 6) if greedy_ids[i] not in greedy_ids[:i] + [cfg["eos_token_id"]])
        with open(path, "w") as f:      # and one more end-of-reply id, as Qwen3's file lists <|endoftext|>
            json.dump(dict(cfg, temperature=0.0, top_k=50, max_new_tokens=5,
                           eos_token_id=[cfg["eos_token_id"], greedy_ids[k]]), f)
        proc, base, log_path = start_server(str(d), model, "--socket", sock)
        try:
            c = client(base, "none")
            r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=6, extra_body={"ignore_eos": True})
            assert r.choices[0].text == greedy
            r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=6)
            assert r.usage.completion_tokens == k + 1 and r.choices[0].finish_reason == "stop"
            ch = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                           extra_body={"ignore_eos": True})
            assert ch.usage.completion_tokens == 5
            with open(log_path) as f:
                assert '{"temperature": 0.0, "max_tokens": 5}' in f.read()      # top_k 50: transformers' default
        finally:
            stop_server(proc)
        proc, base, _ = start_server(str(d), model, "--socket", sock, "--generation-config", "vllm")
        try:
            c = client(base, "none")
            kw = dict(model=MODEL, prompt=prompt, max_tokens=6, seed=7, extra_body={"ignore_eos": True})
            assert c.completions.create(**kw).choices[0].text == \
                c.completions.create(temperature=1.0, **kw).choices[0].text
        finally:
            stop_server(proc)


def test_generation_config_option(tmp_path):
    from gpu_anchor.serve import options
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.95, "top_k": 20,
                                                                 "do_sample": True}))
    assert options.generation_defaults("auto", str(tmp_path)) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert options.generation_defaults("vllm", str(tmp_path)) == {}
    assert options.generation_defaults(str(tmp_path), None)["top_k"] == 20
    assert options.generation_defaults("auto", str(tmp_path / "none")) == {}
    with pytest.raises(options.OptionError, match="no generation_config.json"):
        options.generation_defaults(str(tmp_path / "none"), None)
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    with pytest.raises(options.OptionError, match="temperature = -1 is not a valid default"):
        options.generation_defaults("auto", str(tmp_path))


def test_loading_progress_and_ready_lines(srv):
    text = open(srv["log"]).read()
    assert "loading: mapping the anchored weights and KV cache" in text
    assert "loading: loading weights" in text
    ready = [line for line in text.splitlines() if "ready: tiny-qwen3 at http://127.0.0.1:" in line]
    assert len(ready) == 1 and "s after start; engine built in" in ready[0], text[-3000:]


def test_health_says_what_a_loading_engine_does(tmp_path):
    """The frontend alone, with this test playing an engine that is still loading."""
    from gpu_anchor.serve import wire
    from gpu_anchor.testing.tiny import train_tokenizer
    os.makedirs(tmp_path / "tok")
    train_tokenizer(384, str(tmp_path / "tok" / "tokenizer.json"))
    esock, port_file = str(tmp_path / "e.sock"), str(tmp_path / "port")
    fe = subprocess.Popen([sys.executable, "-m", "gpu_anchor.serve.frontend", "--engine-socket", esock, "--tokenizer",
                           str(tmp_path / "tok"), "--vocab-size", "384", "--model-name", "m", "--port", "0",
                           "--port-file", port_file], stderr=subprocess.DEVNULL)
    try:
        while not os.path.exists(port_file):
            assert fe.poll() is None
            time.sleep(0.05)
        base = f"http://127.0.0.1:{open(port_file).read()}"
        code, body = _get(base + "/health")
        assert code == 503 and json.loads(body)["status"] == "starting"
        s = socket.socket(socket.AF_UNIX)
        s.connect(esock)
        s.sendall(wire.encode({"t": "loading", "pid": 1, "phase": "weights", "done": 3 << 30, "total": 12 << 30,
                               "elapsed_s": 4.5}))

        def health():
            deadline = time.time() + 30
            while True:
                code, body = _get(base + "/health")
                h = json.loads(body)
                if h["status"] != "starting" or time.time() > deadline:
                    return code, h
                time.sleep(0.02)
        code, h = health()
        assert code == 503 and h["status"] == "loading"
        assert h["loading"]["message"] == "loading weights 3.00 GiB of 12.00 GiB (25 %), 4.5 s since the engine started"
        s.sendall(wire.encode({"t": "hello", "pid": 1, "rids": [], "timings": {"init_s": 5.0}, "notes": []}))
        deadline = time.time() + 30
        while _get(base + "/health")[0] != 200:
            assert time.time() < deadline
            time.sleep(0.02)
        s.close()
    finally:
        fe.terminate()
        fe.wait(10)


# ------------------------------------------------------------------ options
def _args(*argv):
    from gpu_anchor.serve.cli import add_arguments
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(["model", *argv])


def test_tensor_parallel_size_option():
    """vLLM's spelling and its short form; what a model cannot be split into is refused in
    tests/test_serve_tp.py (which also runs TP = 2)."""
    from gpu_anchor.serve import options
    for argv in (("--tensor-parallel-size", "1"), ("--tensor-parallel-size", "2"), ("-tp", "2")):
        options.check(_args(*argv))
    assert _args("-tp", "2").tensor_parallel_size == 2
    with pytest.raises(options.OptionError, match="must be >= 1"):
        options.check(_args("--tensor-parallel-size", "0"))


def test_blas_library_option(tmp_path):
    """``--blas-library`` reaches the configuration; ``auto`` (the default) picks cuBLASLt only
    while no decode step can exceed 64 rows (where it measured faster on the H200)."""
    from gpu_anchor.serve.cli import engine_config
    from gpu_anchor.serve.engine import EngineConfig, blas_library
    from gpu_anchor.serve.model_runner import load_config
    model = make_tiny_model(str(tmp_path / "m"), "qwen3", seed=1)
    cfg = {flag: engine_config(_args("--device", "cpu", "--num-blocks", "64", *flag.split()), load_config(model))
           for flag in ("", "--blas-library cublas", "--max-num-seqs 128")}
    cfg = {k: (v.blas_library, blas_library(v)) for k, v in cfg.items()}
    assert cfg == {"": ("auto", "cublaslt"), "--blas-library cublas": ("cublas", "cublas"),
                   "--max-num-seqs 128": ("auto", "cublas")}
    with pytest.raises(ValueError, match="blas_library must be"):
        blas_library(EngineConfig(model=model, blas_library="mkl"))


def test_hot_standby_default():
    """The pre-warmed hot standby is on by default for one GPU with anchoring only; an explicit
    choice is kept, and asking for it where it cannot run is refused."""
    from gpu_anchor.serve import options

    def resolved(device, *argv):
        a = _args(*argv)
        options.check(a)
        options.resolve_standby(a, device)
        return a.hot_standby, a.prewarm
    assert resolved("cuda:0") == (True, True)
    assert resolved("cpu") == (False, False)
    assert resolved("cuda:0", "--tensor-parallel-size", "2") == (False, False)
    assert resolved("cuda:0", "--no-anchor") == (False, False)
    assert resolved("cuda:0", "--no-hot-standby") == (False, False)
    assert resolved("cuda:0", "--no-prewarm") == (True, False)
    assert resolved("cuda:0", "--prewarm", "--no-hot-standby") == (False, True)
    assert resolved("cpu", "--hot-standby") == (True, True)
    for argv in (("--hot-standby", "--tensor-parallel-size", "2"), ("--hot-standby", "--no-anchor")):
        with pytest.raises(options.OptionError):
            options.check(_args(*argv))


def test_max_batched_tokens_alias(caplog):
    from gpu_anchor.serve import options
    a = _args("--max-batched-tokens", "48")
    options.check(a)
    assert a.max_num_batched_tokens == 48 and "deprecated" in caplog.text
    a = _args("--max-num-batched-tokens", "64")
    options.check(a)
    assert a.max_num_batched_tokens == 64
    with pytest.raises(options.OptionError, match="disagree"):
        options.check(_args("--max-batched-tokens", "48", "--max-num-batched-tokens", "64"))
    options.check(a := _args())
    assert a.max_num_batched_tokens == 2048


def test_kv_cache_sizing(tmp_path):
    from gpu_anchor.serve import options
    from gpu_anchor.serve.model_runner import load_config, meta_model
    from gpu_anchor.testing.tiny import tiny_config
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(tiny_config("qwen3")))
    mc = load_config(str(cfg))
    per_block = 2 * 2 * 16 * 2 * 16 * 4          # K and V, 2 layers, 16 tokens, 2 KV heads, head_dim 16, fp32

    def blocks(*argv):
        a = _args(*argv)
        options.check(a)
        return options.kv_cache_blocks(a, mc, "cpu", "float32")
    assert blocks() == (1 << 30) // per_block                     # the CPU default: 1 GiB
    assert blocks("--kv-cache-gib", "0.5") == (1 << 29) // per_block
    assert blocks("--num-blocks", "77") == 77
    total, _ = options.device_memory("cpu")
    weights = sum(p.numel() for p in meta_model(mc).parameters()) * 4
    act = options.activation_bytes(mc, 2048, 64, 4)
    assert blocks("--gpu-memory-utilization", "0.01") == int((int(0.01 * total) - weights - act) // per_block)
    # a standby's pre-warm runs a scratch engine beside the live one: its estimated peak is reserved
    from gpu_anchor.serve.prewarm import peak_bytes
    scratch = peak_bytes(mc, 16, 64, 2048, 4)
    assert scratch > 0
    assert blocks("--gpu-memory-utilization", "0.01", "--prewarm") == int(
        (int(0.01 * total) - weights - act - scratch) // per_block)
    with pytest.raises(options.OptionError, match="one sequence of --max-model-len") as e:
        blocks("--gpu-memory-utilization", "1e-9")
    assert "--no-prewarm" not in str(e.value)
    # where only the pre-warm's reserve leaves too little, the error names the way out
    need = -(-_args().max_model_len // 16) * per_block
    tight = f"{(weights + act + need + scratch // 2) / total:.12f}"
    assert blocks("--gpu-memory-utilization", tight) >= need // per_block
    with pytest.raises(options.OptionError, match="give --no-prewarm"):
        blocks("--gpu-memory-utilization", tight, "--prewarm")
    with pytest.raises(options.OptionError, match="one way to size"):
        blocks("--gpu-memory-utilization", "0.5", "--kv-cache-gib", "1")
    with pytest.raises(options.OptionError, match=r"\(0, 1\]"):
        blocks("--gpu-memory-utilization", "1.5")


def test_cuda_kernel_shapes_refused_at_start_up(tmp_path):
    """What the CUDA attention kernel cannot tile is refused by the options, naming the flag,
    before any engine starts (an engine failing at its first step is a crash loop to the
    supervisor).  CPU serves any block size."""
    from gpu_anchor.serve import options
    from gpu_anchor.serve.model_runner import load_config
    from gpu_anchor.testing.tiny import tiny_config
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(tiny_config("qwen3")))
    mc = load_config(str(cfg))
    for bs in (6, 24):
        with pytest.raises(options.OptionError, match=f"--block-size {bs} on cuda:0"):
            options.check_kernel_shapes(_args("--block-size", str(bs)), mc, "cuda:0")
        options.check_kernel_shapes(_args("--block-size", str(bs)), mc, "cpu")
    for bs in (4, 16, 32):
        options.check_kernel_shapes(_args("--block-size", str(bs)), mc, "cuda:0")
    cfg.write_text(json.dumps(dict(tiny_config("qwen3"), head_dim=24)))
    with pytest.raises(options.OptionError, match="head_dim 24"):
        options.check_kernel_shapes(_args(), load_config(str(cfg)), "cuda:0")


def test_chat_template_option(tmp_path):
    from gpu_anchor.serve import options
    f = tmp_path / "t.jinja"
    f.write_text(TEMPLATE)
    assert options.chat_template_file(str(f), str(tmp_path)) == str(f)
    inline = options.chat_template_file(TEMPLATE, str(tmp_path))
    assert open(inline).read() == TEMPLATE
    with pytest.raises(options.OptionError, match="no such file"):
        options.chat_template_file(str(tmp_path / "missing.jinja"), str(tmp_path))
    with pytest.raises(options.OptionError, match="does not parse"):
        options.chat_template_file("{% for m in messages %}", str(tmp_path))
    assert options.chat_template_file(None, str(tmp_path)) is None


def test_tool_call_and_reasoning_options():
    """vLLM's pair: --enable-auto-tool-choice needs --tool-call-parser, and the parser must be one
    this server has; so must --reasoning-parser (the server itself: tests/test_serve_tool_calls.py)."""
    from gpu_anchor.serve import options
    options.check(_args("--enable-auto-tool-choice", "--tool-call-parser", "hermes"))
    options.check(_args("--tool-call-parser", "hermes"))
    with pytest.raises(options.OptionError, match="needs --tool-call-parser"):
        options.check(_args("--enable-auto-tool-choice"))
    for parser in ("llama3_json", "pythonic", "mistral"):
        options.check(_args("--enable-auto-tool-choice", "--tool-call-parser", parser))
    with pytest.raises(options.OptionError, match="this server has hermes, llama3_json, pythonic, mistral"):
        options.check(_args("--enable-auto-tool-choice", "--tool-call-parser", "granite"))
    options.check(_args("--reasoning-parser", "deepseek_r1"))
    with pytest.raises(options.OptionError, match="this server has qwen3, deepseek_r1"):
        options.check(_args("--reasoning-parser", "granite"))


def _attached_hot_standby() -> dict | None:
    from gpu_anchor.launch import jobstate
    for job in jobstate.load_all():
        sb = (job.get("standbys") or {}).get("0")
        if sb and sb.get("hot"):
            return sb
    return None


@pytest.mark.gpu
@pytest.mark.parametrize("standby", [["--no-hot-standby"], []], ids=["engine", "hot-standby-default"])
def test_gpu_memory_utilization_default_on_cuda(tmp_path, cuda_daemon, standby):
    """On a GPU with no KV size given, the KV cache takes what vLLM's default 0.9 of the
    device leaves after the weights and the activation estimate, and the whole server (daemon
    allocations + engine) stays within that 0.9 after a full-width batch has run, with the
    default pre-warmed hot standby attached (its pre-warm's peak is reserved by the sizing, its
    context, graphs and activations by the fixed part) and without one."""
    import threading

    import pynvml

    from bench.serve_throughput import QWEN3_8B
    from gpu_anchor.testing.tiny import train_tokenizer
    cfg = dict(QWEN3_8B, num_hidden_layers=4)          # Qwen3-8B widths, 4 layers
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    os.makedirs(tmp_path / "tok")
    train_tokenizer(384, str(tmp_path / "tok" / "tokenizer.json"))
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(int(os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or 0))
    total, used_before = pynvml.nvmlDeviceGetMemoryInfo(h).total, pynvml.nvmlDeviceGetMemoryInfo(h).used
    port_file, log_path = tmp_path / "port", tmp_path / "serve.log"
    proc = preloaded.Popen([sys.executable, "-m", "gpu_anchor.serve", str(tmp_path / "config.json"), "--random-weights",
                            "--tokenizer", str(tmp_path / "tok"), "--device", "cuda:0", "--socket", cuda_daemon[0],
                            "--port", "0", "--port-file", str(port_file), "--max-num-seqs", "64", *standby],
                           stdout=subprocess.DEVNULL, stderr=open(log_path, "ab"), preload=preloaded.HF)
    try:
        deadline = time.time() + 600
        while not port_file.exists() or _get(f"http://127.0.0.1:{port_file.read_text()}/health")[0] != 200:
            assert proc.poll() is None and time.time() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.2)
        base = f"http://127.0.0.1:{port_file.read_text()}"
        text = log_path.read_text()
        assert "from --gpu-memory-utilization 0.9 of" in text, text[-3000:]
        while not standby and _attached_hot_standby() is None:
            assert proc.poll() is None and time.time() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.2)
        c = client(base, key="unused")
        outs = [None] * 64

        def run(i):
            outs[i] = c.completions.create(model="config.json", prompt="hello world " * 40, max_tokens=32,
                                           temperature=0, logprobs=1, extra_body={"ignore_eos": True})
        threads = [threading.Thread(target=run, args=(i,)) for i in range(64)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(o.usage.completion_tokens == 32 for o in outs)
        used = pynvml.nvmlDeviceGetMemoryInfo(h).used - used_before
        sb = _attached_hot_standby()
        assert (sb is None) == bool(standby), sb
        print(f"device in use after the batch: {used / total:.4f} of {total / 2**30:.1f} GiB; hot standby: {sb}")
        assert 0.8 * total < used <= 0.9 * total, (used / total, sb, log_path.read_text()[-2000:])
    finally:
        stop_server(proc)

