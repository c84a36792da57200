"""Client libraries, through their own code and defaults: Anthropic's SDK (the Messages API),
the OpenAI Agents SDK with both of its models, langchain-openai and pydantic-ai. The model
has random weights, so what the tests hold is the protocol (shapes, stop reasons, tool calls
forced by their grammar), not the text."""

from __future__ import annotations

import asyncio
import json
from typing import Annotated

import anthropic
import jsonschema
import pytest
from pydantic import Field

from tests.e2e.test_http_api import APP

WEATHER = {"name": "get_weather", "description": "Current weather",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                            "required": ["city"]}}


@pytest.fixture(scope="module")
def base(deploy) -> str:
    return deploy(APP)


@pytest.fixture(scope="module")
def claude(base) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base, api_key="none", max_retries=0, timeout=120)


def test_anthropic_sdk_message_and_stream(claude):
    msg = claude.messages.create(model="claude-sonnet-4-5", max_tokens=6, system="Be brief.",
                                 messages=[{"role": "user", "content": "hi"}], stop_sequences=["\n\n\n"])
    assert msg.type == "message" and msg.role == "assistant" and msg.content[0].type == "text"
    assert msg.stop_reason in ("end_turn", "max_tokens", "stop_sequence") and msg.usage.output_tokens >= 1
    with claude.messages.stream(model="claude-sonnet-4-5", max_tokens=6,
                                messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}]) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert final.content[0].text == text and final.stop_reason in ("end_turn", "max_tokens")
    n = claude.messages.count_tokens(model="claude-sonnet-4-5", messages=[{"role": "user", "content": "hi"}])
    assert n.input_tokens > 1


def test_anthropic_sdk_forced_tool_use_and_its_result(claude):
    msgs = [{"role": "user", "content": "Weather in Oslo?"}]
    msg = claude.messages.create(model="claude-sonnet-4-5", max_tokens=200, tools=[WEATHER],
                                 tool_choice={"type": "tool", "name": "get_weather"}, messages=msgs)
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert msg.stop_reason == "tool_use" and len(uses) == 1 and uses[0].name == "get_weather", msg
    jsonschema.validate(uses[0].input, WEATHER["input_schema"])
    # streamed: the tool_use block arrives whole, as input_json_delta
    with claude.messages.stream(model="claude-sonnet-4-5", max_tokens=200, tools=[WEATHER],
                                tool_choice={"type": "any"}, messages=msgs) as s:
        final = s.get_final_message()
    assert final.stop_reason == "tool_use" and any(b.type == "tool_use" for b in final.content)
    # the result goes back; tool_choice none answers in text
    follow = claude.messages.create(model="claude-sonnet-4-5", max_tokens=6, tools=[WEATHER],
                                    tool_choice={"type": "none"}, messages=[
        *msgs, {"role": "assistant", "content": [{"type": "tool_use", "id": uses[0].id, "name": "get_weather",
                                                  "input": uses[0].input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "sunny"}]}])
    assert follow.content[0].type == "text" and follow.stop_reason != "tool_use"


def test_anthropic_sdk_structured_output_with_messages_parse(claude):
    """messages.parse sends output_config.format (a JSON schema): the text answer matches it."""
    from typing import Literal

    from pydantic import BaseModel

    class Pick(BaseModel):  # an enum: the SDK moves string bounds into the description, enums it keeps
        color: Literal["red", "green", "blue"]
        sure: bool

    msg = claude.messages.parse(model="claude-sonnet-4-5", max_tokens=200, output_format=Pick,
                                messages=[{"role": "user", "content": "Pick a color."}])
    assert isinstance(msg.parsed_output, Pick), msg
    assert msg.stop_reason == "end_turn"


def test_anthropic_sdk_refusals_are_its_errors(claude):
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": [image]}])
    assert e.value.body["error"]["type"] == "invalid_request_error" and "image" in e.value.body["error"]["message"]


