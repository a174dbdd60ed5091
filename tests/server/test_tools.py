"""Tool calling: the parsers of each format, and the OpenAI API's tools through the real openai
SDK against a real server whose (Hermes-style) chat template shows the model its tools.

The model has random weights: only the grammar that tool_choice "required" or a named function
puts on decoding makes its answer a call, which is what these tests rely on.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Literal

import anthropic
import httpx
import jsonschema
import openai
import pydantic
import pytest
from live_server import API_KEY, MODEL_NAME, make_engine, serving

from astrai.inference.constraints import Constraint, ConstraintCompiler
from astrai.server.tool_parsers import (
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    ToolCall,
    ToolCallParser,
    tool_call_parser_for,
)
from astrai.tokenize import AutoTokenizer

# Qwen2.5's template, cut down: tools in the system turn, calls in <tool_call> tags, results in
# <tool_response> tags of a user turn.
HERMES_TEMPLATE = """\
{%- if tools %}<|im_start|>system
You may call these tools:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call one as <tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role == 'assistant' and message.tool_calls is defined %}<|im_start|>assistant
{%- for call in message.tool_calls %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


# The parsers


def deltas_of(parser: ToolCallParser, text: str, size: int) -> tuple[str, list[ToolCall]]:
    """The content and the calls a stream of text in pieces of size characters gives."""
    stream = parser.stream()
    content, names, arguments = "", [], []
    for start in range(0, len(text), size):
        piece, deltas = stream.feed(text[start : start + size])
        content += piece
        for delta in deltas:
            if delta.name is not None:
                assert delta.index == len(names) and not delta.arguments
                names.append(delta.name)
                arguments.append("")
            else:
                assert delta.index == len(names) - 1, "arguments come after their call's name"
                arguments[delta.index] += delta.arguments
    content += stream.finish()
    return content, [ToolCall(n, a) for n, a in zip(names, arguments, strict=True)]


HERMES_TEXT = (
    'Let me look that up. <tool_call>\n{"name": "get_weather", "arguments": '
    '{"city": "Paris", "days": 2, "note": "a } and a \\" inside"}}\n</tool_call>\n'
    '<tool_call>\n{"arguments": {"zone": "CET"}, "name": "get_time"}\n</tool_call>'
)
HERMES_CALLS = [
    ToolCall("get_weather", '{"city": "Paris", "days": 2, "note": "a } and a \\" inside"}'),
    ToolCall("get_time", '{"zone": "CET"}'),
]
LLAMA_TEXT = (
    '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 1}}; '
    '{"name": "get_time", "parameters": {}}'
)
LLAMA_CALLS = [
    ToolCall("get_weather", '{"city": "Oslo", "days": 1}'),
    ToolCall("get_time", "{}"),
]
MISTRAL_TEXT = 'Sure.[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}]'
MISTRAL_CALLS = [ToolCall("get_time", '{"zone": "UTC"}')]
CASES = [
    (HermesParser(), HERMES_TEXT, "Let me look that up. ", HERMES_CALLS),
    (Llama3JsonParser(), LLAMA_TEXT, "", LLAMA_CALLS),
    (Llama3JsonParser(), "<|python_tag|>" + LLAMA_TEXT, "", LLAMA_CALLS),
    (MistralParser(), MISTRAL_TEXT, "Sure.", MISTRAL_CALLS),
]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_a_parser_reads_the_calls_and_the_text_before_them(parser, text, content, calls):
    assert parser.parse(text) == (content, calls)


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
@pytest.mark.parametrize("size", [1, 2, 3, 5, 16])
def test_a_call_streamed_in_pieces_is_the_call_parsed_whole(parser, text, content, calls, size):
    assert deltas_of(parser, text, size) == (content, calls)


NO_CALLS = [
    (HermesParser(), "No tools needed: <tool and </tool_call> are just text."),
    (HermesParser(), 'Cut short <tool_call>\n{"name": "get_time", "arguments": {"zo'),
    (HermesParser(), '<tool_call>\n{"name": "get_time", "arguments": "not an object"}'),
    (Llama3JsonParser(), 'The JSON {"name": "f", "parameters": {}} is mid-text.'),
    (MistralParser(), "Plain [TOOL_ text."),
]


@pytest.mark.parametrize(("parser", "text"), NO_CALLS)
def test_text_without_a_whole_call_is_content(parser, text):
    assert parser.parse(text) == (text, [])


@pytest.mark.parametrize(("parser", "text"), NO_CALLS)
@pytest.mark.parametrize("size", [1, 4])
def test_text_without_a_whole_call_is_content_streamed_too(parser, text, size):
    assert deltas_of(parser, text, size) == (text, [])


@pytest.mark.parametrize("size", [1, 4])
def test_llama_json_opens_calls_only_at_the_start_of_the_output(size):
    text = ' The JSON {"name": "f", "parameters": {}} is mid-text.'
    assert deltas_of(Llama3JsonParser(), text, size) == (text, [])
    called = '  {"name": "f", "parameters": {"a": 1}}'
    assert deltas_of(Llama3JsonParser(), called, size) == ("", [ToolCall("f", '{"a": 1}')])


def test_a_stream_holds_back_only_what_may_open_a_call():
    stream = HermesParser().stream()
    assert stream.feed("Hello <tool") == ("Hello ", [])
    assert stream.feed("box> done") == ("<toolbox> done", [])
    assert stream.finish() == ""
    stream = HermesParser().stream()
    assert stream.feed("ends in <tool_ca") == ("ends in ", [])
    assert stream.finish() == "<tool_ca"


def test_the_parser_is_named_or_read_from_the_chat_template():
    assert isinstance(tool_call_parser_for("mistral", [HERMES_TEMPLATE]), MistralParser)
    assert isinstance(tool_call_parser_for(None, [HERMES_TEMPLATE]), HermesParser)
    assert isinstance(tool_call_parser_for(None, ["{{ '<|python_tag|>' }}"]), Llama3JsonParser)
    assert tool_call_parser_for(None, ["{{ messages }}"]) is None
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral"):
        tool_call_parser_for("qwen", [])


# The OpenAI API


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory, llama_dir) -> Iterator[str]:
    """A server on the tiny model with HERMES_TEMPLATE, and room in its context for tools."""
    model_dir = tmp_path_factory.mktemp("hermes")
    for file in llama_dir.iterdir():
        (model_dir / file.name).symlink_to(file)
    (model_dir / "chat_template.jinja").write_text(HERMES_TEMPLATE)
    engine = make_engine(model_dir, max_seq_len=1024)
    with serving(engine) as server:
        yield server.base_url


