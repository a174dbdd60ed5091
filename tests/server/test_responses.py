"""POST /v1/responses through the real openai SDK against a real server on a tiny random model:
the SDK's own types check every shape, and the answers equal the chat completions of the same
conversation."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
from typing import Annotated

import httpx
import jsonschema
import openai
import pytest
from live_server import API_KEY, MODEL_NAME, make_engine, serving
from openai.types.responses import Response, ResponseFunctionToolCall, ResponseOutputMessage
from pydantic import BaseModel, Field
from serve_process import astrai_serve
from tiny_models import real_gguf

from astrai.server.errors import APIError
from astrai.server.responses_api import ResponseStore

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(llama_dir):
    """The tiny model with room for the tool definitions astrai writes into its prompt."""
    engine = make_engine(llama_dir, max_seq_len=1024)
    with serving(engine) as server:
        yield server


@pytest.fixture(scope="module")
def openai_client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)


def chat_text(openai_client, server, messages, **kwargs) -> tuple[str, int]:
    reply = openai_client.chat.completions.create(
        model=server.model_name, messages=messages, temperature=0, **kwargs
    )
    return reply.choices[0].message.content, reply.usage.prompt_tokens


def test_a_response_is_the_chat_completion_of_its_input(openai_client, server):
    response = openai_client.responses.create(
        model=server.model_name,
        instructions="Be brief.",
        input="Hello world!",
        max_output_tokens=8,
        temperature=0,
    )
    assert isinstance(response, Response)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello world!"},
    ]
    text, prompt_tokens = chat_text(openai_client, server, messages, max_tokens=8)
    assert response.output_text == text
    [message] = response.output
    assert isinstance(message, ResponseOutputMessage) and message.role == "assistant"
    assert response.status == ("incomplete" if response.usage.output_tokens == 8 else "completed")
    if response.status == "incomplete":
        assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.input_tokens == prompt_tokens
    assert response.usage.total_tokens == prompt_tokens + response.usage.output_tokens
    assert response.usage.input_tokens_details.cached_tokens >= 0
    assert response.instructions == "Be brief." and response.max_output_tokens == 8


def test_a_streamed_response_sends_the_typed_events_in_order(openai_client, server):
    kwargs = dict(model=server.model_name, input="Tell me a story.", max_output_tokens=10)
    kwargs["temperature"] = 0
    whole = openai_client.responses.create(**kwargs)
    events = list(openai_client.responses.create(stream=True, **kwargs))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 1
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        f"response.{whole.status}",
    ]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == (
        whole.output_text
    )
    final = events[-1].response
    assert final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert events[0].response.status == "in_progress" and events[0].response.id == final.id
    item_id = events[2].item.id
    assert {e.item_id for e in events[3:-2] if hasattr(e, "item_id")} == {item_id}
    assert events[-2].item == final.output[0]


def test_a_function_tool_round_trip(openai_client, server):
    kwargs = dict(model=server.model_name, tools=[WEATHER], max_output_tokens=150, temperature=0)
    first_input = [{"role": "user", "content": "What is the weather in Paris?"}]
    called = openai_client.responses.create(
        input=first_input, tool_choice="required", parallel_tool_calls=False, **kwargs
    )
    [call] = called.output
    assert isinstance(call, ResponseFunctionToolCall) and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    assert called.status == "completed" and call.status == "completed"
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}
    sent_back = first_input + [call.model_dump(exclude_none=True), result]
    answer = openai_client.responses.create(input=sent_back, tool_choice="none", **kwargs)
    assert [item.type for item in answer.output] == ["message"]
    # The same conversation as chat messages gives the same answer.
    messages = first_input + [
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C"},
    ]
    text, prompt_tokens = chat_text(
        openai_client,
        server,
        messages,
        max_tokens=150,
        tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}],
        tool_choice="none",
    )
    assert answer.output_text == text and answer.usage.input_tokens == prompt_tokens
    # previous_response_id stands for the whole conversation before it.
    chained = openai_client.responses.create(
        previous_response_id=called.id, input=[result], tool_choice="none", **kwargs
    )
    assert chained.output_text == answer.output_text
    assert chained.usage.input_tokens == answer.usage.input_tokens
    assert chained.previous_response_id == called.id


def test_a_streamed_function_call(openai_client, server):
    events = list(
        openai_client.responses.create(
            model=server.model_name,
            input="Weather in Rome?",
            tools=[WEATHER],
            tool_choice={"type": "function", "name": "get_weather"},
            max_output_tokens=150,
            temperature=0,
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) == len(kinds) - 6
    arguments = events[-3].arguments
    assert "".join(deltas) == arguments
    jsonschema.validate(json.loads(arguments), WEATHER["parameters"])
    [call] = events[-1].response.output
    assert call.arguments == arguments and call.name == "get_weather"
    assert events[2].item.arguments == "" and events[2].item.status == "in_progress"


def test_text_format_json_schema(openai_client, server):
    text_format = {"type": "json_schema", "name": "person", "schema": SCHEMA, "strict": True}
    response = openai_client.responses.create(
        model=server.model_name,
        input="Describe a person.",
        text={"format": text_format},
        max_output_tokens=150,
        temperature=0,
    )
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), SCHEMA)
    assert response.text.format.type == "json_schema"
    anything = openai_client.responses.create(
        model=server.model_name,
        input="Describe a person.",
        text={"format": {"type": "json_object"}},
        max_output_tokens=150,
        temperature=0,
    )
    assert isinstance(json.loads(anything.output_text), dict)


def test_stored_responses_are_retrieved_chained_and_deleted(openai_client, server):
    kwargs = dict(model=server.model_name, max_output_tokens=4, temperature=0)
    first = openai_client.responses.create(input="Hello", **kwargs)
    assert openai_client.responses.retrieve(first.id) == first
    second = openai_client.responses.create(input="Again", previous_response_id=first.id, **kwargs)
    explicit = openai_client.responses.create(
        input=[
            {"role": "user", "content": "Hello"},
            first.output[0].model_dump(exclude_none=True),
            {"role": "user", "content": "Again"},
        ],
        **kwargs,
    )
    assert second.usage.input_tokens == explicit.usage.input_tokens
    assert second.output_text == explicit.output_text
    unstored = openai_client.responses.create(input="Hello", store=False, **kwargs)
    for missing in (unstored.id, "resp_unknown"):
        with pytest.raises(openai.NotFoundError) as caught:
            openai_client.responses.retrieve(missing)
        assert missing in caught.value.message
        with pytest.raises(openai.NotFoundError) as caught:
            openai_client.responses.create(input="Hi", previous_response_id=missing, **kwargs)
        assert caught.value.body["param"] == "previous_response_id"
    openai_client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        openai_client.responses.retrieve(first.id)


def test_the_store_drops_the_least_recently_used():
    store = ResponseStore(capacity=2)
    for name in ("a", "b"):
        store.put({"id": name}, [])
    store.get("a")
    store.put({"id": "c"}, [])
    assert store.get("a").response == {"id": "a"} and store.get("c").response == {"id": "c"}
    with pytest.raises(APIError) as caught:
        store.get("b")
    assert caught.value.status == 404 and "last 2 responses" in caught.value.message


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"background": True}, "background"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"stream_options": {"include_obfuscation": True}}, "stream_options"),
    ],
)
def test_what_astrai_cannot_do_is_a_400_naming_the_field(openai_client, server, fields, named):
    body = {"model": server.model_name, "input": "Hi", "max_output_tokens": 2, **fields}
    response = httpx.post(
        f"{server.base_url}/v1/responses",
        json=body,
        headers={"Authorization": f"Bearer {server.api_key}"},
        timeout=60,
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert named in error["message"] and (error["param"] or named).startswith(named)


def test_responses_need_the_key(server):
    response = httpx.post(f"{server.base_url}/v1/responses", json={"input": "Hi"})
    assert response.status_code == 401


class Forecast(BaseModel):
    sky: str = Field(max_length=12)


def test_an_agents_sdk_agent_runs_its_tool_loop(server):
    """The OpenAI Agents SDK's Responses model through a whole loop: a forced call, the tool's
    output sent back, then the structured answer. A random model never chooses to call under
    tool_choice auto, and a strict tool under auto cannot be combined with the answer's format
    yet, so the call is forced and the tool is not strict (the SDK resets tool_choice to auto
    after the call, as it always does)."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)  # the SDK would send its traces to OpenAI
    cities = []

    @function_tool(strict_mode=False)
    def get_weather(city: Annotated[str, Field(max_length=12)]) -> str:
        """The weather in a city."""
        cities.append(city)
        return "Sunny"

    client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)
    agent = Agent(
        name="forecaster",
        instructions="Say what the sky is like.",
        tools=[get_weather],
        output_type=Forecast,
        model=OpenAIResponsesModel(model=MODEL_NAME, openai_client=client),
        model_settings=ModelSettings(
            tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=200
        ),
    )
    result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=3))
    assert len(cities) == 1
    assert isinstance(result.final_output, Forecast)
    kinds = [type(item).__name__ for item in result.new_items]
    assert kinds == ["ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"]