def test_openai_agents_sdk_with_both_of_its_models(base):
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI
    from pydantic import BaseModel, Field

    class City(BaseModel):  # a bounded output: random weights end it only because its grammar does
        name: str = Field(max_length=12)

    set_tracing_disabled(True)  # its default exports traces to OpenAI

    async def main() -> None:  # one event loop: the client's connections belong to it
        client = AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        for model in (OpenAIResponsesModel("gpt-4.1", client), OpenAIChatCompletionsModel("gpt-4.1", client)):
            agent = Agent(name="brief", instructions="Name a city.", model=model, output_type=City,
                          model_settings=ModelSettings(max_tokens=200))
            result = await Runner.run(agent, "hi")
            assert isinstance(result.final_output, City), (type(model).__name__, result)
        # plain text through the chat model (a length-cut answer is an answer there)
        agent = Agent(name="brief", model=OpenAIChatCompletionsModel("gpt-4.1", client),
                      model_settings=ModelSettings(max_tokens=6))
        assert isinstance((await Runner.run(agent, "hi")).final_output, str)

    asyncio.run(main())


def test_langchain_openai_at_its_default_model(base):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=base + "/v1", api_key="none", max_tokens=6, max_retries=0)  # model: its default
    assert isinstance(llm.invoke("hi").content, str)
    assert "".join(c.content for c in llm.stream("hi")) is not None
    bound = llm.bind_tools([{"type": "function", "function": {"name": WEATHER["name"],
                                                              "parameters": WEATHER["input_schema"]}}],
                           tool_choice="get_weather")
    call = ChatOpenAI(base_url=base + "/v1", api_key="none", max_tokens=200, max_retries=0).bind_tools(
        bound.kwargs["tools"], tool_choice="get_weather").invoke("Weather in Oslo?")
    assert call.tool_calls and call.tool_calls[0]["name"] == "get_weather"
    jsonschema.validate(call.tool_calls[0]["args"], WEATHER["input_schema"])


def test_pydantic_ai_structured_output(base):
    from pydantic import BaseModel, Field
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    class City(BaseModel):
        name: str = Field(max_length=12)

    model = OpenAIChatModel("gpt-4o-mini", provider=OpenAIProvider(base_url=base + "/v1", api_key="none"))
    agent = Agent(model, output_type=City, model_settings={"max_tokens": 200})
    out = agent.run_sync("Name a city.").output
    assert isinstance(out, City)
    json.dumps(out.model_dump())


def test_embeddings_off_is_a_501_that_says_what_to_set(base):
    import httpx

    r = httpx.post(base + "/v1/embeddings", json={"input": "x"}, timeout=60)
    assert r.status_code == 501 and "embeddings: true" in r.json()["error"]["message"]


def test_openai_agents_sdks_default_model_runs_a_tool_loop(base):
    """The Responses API with tools, as the Agents SDK's default model drives it: a forced call
    (its function_call item, streamed and whole), the tool's result sent back as a
    function_call_output item with the whole input, then the final answer."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI
    from pydantic import BaseModel

    class City(BaseModel):
        name: str = Field(max_length=12)

    calls: list[str] = []

    @function_tool
    def get_weather(city: Annotated[str, Field(max_length=12)]) -> str:  # bounded: random weights end it so
        """Current weather of a city."""
        calls.append(city)
        return "sunny"

    set_tracing_disabled(True)

    async def main() -> None:
        client = AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        agent = Agent(name="weather", instructions="Use the tool.", tools=[get_weather], output_type=City,
                      model=OpenAIResponsesModel("gpt-4.1", client),
                      model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=400,
                                                   temperature=0))  # greedy: the same loop every run
        for streamed in (False, True):
            calls.clear()
            if streamed:
                run = Runner.run_streamed(agent, "weather?")
                async for _ in run.stream_events():
                    pass
                result = run
            else:
                result = await Runner.run(agent, "weather?")
            assert len(calls) == 1 and isinstance(calls[0], str), (streamed, calls)
            assert isinstance(result.final_output, City), (streamed, result.final_output)
            kinds = [type(i).__name__ for i in result.new_items]
            assert kinds[:2] == ["ToolCallItem", "ToolCallOutputItem"], kinds

    asyncio.run(main())