@pytest.fixture(scope="module")
def client(tool_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tool_server}/v1", api_key=API_KEY, max_retries=0)


def ask(client: openai.OpenAI, **kwargs):
    settings = dict(model=MODEL_NAME, messages=USER, tools=TOOLS, max_tokens=200, temperature=0)
    return client.chat.completions.create(**{**settings, **kwargs})


def assert_valid_calls(message, names: set[str]) -> None:
    assert message.tool_calls, message.content
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_required_gives_a_call_with_schema_valid_arguments(client, seed):
    reply = ask(client, tool_choice="required", temperature=1.0, seed=seed)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert_valid_calls(choice.message, set(SCHEMAS))


def test_a_named_function_is_the_one_called(client):
    choice = {"type": "function", "function": {"name": "get_time"}}
    reply = ask(client, tool_choice=choice, temperature=1.0, seed=3)
    assert reply.choices[0].finish_reason == "tool_calls"
    assert_valid_calls(reply.choices[0].message, {"get_time"})
    assert len(reply.choices[0].message.tool_calls) == 1


def test_without_parallel_calls_there_is_one(client):
    for seed in range(3):
        reply = ask(client, tool_choice="required", parallel_tool_calls=False, seed=seed)
        assert len(reply.choices[0].message.tool_calls) == 1


def test_none_gives_plain_text(client):
    reply = ask(client, tool_choice="none", max_tokens=20)
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.choices[0].message.tool_calls is None
    assert isinstance(reply.choices[0].message.content, str)


def test_streamed_call_deltas_add_up_to_the_call(client):
    whole = ask(client, tool_choice="required").choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    finish = None
    for chunk in ask(client, tool_choice="required", stream=True):
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for delta in choice.delta.tool_calls or ():
            if delta.index not in calls:  # a call's first chunk: its id, type and name
                assert delta.id.startswith("call_") and delta.type == "function"
                assert delta.function.name and delta.function.arguments == ""
                calls[delta.index] = {"name": delta.function.name, "arguments": ""}
            else:
                assert delta.id is None and delta.function.name is None
                calls[delta.index]["arguments"] += delta.function.arguments
    assert finish == "tool_calls"
    assert [calls[i] for i in sorted(calls)] == [
        {"name": call.function.name, "arguments": call.function.arguments} for call in whole
    ]


