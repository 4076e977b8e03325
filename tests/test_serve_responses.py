"""OpenAI's Responses API (``POST /v1/responses``) through the stock ``openai`` client against a
real server on the CPU: an agent loop (a function call, its output sent back, the answer) with
the reasoning apart, streamed through the SDK's own event accumulator and not; structured
output with ``responses.parse`` and a pydantic model; ``max_output_tokens`` (status
``incomplete``); a stream across an engine SIGKILL equal to the fault-free one; and the fields
it refuses, each a 400 naming the Responses field.
"""
from __future__ import annotations

import json

import pytest

pytest.importorskip("llguidance",
                    reason="structured output needs llguidance (gpu-anchor[serve]; make test installs it)")

from test_serve_structured import COLORS, model_dir, so_srv  # noqa: E402
from test_serve_tool_calls import ANSWER, ASK, ASK_THINK, RESULT, THOUGHT, TOOLS, tool_srv  # noqa: E402

FIXTURES = (model_dir, so_srv, tool_srv)       # the servers of those modules, started again for this one

FLAT = [{"type": "function", **t["function"]} for t in TOOLS]      # the Responses API's tools are flat


def _client(base):
    import openai
    return openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)


def _items(output) -> list:
    """A Response's output, without its ids (each request has its own)."""
    out = []
    for it in output:
        if it.type == "message":
            out.append(("message", "".join(c.text for c in it.content)))
        elif it.type == "reasoning":
            out.append(("reasoning", "".join(c.text for c in it.content or ())))
        else:
            out.append(("function_call", it.name, json.loads(it.arguments)))
    return out


def test_an_agent_loop_through_the_responses_api(tool_srv):
    c = _client(tool_srv["base"])
    r = c.responses.create(model="tiny-qwen3", input=ASK[0]["content"], tools=FLAT, temperature=0)
    assert r.status == "completed" and _items(r.output) == [("function_call", "get_weather", {"city": "Paris"})]
    call = r.output[0]
    with c.responses.stream(model="tiny-qwen3", input=ASK[0]["content"], tools=FLAT, temperature=0) as s:
        streamed = s.get_final_response()
    assert _items(streamed.output) == _items(r.output)
    follow = [{"role": "user", "content": ASK[0]["content"]}, call.model_dump(exclude_none=True),
              {"type": "function_call_output", "call_id": call.call_id, "output": RESULT}]
    answer = c.responses.create(model="tiny-qwen3", input=follow, tools=FLAT, temperature=0)
    assert answer.output_text == ANSWER and answer.usage.output_tokens > 0
    assert answer.usage.total_tokens == answer.usage.input_tokens + answer.usage.output_tokens
    thought = c.responses.create(model="tiny-qwen3", input=ASK_THINK[0]["content"], tools=FLAT, temperature=0)
    assert _items(thought.output) == [("reasoning", THOUGHT), ("function_call", "get_weather", {"city": "Paris"})]
    kinds = [e.type for e in c.responses.create(model="tiny-qwen3", input=ASK_THINK[0]["content"], tools=FLAT,
                                                temperature=0, stream=True)]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.reasoning_text.delta" in kinds and "response.function_call_arguments.done" in kinds


def test_structured_output_and_a_cut_reply(so_srv):
    from typing import Literal

    from pydantic import BaseModel

    class Colors(BaseModel):
        ok: bool
        color: Literal["red", "green", "blue"]
    c = _client(so_srv["base"])
    r = c.responses.parse(model="tiny-qwen3", input="Which color?", text_format=Colors, temperature=1.0,
                          max_output_tokens=300, extra_body={"seed": 2})
    assert r.status == "completed" and isinstance(r.output_parsed, Colors)
    cut = c.responses.create(model="tiny-qwen3", input="Tell me.", max_output_tokens=5, temperature=1.0,
                             extra_body={"seed": 1})
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 5
    with c.responses.stream(model="tiny-qwen3", input="Which color?", temperature=1.0, max_output_tokens=300,
                            text={"format": {"type": "json_schema", "name": "c", "schema": COLORS}},
                            extra_body={"seed": 2}) as s:
        text = s.get_final_response().output_text
    assert Colors.model_validate_json(text)


@pytest.mark.parametrize("body,field", [
    ({"input": "x", "store": "yes"}, "store"),
    ({"input": "x", "previous_response_id": 1}, "previous_response_id"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": []}, "input"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "objec"}}}},
     "text.format.json_schema.schema"),
    ({"input": "x", "foo": 1}, "foo"),
])
def test_refused_fields_name_the_responses_field(so_srv, body, field):
    from test_serve_api import post
    status, reply = post(so_srv["base"], "/v1/responses", dict(body, model="tiny-qwen3"))
    assert status == 400 and reply["error"]["param"] == field, reply


