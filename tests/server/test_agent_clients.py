"""Agent frameworks' basic tool flows against `astrai serve` on the real SmolLM2-135M-Instruct
GGUF with default flags (no --tool-call-parser): LiteLLM's tool loop, pydantic-ai's agents and
LangChain's bind_tools and with_structured_output, each as its documentation shows it."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pydantic
import pytest
from serve_process import astrai_serve
from tiny_models import real_gguf

pytestmark = pytest.mark.slow  # a real model's server, and the frameworks' imports

MODEL = "SmolLM2-135M-Instruct.Q4_1.gguf"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}},
            "required": ["city"],
        },
    },
}
QUESTION = "What is the weather in Paris?"


class Capital(pydantic.BaseModel):
    """A country's capital city."""

    country: str = pydantic.Field(max_length=40)
    city: str = pydantic.Field(max_length=40)


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    flags = ["--max-seq-len", "2048", "--kv-cache-memory", "64000000"]
    with astrai_serve(real_gguf(), *flags) as (process, url):
        yield f"{url}/v1"
        process.terminate()
        process.wait(timeout=60)


def test_litellm_tool_loop(base_url, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of its price list
    import litellm

    settings = dict(model=f"openai/{MODEL}", api_base=base_url, api_key="unused", temperature=0)
    messages = [{"role": "user", "content": QUESTION}]
    reply = litellm.completion(
        messages=messages, tools=[WEATHER], tool_choice="required", max_tokens=60, **settings
    )
    [call] = reply.choices[0].message.tool_calls[:1]
    assert call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments)["city"], str)
    # The loop sends the assistant message back as LiteLLM gives it, then the tool's result.
    messages.append(reply.choices[0].message)
    for made in reply.choices[0].message.tool_calls:
        messages.append({"role": "tool", "tool_call_id": made.id, "content": "Sunny, 21 C"})
    answer = litellm.completion(messages=messages, tools=[WEATHER], max_tokens=30, **settings)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert answer.choices[0].message.content or answer.choices[0].message.tool_calls


def test_pydantic_ai_agents(base_url):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=base_url, api_key="unused"))
    settings = {"temperature": 0, "max_tokens": 80}
    # Structured output: the agent forces a call of its output tool, strict.
    capital = Agent(model, output_type=Capital, model_settings=settings)
    result = capital.run_sync("What is the capital of France?")
    assert isinstance(result.output, Capital)
    # A tool agent with text output: the tool is offered under tool_choice auto.
    weather = Agent(model, model_settings=settings)

    @weather.tool_plain
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "Sunny, 21 C"

    assert isinstance(weather.run_sync(QUESTION).output, str)


def test_langchain_bind_tools_and_structured_output(base_url):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "Sunny, 21 C"

    llm = ChatOpenAI(model=MODEL, base_url=base_url, api_key="unused", temperature=0, max_tokens=80)
    message = llm.bind_tools([get_weather], tool_choice="get_weather").invoke(QUESTION)
    [call] = message.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)
    capital = llm.with_structured_output(Capital).invoke("What is the capital of France?")
    assert isinstance(capital, Capital)