def test_a_round_trip_renders_the_call_and_its_result(client, tool_server):
    call = ask(client, tool_choice="required", parallel_tool_calls=False)
    [made] = call.choices[0].message.tool_calls
    history = [
        *USER,
        call.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": made.id, "content": "Sunny, 21 C"},
    ]
    answer = ask(client, messages=history, max_tokens=8)
    assert answer.choices[0].message.content is not None
    # The template got the call's arguments as an object and the tool's result, in order.
    tokenized = httpx.post(
        f"{tool_server}/tokenize",
        json={"model": MODEL_NAME, "messages": history, "tools": TOOLS},
        headers={"Authorization": f"Bearer {API_KEY}"},
    ).json()
    assert tokenized["count"] == answer.usage.prompt_tokens
    rendered = httpx.post(
        f"{tool_server}/detokenize",
        json={"model": MODEL_NAME, "tokens": tokenized["tokens"]},
        headers={"Authorization": f"Bearer {API_KEY}"},
    ).json()["prompt"]
    expected_call = f'{{"name": "{made.function.name}", "arguments": {made.function.arguments}}}'
    assert f"<tool_call>\n{expected_call}\n</tool_call>" in rendered
    assert "<tool_response>\nSunny, 21 C\n</tool_response>" in rendered
    assert '"name": "get_weather"' in rendered.split("</tools>")[0]


@pytest.mark.parametrize(
    ("request_fields", "named"),
    [
        (
            {"tools": [{**TIME, "function": {**TIME["function"], "parameters": {"type": "nope"}}}]},
            "tools",
        ),
        ({"tool_choice": {"type": "function", "function": {"name": "send_mail"}}}, "tool_choice"),
        ({"tools": [], "tool_choice": "required"}, "tool_choice"),
    ],
)
def test_requests_tools_cannot_honour_are_400s(client, request_fields, named):
    with pytest.raises(openai.BadRequestError) as caught:
        ask(client, **{"tool_choice": "required", **request_fields})
    assert caught.value.body["param"] == named, caught.value.message


def test_a_tool_message_needs_its_call_id(client):
    with pytest.raises(openai.BadRequestError, match="tool_call_id"):
        ask(client, messages=[*USER, {"role": "tool", "content": "Sunny"}])


# A template that drops the tools (the tiny model's, SmolLM2's): astrai shows them itself.

SMALL_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
            "required": ["zone"],
        },
    },
}


@pytest.fixture(scope="module")
def dropping_server(llama_dir) -> Iterator[str]:
    """A server on the tiny model's own template, with room in its context for the tools."""
    engine = make_engine(llama_dir, max_seq_len=1024)
    with serving(engine) as server:
        yield server.base_url


@pytest.fixture(scope="module")
def dropping_client(dropping_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{dropping_server}/v1", api_key=API_KEY, max_retries=0)


def test_a_template_without_tools_gets_them_in_hermes_style(
    dropping_client, dropping_server, llama_dir
):
    [card] = dropping_client.models.list().data
    assert (card.tool_call_parser, card.tools_shown_by) == ("hermes", "astrai")
    reply = dropping_client.chat.completions.create(
        model=MODEL_NAME,
        messages=USER,
        tools=[SMALL_TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=100,
        temperature=0,
    )
    [call] = reply.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), SMALL_TOOL["function"]["parameters"])
    history = [
        *USER,
        {"role": "assistant", "tool_calls": [call.model_dump(exclude_none=True)]},
        {"role": "tool", "tool_call_id": call.id, "content": "12:00"},
    ]
    shown = httpx.post(
        f"{dropping_server}/tokenize",
        json={"messages": history, "tools": [SMALL_TOOL], "add_generation_prompt": False},
        headers={"Authorization": f"Bearer {API_KEY}"},
    ).json()["tokens"]
    rendered = AutoTokenizer.from_pretrained(llama_dir).decode(shown, skip_special_tokens=False)
    assert rendered.index("<tools>\n" + json.dumps(SMALL_TOOL)) < rendered.index(USER[0]["content"])
    body = json.dumps({"name": "get_time", "arguments": json.loads(call.function.arguments)})
    assert f"<|im_start|>assistant\n<tool_call>\n{body}\n</tool_call><|im_end|>" in rendered
    assert "<|im_start|>user\n<tool_response>\n12:00\n</tool_response><|im_end|>" in rendered
    # auto reads a call written in that format.
    spoken = r'<tool_call>\n\{"name": "get_time", "arguments": \{"zone": "UTC"\}\}\n</tool_call>'
    reply = dropping_client.chat.completions.create(
        model=MODEL_NAME,
        messages=USER,
        tools=[SMALL_TOOL],
        max_tokens=100,
        extra_body={"guided_regex": spoken},
    )
    assert reply.choices[0].message.tool_calls[0].function.arguments == '{"zone": "UTC"}'