CODEX_CONFIG = """
model = "smollm2"
model_provider = "astrai"

[model_providers.astrai]
name = "astrai"
base_url = "{base_url}/v1"
wire_api = "responses"
env_key = "ASTRAI_CODEX_KEY"
"""


@pytest.mark.slow
@pytest.mark.skipif(
    shutil.which("codex") is None,
    reason="the Codex CLI is not installed (npm install -g @openai/codex)",
)
def test_codex_exec_runs_against_astrai_serve(tmp_path):
    """The Codex CLI's non-interactive mode, which speaks only the Responses API, through a
    whole turn against `astrai serve` on the real SmolLM2 GGUF (its prompt of several thousand
    tokens needs the model's long context). Its multi-agent tools come as a namespace and its
    web search is a hosted tool, which astrai refuses by name; they are switched off."""
    home, work = tmp_path / "codex-home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    # Codex sends no temperature: the server's greedy default, with a repetition penalty, keeps
    # the 135M model from sampling or looping its way on to the end of its context, which Codex
    # reports as incomplete (on another CPU kind, greedy tokens may part from this one's).
    flags = ["--model-name", "smollm2", "--max-seq-len", "8192", "--kv-cache-memory", "400000000"]
    flags += ["--override-generation-config", '{"temperature": 0, "repetition_penalty": 1.2}']
    with astrai_serve(real_gguf(), *flags, api_key="codex-key") as (process, base_url):
        (home / "config.toml").write_text(CODEX_CONFIG.format(base_url=base_url))
        result = subprocess.run(
            ["codex", "exec", "--skip-git-repo-check", "--disable", "multi_agent"]
            + ["--disable", "goals", "-c", "web_search=disabled", "Say hello."],
            env={**os.environ, "CODEX_HOME": str(home), "ASTRAI_CODEX_KEY": "codex-key"},
            cwd=work,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=900,
        )
        process.terminate()
        process.wait(timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ERROR" not in result.stderr, result.stderr[-3000:]
    assert result.stdout.strip()  # the model's last message