def test_responses_stream_across_an_engine_sigkill(so_srv):
    from test_serve_http import stream_across_engine_kill
    c, base = _client(so_srv["base"]), so_srv["base"]
    kw = dict(model="tiny-qwen3", input="Write on.", max_output_tokens=300, temperature=0.8, stream=True,
              extra_body={"seed": 9})

    def text(events):
        return "".join(e.delta for e in events if e.type == "response.output_text.delta")
    ref = list(c.responses.create(**kw))
    assert ref[-1].type == "response.incomplete" and ref[-1].response.output_text == text(ref)
    got = stream_across_engine_kill(base, lambda: c.responses.create(**kw), after=8)
    assert text(got) == text(ref) and got[-1].response.output_text == text(ref)
    assert [e.sequence_number for e in got] == list(range(len(got)))
    # stored by the frontend, which the kill did not touch: read back whole
    assert c.responses.retrieve(got[-1].response.id).output_text == text(ref)


def test_stored_responses_are_continued_by_previous_response_id(tool_srv):
    """``store`` (true by default, as in OpenAI's API): the agent loop continued by
    ``previous_response_id`` with only the tool's output as input reaches the same answer from
    the same prompt as the loop that sends the whole conversation; ``retrieve`` and ``delete``
    through the ``openai`` client; a response not stored, or deleted, is a 404 naming it."""
    import openai
    c = _client(tool_srv["base"])
    r = c.responses.create(model="tiny-qwen3", input=ASK[0]["content"], tools=FLAT, temperature=0)
    assert r.store and _items(r.output) == [("function_call", "get_weather", {"city": "Paris"})]
    result = {"type": "function_call_output", "call_id": r.output[0].call_id, "output": RESULT}
    answer = c.responses.create(model="tiny-qwen3", previous_response_id=r.id, input=[result], tools=FLAT,
                                temperature=0)
    whole = c.responses.create(model="tiny-qwen3", tools=FLAT, temperature=0, input=[
        {"role": "user", "content": ASK[0]["content"]}, r.output[0].model_dump(exclude_none=True), result])
    assert answer.output_text == whole.output_text == ANSWER and answer.previous_response_id == r.id
    assert answer.usage.input_tokens == whole.usage.input_tokens         # the same prompt
    assert c.responses.retrieve(r.id).model_dump() == r.model_dump()
    with c.responses.stream(model="tiny-qwen3", previous_response_id=r.id, input=[result], tools=FLAT,
                            temperature=0) as s:
        streamed = s.get_final_response()
    assert streamed.output_text == ANSWER and c.responses.retrieve(streamed.id).output_text == ANSWER
    kept = c.responses.create(model="tiny-qwen3", input=ASK[0]["content"], tools=FLAT, temperature=0, store=False)
    assert not kept.store
    with pytest.raises(openai.NotFoundError, match=f"Response with id '{kept.id}' not found"):
        c.responses.retrieve(kept.id)
    c.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError, match=f"Response with id '{r.id}' not found"):
        c.responses.create(model="tiny-qwen3", previous_response_id=r.id, input=[result], tools=FLAT)


def test_an_openai_agents_sdk_agent_runs_its_tool_loop(tool_srv):
    """The OpenAI Agents SDK (``openai-agents``) as its users run it against a vLLM server: an
    ``Agent`` with a function tool on ``OpenAIResponsesModel``; ``Runner`` calls the model, runs
    the tool the model called, sends its output back and ends with the model's answer; and a
    second run continues the first by ``previous_response_id`` (the server's stored conversation)."""
    agents = pytest.importorskip("agents", reason="the OpenAI Agents SDK (openai-agents, a test extra: make test "
                                                  "installs it) is the user code this test runs")
    import asyncio

    import openai
    ran = []

    async def get_weather(ctx, args: str) -> str:
        ran.append(json.loads(args))
        return RESULT
    tool = agents.FunctionTool(name="get_weather", description=TOOLS[0]["function"]["description"],
                               params_json_schema=TOOLS[0]["function"]["parameters"], on_invoke_tool=get_weather,
                               strict_json_schema=False)
    client = openai.AsyncOpenAI(base_url=tool_srv["base"] + "/v1", api_key="none", max_retries=0)
    agent = agents.Agent(name="weather", tools=[tool], model_settings=agents.ModelSettings(temperature=0),
                         model=agents.OpenAIResponsesModel(model="tiny-qwen3", openai_client=client))
    agents.set_tracing_disabled(True)

    async def both():         # one event loop: the async client belongs to it
        result = await agents.Runner.run(agent, ASK[0]["content"])
        run = agents.Runner.run_streamed(agent, ASK[0]["content"])
        kinds = [e.type async for e in run.stream_events()]
        # the conversation kept by the server: the second run sends its new input only
        again = await agents.Runner.run(agent, ASK[0]["content"], previous_response_id=result.last_response_id)
        return result, run.final_output, kinds, again
    first, streamed, kinds, again = asyncio.run(both())
    assert first.final_output == streamed == ANSWER and ran[:2] == [{"city": "Paris"}] * 2
    assert "raw_response_event" in kinds
    c = _client(tool_srv["base"])
    stored = [c.responses.retrieve(r.response_id) for r in again.raw_responses]
    assert first.final_output == ANSWER and stored[0].previous_response_id == first.last_response_id
    # the continued run's first prompt holds the whole first run before its own question
    assert stored[0].usage.input_tokens > c.responses.retrieve(first.last_response_id).usage.input_tokens