def test_an_assistant_call_without_content_is_rendered(dropping_client):
    """LiteLLM sends back a call without a content key; templates concatenate the content."""
    call = {"id": "call_1", "type": "function"}
    call["function"] = {"name": "get_time", "arguments": '{"zone": "UTC"}'}
    history = [
        *USER,
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ]
    with_null = [history[0], {**history[1], "content": None}, history[2]]
    kwargs = dict(model=MODEL_NAME, max_tokens=2)
    chat = dropping_client.chat.completions.create
    without, null = (chat(messages=messages, **kwargs) for messages in (history, with_null))
    assert without.usage.prompt_tokens == null.usage.prompt_tokens
    shown = chat(messages=history, tools=[SMALL_TOOL], **kwargs)
    assert shown.usage.prompt_tokens > without.usage.prompt_tokens


# A template that shows the tools in a format astrai does not know.

PLAIN_TOOLS_TEMPLATE = """\
{%- for message in messages %}{{ message.role }}: {{ message.content }}
{% endfor %}{% if tools %}functions: {{ tools | tojson }}
{% endif %}{% if add_generation_prompt %}assistant:{% endif %}"""


@pytest.fixture(scope="module")
def plain_tools_client(tmp_path_factory, llama_dir) -> Iterator[openai.OpenAI]:
    model_dir = tmp_path_factory.mktemp("plain_tools")
    for file in llama_dir.iterdir():
        (model_dir / file.name).symlink_to(file)
    (model_dir / "chat_template.jinja").write_text(PLAIN_TOOLS_TEMPLATE)
    engine = make_engine(model_dir, max_seq_len=1024)
    with serving(engine) as server:
        yield openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)


def test_forced_calls_need_no_parser_and_auto_needs_one(plain_tools_client):
    [card] = plain_tools_client.models.list().data
    assert (card.tool_call_parser, card.tools_shown_by) == (None, "chat_template")
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        reply = ask(plain_tools_client, tool_choice=choice, max_tokens=80)
        assert reply.choices[0].finish_reason == "tool_calls"
        assert_valid_calls(reply.choices[0].message, set(SCHEMAS))
    with pytest.raises(openai.BadRequestError, match="--tool-call-parser") as caught:
        ask(plain_tools_client, tool_choice="auto", max_tokens=2)
    assert caught.value.body["param"] == "tools"


def test_serve_takes_the_parser_by_flag(llama_dir):
    """The tiny model's own template shows no tool format: --tool-call-parser names one."""
    from serve_process import astrai_serve

    flags = [
        "--tool-call-parser",
        "mistral",
        "--max-seq-len",
        "512",
        "--kv-cache-memory",
        "8000000",
    ]
    with astrai_serve(llama_dir, *flags, api_key=API_KEY) as (_, base):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0)
        reply = ask(
            client,
            model=llama_dir.name,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        )
    assert reply.choices[0].finish_reason == "tool_calls"
    assert_valid_calls(reply.choices[0].message, {"get_weather"})


# The Anthropic API

ANTHROPIC_TOOLS = [
    {
        "name": tool["function"]["name"],
        **(
            {"description": tool["function"]["description"]}
            if "description" in tool["function"]
            else {}
        ),
        "input_schema": tool["function"]["parameters"],
    }
    for tool in TOOLS
]


@pytest.fixture(scope="module")
def claude(tool_server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=tool_server, api_key=API_KEY, max_retries=0)


