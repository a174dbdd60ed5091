"""The Anthropic-compatible API through the official `anthropic` client against a real server."""

from __future__ import annotations

import httpx

from astrai.inference import GenerationParams, GenerationRequest

SYSTEM = "Be brief."
MESSAGES = [{"role": "user", "content": "Hello world!"}]
# The client no longer has sampling arguments; the API still takes them in the body.
GREEDY = {"extra_body": {"temperature": 0}}
TEMPLATED = [{"role": "system", "content": SYSTEM}, *MESSAGES]


def engine_result(engine, max_tokens: int, **params):
    request = GenerationRequest(
        tuple(TEMPLATED), GenerationParams(max_tokens=max_tokens, temperature=0, **params)
    )
    return engine.generate_results(request)


def test_message_greedy_equals_the_engine(anthropic_client, server):
    message = anthropic_client.messages.create(
        model=server.model_name,
        system=SYSTEM,
        messages=MESSAGES,
        max_tokens=12,
        **GREEDY,
    )
    expected = engine_result(server.engine, 12)
    assert message.type == "message"
    assert message.role == "assistant"
    assert message.id.startswith("msg_")
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == expected.text
    assert message.stop_reason == (
        "max_tokens" if expected.finish_reason == "length" else "end_turn"
    )
    assert message.stop_sequence is None
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == expected.prompt_tokens
    assert usage.output_tokens == expected.completion_tokens


def test_system_as_text_blocks_equals_system_as_a_string(anthropic_client, server):
    kwargs = dict(model=server.model_name, messages=MESSAGES, max_tokens=8, **GREEDY)
    as_string = anthropic_client.messages.create(system=SYSTEM, **kwargs)
    as_blocks = anthropic_client.messages.create(
        system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}], **kwargs
    )
    assert as_blocks.content[0].text == as_string.content[0].text


def test_content_blocks_and_history(anthropic_client, server):
    history = [
        {"role": "user", "content": [{"type": "text", "text": "Hello"}]},
        {"role": "assistant", "content": "Hi there."},
        {"role": "user", "content": [{"type": "text", "text": "How are you?"}]},
    ]
    message = anthropic_client.messages.create(
        model=server.model_name, messages=history, max_tokens=8, **GREEDY
    )
    flat = [{"role": m["role"], "content": m["content"]} for m in history]
    flat[0]["content"], flat[2]["content"] = "Hello", "How are you?"
    request = GenerationRequest(tuple(flat), GenerationParams(max_tokens=8, temperature=0))
    assert message.content[0].text == server.engine.generate(request)


def test_stream_adds_up_to_the_non_streamed_message(anthropic_client, server):
    kwargs = dict(
        model=server.model_name, system=SYSTEM, messages=MESSAGES, max_tokens=16, **GREEDY
    )
    whole = anthropic_client.messages.create(**kwargs)
    with anthropic_client.messages.stream(**kwargs) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == whole.content[0].text
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    total_input = final.usage.input_tokens + final.usage.cache_read_input_tokens
    assert total_input == whole.usage.input_tokens + whole.usage.cache_read_input_tokens


def test_stream_event_sequence(server):
    body = {"model": server.model_name, "messages": MESSAGES, "max_tokens": 5, "stream": True}
    headers = {"x-api-key": server.api_key}
    with httpx.stream(
        "POST", f"{server.base_url}/v1/messages", json=body, headers=headers, timeout=30
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line[7:] for line in response.iter_lines() if line.startswith("event: ")]
    deltas = [e for e in events if e == "content_block_delta"]
    assert events[:3] == ["message_start", "content_block_start", "ping"]
    assert events[3 : 3 + len(deltas)] == deltas
    assert events[3 + len(deltas) :] == ["content_block_stop", "message_delta", "message_stop"]


def test_stop_sequences(anthropic_client, server):
    free = engine_result(server.engine, 24).text
    stop = free[len(free) // 2 :][:3]
    assert stop.strip(), f"the greedy text {free!r} has no usable stop string"
    message = anthropic_client.messages.create(
        model=server.model_name,
        system=SYSTEM,
        messages=MESSAGES,
        max_tokens=24,
        **GREEDY,
        stop_sequences=["\x00never", stop],
    )
    assert message.stop_reason == "stop_sequence"
    assert message.stop_sequence == stop
    assert message.content[0].text == free[: free.index(stop)]


def test_max_tokens_stop_reason(anthropic_client, server):
    message = anthropic_client.messages.create(
        model=server.model_name,
        messages=MESSAGES,
        max_tokens=1,
        extra_body={"top_k": 5, "top_p": 0.9},
    )
    assert message.usage.output_tokens == 1
    assert message.stop_reason in ("max_tokens", "end_turn")


def test_count_tokens(anthropic_client, server):
    counted = anthropic_client.messages.count_tokens(
        model=server.model_name, system=SYSTEM, messages=MESSAGES
    )
    assert counted.input_tokens == len(server.engine.tokenizer.apply_chat_template(TEMPLATED))


def test_stream_start_usage_equals_the_final_usage(anthropic_client, server):
    """message_start goes out before any token; a prompt the prefix cache served in part must
    still count the same input tokens there as in the final usage."""
    question = "Explain paged attention, prefix caching and continuous batching in detail."
    kwargs = dict(
        model=server.model_name,
        system=SYSTEM,
        messages=[{"role": "user", "content": question}],
        max_tokens=4,
        **GREEDY,
    )
    anthropic_client.messages.create(**kwargs)  # leaves the prompt's full pages cached
    with anthropic_client.messages.stream(**kwargs) as stream:
        start = next(event for event in stream if event.type == "message_start").message.usage
        final = stream.get_final_message().usage
    assert final.cache_read_input_tokens > 0
    assert start.input_tokens == final.input_tokens
    assert start.cache_read_input_tokens == final.cache_read_input_tokens
    assert start.cache_creation_input_tokens == final.cache_creation_input_tokens
