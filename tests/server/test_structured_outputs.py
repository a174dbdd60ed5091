"""Structured output through the real openai SDK against a real server on a random-weight
model: whatever the model would say, the constraint makes the answer parse and validate."""

from __future__ import annotations

import json
import re
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

USER = [{"role": "user", "content": "Describe a point."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "population": {"type": "integer", "minimum": 0, "maximum": 100000},
        "capital": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["old", "new", "big"]}, "maxItems": 3},
    },
    "required": ["city", "population", "capital"],
    "additionalProperties": False,
}


class Point(BaseModel):
    label: Literal["origin", "corner", "centre"]
    x: int = Field(ge=-99, le=99)
    y: int = Field(ge=-99, le=99)
    visible: bool
    note: str = Field(max_length=10)


def test_parse_returns_the_pydantic_object(openai_client, server):
    completion = openai_client.chat.completions.parse(
        model=server.model_name, messages=USER, response_format=Point, max_tokens=150
    )
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop", message.content
    assert isinstance(message.parsed, Point)
    assert message.parsed == Point.model_validate_json(message.content)


@pytest.mark.parametrize("strict", [True, False])
def test_a_json_schema_response_validates_streamed_or_not(openai_client, server, strict):
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "city", "schema": SCHEMA, "strict": strict},
    }
    kwargs = dict(
        model=server.model_name,
        messages=USER,
        max_tokens=150,
        temperature=0,
        response_format=response_format,
    )
    reply = openai_client.chat.completions.create(**kwargs)
    text = reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)
    streamed = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in openai_client.chat.completions.create(stream=True, **kwargs)
        if chunk.choices
    )
    assert streamed == text


def test_json_object_regex_choice_and_grammar(openai_client, server):
    def chat(**kwargs):
        reply = openai_client.chat.completions.create(
            model=server.model_name, messages=USER, max_tokens=60, seed=1, **kwargs
        )
        return reply.choices[0].message.content

    assert isinstance(json.loads(chat(response_format={"type": "json_object"})), dict)
    assert re.fullmatch(r"[a-c]{3}-\d\d", chat(extra_body={"guided_regex": r"[a-c]{3}-\d\d"}))
    assert chat(extra_body={"structured_outputs": {"choice": ["up", "down"]}}) in ("up", "down")
    grammar = 'start: "say " WORD\nWORD: /[a-z]{1,6}/'
    assert re.fullmatch(r"say [a-z]{1,6}", chat(extra_body={"guided_grammar": grammar}))
    completion = openai_client.completions.create(
        model=server.model_name,
        prompt="Pick:",
        max_tokens=20,
        n=3,
        seed=2,
        extra_body={"guided_choice": ["red", "green", "blue"]},
    )
    assert {c.text for c in completion.choices} <= {"red", "green", "blue"}


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nope"}},
                }
            },
            "response_format",
        ),
        ({"extra_body": {"guided_regex": "(unclosed"}}, "guided_regex"),
        ({"extra_body": {"structured_outputs": {"choice": []}}}, "structured_outputs"),
        (
            {"extra_body": {"guided_regex": "a+", "structured_outputs": {"regex": "b+"}}},
            "guided_regex",
        ),
    ],
)
def test_a_bad_or_doubled_constraint_is_a_400_naming_the_field(
    openai_client, server, fields, named
):
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.chat.completions.create(
            model=server.model_name, messages=USER, max_tokens=5, **fields
        )
    assert caught.value.body["param"] == named
    assert named in caught.value.body["message"]
    reply = openai_client.chat.completions.create(
        model=server.model_name, messages=USER, max_tokens=2
    )
    assert reply.choices[0].finish_reason in ("stop", "length")