def ask_claude(claude: anthropic.Anthropic, **kwargs):
    settings = dict(model=MODEL_NAME, messages=USER, tools=ANTHROPIC_TOOLS, max_tokens=200)
    return claude.messages.create(**{**settings, "extra_body": {"temperature": 0}, **kwargs})


def assert_valid_tool_use(message, names: set[str]) -> list:
    uses = [block for block in message.content if block.type == "tool_use"]
    assert uses, message.content
    for use in uses:
        assert use.id.startswith("toolu_") and use.name in names
        jsonschema.validate(use.input, SCHEMAS[use.name])
    return uses


def test_anthropic_any_gives_a_tool_use_block(claude):
    message = ask_claude(claude, tool_choice={"type": "any"})
    assert message.stop_reason == "tool_use"
    assert_valid_tool_use(message, set(SCHEMAS))


def test_anthropic_a_named_tool_is_the_one_used(claude):
    message = ask_claude(claude, tool_choice={"type": "tool", "name": "get_time"})
    assert message.stop_reason == "tool_use"
    assert len(assert_valid_tool_use(message, {"get_time"})) == 1


def test_anthropic_none_gives_text(claude):
    message = ask_claude(claude, tool_choice={"type": "none"}, max_tokens=10)
    assert [block.type for block in message.content] == ["text"]
    assert message.stop_reason in ("end_turn", "max_tokens")


def test_anthropic_streamed_tool_use_is_the_whole_one(claude):
    choice = {"type": "any", "disable_parallel_tool_use": True}
    [whole] = assert_valid_tool_use(ask_claude(claude, tool_choice=choice), set(SCHEMAS))
    events = list(ask_claude(claude, tool_choice=choice, stream=True))
    kinds = [event.type for event in events]  # the SDK drops the ping
    assert kinds[:3] == ["message_start", "content_block_start", "content_block_delta"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    start = events[1].content_block
    assert start.type == "tool_use" and start.name == whole.name and start.input == {}
    partial = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta")
    assert json.loads(partial) == whole.input
    assert events[-2].delta.stop_reason == "tool_use"


def test_anthropic_a_tool_result_follows_the_tool_use(claude, tool_server):
    choice = {"type": "any", "disable_parallel_tool_use": True}
    message = ask_claude(claude, tool_choice=choice)
    [use] = assert_valid_tool_use(message, set(SCHEMAS))
    result = {"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21 C"}
    history = [
        *USER,
        {"role": "assistant", "content": [block.model_dump() for block in message.content]},
        {"role": "user", "content": [result, {"type": "text", "text": "Thanks!"}]},
    ]
    answer = ask_claude(claude, messages=history, max_tokens=8)
    assert answer.content[0].type == "text"
    # It renders as the OpenAI history with the same call and result does.
    call = {"id": use.id, "type": "function"}
    call["function"] = {"name": use.name, "arguments": json.dumps(use.input)}
    openai_history = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": use.id, "content": "Sunny, 21 C"},
        {"role": "user", "content": "Thanks!"},
    ]
    tokenized = httpx.post(
        f"{tool_server}/tokenize",
        json={"model": MODEL_NAME, "messages": openai_history, "tools": TOOLS},
        headers={"Authorization": f"Bearer {API_KEY}"},
    ).json()
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens == tokenized["count"]
    counted = claude.messages.count_tokens(
        model=MODEL_NAME, messages=history, tools=ANTHROPIC_TOOLS
    )
    assert counted.input_tokens == tokenized["count"]


def test_anthropic_a_call_cut_off_is_dropped_streamed_or_not(claude):
    choice = {"type": "any"}
    message = ask_claude(claude, tool_choice=choice, max_tokens=40)  # the call takes 78
    assert message.stop_reason == "max_tokens"
    assert [(block.type, block.text) for block in message.content] == [("text", "")]
    events = list(ask_claude(claude, tool_choice=choice, max_tokens=40, stream=True))
    starts = [e.content_block for e in events if e.type == "content_block_start"]
    assert [(block.type, block.text) for block in starts] == [("text", "")]
    assert not [e for e in events if e.type == "content_block_delta"]
    assert events[-2].delta.stop_reason == "max_tokens"


