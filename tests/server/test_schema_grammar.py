"""What a JSON schema's grammar allows beyond the schema's letter: objects that list their
properties take no others (so no key is written twice), integers without bounds stay within
the exactly representable range, and a request without max_tokens ends at the context.

A random-weight model wanders wherever the grammar lets it, so each test samples several
answers at temperature 1."""

from __future__ import annotations

import json

SAMPLES = dict(n=8, temperature=1.0, seed=0)


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def pairs_of(text: str) -> list[tuple[str, object]]:
    """The key-value pairs of a JSON object as written, repeated keys and all."""
    return json.loads(text, object_pairs_hook=lambda pairs: pairs)


def test_an_object_takes_only_its_listed_keys_once(openai_client, server):
    schema = {
        "type": "object",
        "properties": {"done": {"type": "boolean"}, "tag": {"enum": ["a", "b"]}},
    }
    reply = openai_client.chat.completions.create(
        model=server.model_name,
        messages=[{"role": "user", "content": "Describe it."}],
        response_format=schema_format(schema),
        max_tokens=60,
        **SAMPLES,
    )
    for choice in reply.choices:
        assert choice.finish_reason == "stop", choice.message.content
        keys = [key for key, _ in pairs_of(choice.message.content)]
        assert len(keys) == len(set(keys)) and set(keys) <= {"done", "tag"}, keys


def test_an_integer_without_bounds_stays_exact(openai_client, server):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    reply = openai_client.chat.completions.create(
        model=server.model_name,
        messages=[{"role": "user", "content": "Pick a number."}],
        response_format=schema_format(schema),
        max_tokens=40,
        **SAMPLES,
    )
    for choice in reply.choices:
        assert choice.finish_reason == "stop", choice.message.content
        assert abs(json.loads(choice.message.content)["n"]) <= 2**53 - 1


def test_a_request_without_max_tokens_ends_at_the_context(openai_client, server):
    # Longer than the context: only the bound ends it.
    text = {"type": "string", "minLength": 400}
    schema = {"type": "object", "properties": {"text": text}, "required": ["text"]}
    reply = openai_client.chat.completions.create(
        model=server.model_name,
        messages=[{"role": "user", "content": "Write."}],
        response_format=schema_format(schema),
        temperature=1.0,
        seed=1,
    )
    usage = reply.usage
    assert reply.choices[0].finish_reason == "length"
    assert usage.prompt_tokens + usage.completion_tokens == server.engine.max_seq_len