@pytest.mark.parametrize(
    ("request_fields", "named"),
    [
        ({"tools": [{**ANTHROPIC_TOOLS[1], "input_schema": {"type": "nope"}}]}, "tools"),
        ({"tool_choice": {"type": "tool", "name": "send_mail"}}, "tool_choice"),
        ({"tools": [], "tool_choice": {"type": "any"}}, "tool_choice"),
    ],
)
def test_anthropic_requests_tools_cannot_honour_are_400s(claude, request_fields, named):
    with pytest.raises(anthropic.BadRequestError) as caught:
        ask_claude(claude, **{"tool_choice": {"type": "any"}, **request_fields})
    assert named in caught.value.message


# auto: the model's own text is parsed. A random-weight model never writes a call by itself, so
# a regex (vLLM's guided_regex) makes it write text and then one.
SPOKEN_CALL = (
    r'Let me see\. <tool_call>\n\{"name": "get_time", "arguments": \{"zone": "UTC"\}\}\n'
    r"</tool_call>"
)


def test_auto_reads_the_call_the_model_wrote(client):
    reply = ask(client, tool_choice="auto", extra_body={"guided_regex": SPOKEN_CALL})
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me see. "
    [call] = choice.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_time", '{"zone": "UTC"}')
    content, arguments = "", ""
    for chunk in ask(client, extra_body={"guided_regex": SPOKEN_CALL}, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for piece in delta.tool_calls or ():
            arguments += piece.function.arguments
    assert (content, arguments) == ("Let me see. ", '{"zone": "UTC"}')


def streamed_calls(stream) -> tuple[str, list[dict], str | None]:
    """The content, the calls and the finish reason of a streamed answer."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        finish = choice.finish_reason or finish
        for delta in choice.delta.tool_calls or ():
            call = calls.setdefault(delta.index, {"name": delta.function.name, "arguments": ""})
            call["arguments"] += delta.function.arguments
    return content, [calls[i] for i in sorted(calls)], finish


def test_calls_cut_off_by_max_tokens_are_the_complete_ones_streamed_or_not(client):
    settings = dict(tool_choice="required", temperature=1.0, seed=2)
    whole = ask(client, max_tokens=400, **settings)
    first, second = whole.choices[0].message.tool_calls  # this seed's answer makes two calls
    limit = whole.usage.completion_tokens * 2 // 3  # the second call cut off
    cut = ask(client, max_tokens=limit, **settings).choices[0]
    assert (cut.finish_reason, cut.message.content) == ("length", None)
    assert [call.function for call in cut.message.tool_calls] == [first.function]
    streamed = ask(client, max_tokens=limit, stream=True, **settings)
    assert streamed_calls(streamed) == ("", [first.function.model_dump()], "length")


# Strict tools under auto: free text until the model opens a call, the call held to the schema.


class GetTime(pydantic.BaseModel):
    """The time in a zone."""

    zone: Literal["UTC", "CET"]


def test_a_strict_tool_under_auto_holds_a_started_call_to_its_schema(client, llama_dir):
    strict = openai.pydantic_function_tool(GetTime)
    assert strict["function"]["strict"] is True  # what the SDK sends, as the Agents SDK does
    reply = ask(client, tools=[strict, WEATHER], tool_choice="auto", max_tokens=8)
    assert reply.choices[0].finish_reason == "length"  # free text: the model opened no call
    # The strict tool's grammar is on the answer: another constraint beside it is refused.
    with pytest.raises(openai.BadRequestError, match="tools and guided_regex both constrain"):
        ask(client, tools=[strict], tool_choice="auto", extra_body={"guided_regex": "a+"})
    functions = [strict["function"], WEATHER["function"]]
    grammar = HermesParser().triggered_grammar(functions, parallel=True)
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    compiled = ConstraintCompiler(tokenizer).compile(Constraint.grammar(grammar))

    def accepts(text: str) -> bool:
        state = compiled.new_state()
        try:
            for token in tokenizer.encode(text, add_special_tokens=False):
                state.advance(token)
        except RuntimeError:
            return False
        return True

    call = '<tool_call>\n{"name": "GetTime", "arguments": {"zone": "%s"}}\n</tool_call>'
    assert accepts("Any text, <b>tags</b> and all, then " + call % "UTC" + " and more")
    assert not accepts("Some text " + call % "PST")  # not in the strict schema's enum
    assert not accepts('<tool_call>\n{"name": "get_time", "arguments": {}}')  # no such tool
    # A tool without strict takes any object of arguments.
    assert accepts('<tool_call>\n{"name": "get_weather", "arguments": {"x": [1]}}\n</tool_call>')
