"""An assistant prefill: the answer continues the chat's last message, left open as
transformers' continue_final_message leaves it (vLLM's field of that name in chat completions,
a last assistant message in Anthropic's Messages API)."""

from __future__ import annotations

import openai
import pytest
import transformers

CHAT = [
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "The colour I name is"},
]
SETTINGS = dict(max_tokens=8, temperature=0)


@pytest.fixture(scope="module")
def open_prompt(llama_dir) -> str:
    """The chat as transformers renders it with its last message left open."""
    hf = transformers.AutoTokenizer.from_pretrained(llama_dir)
    return hf.apply_chat_template(CHAT, continue_final_message=True, tokenize=False)


def test_continue_final_message_continues_it(openai_client, server, open_prompt):
    assert open_prompt.endswith(CHAT[-1]["content"])
    reply = openai_client.chat.completions.create(
        model=server.model_name,
        messages=CHAT,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
        **SETTINGS,
    )
    ids = server.engine.tokenizer.encode(open_prompt, add_special_tokens=False)
    assert reply.usage.prompt_tokens == len(ids)
    continued = openai_client.completions.create(
        model=server.model_name, prompt=ids, **SETTINGS
    ).choices[0]
    assert reply.choices[0].message.content == continued.text
    # add_generation_prompt left out gives way to it.
    alone = openai_client.chat.completions.create(
        model=server.model_name,
        messages=CHAT,
        extra_body={"continue_final_message": True},
        **SETTINGS,
    )
    assert alone.choices[0].message.content == continued.text


@pytest.mark.parametrize(
    "fields",
    [
        {"continue_final_message": True, "add_generation_prompt": True},
        {
            "continue_final_message": True,
            "messages": [
                *CHAT[:1],
                {
                    "role": "assistant",
                    "tool_calls": [
                        {
                            "id": "c",
                            "type": "function",
                            "function": {"name": "f", "arguments": "{}"},
                        }
                    ],
                },
            ],
        },
    ],
)
def test_what_cannot_be_continued_is_a_400(openai_client, server, fields):
    messages = fields.pop("messages", CHAT)
    with pytest.raises(openai.BadRequestError, match="continue"):
        openai_client.chat.completions.create(
            model=server.model_name, messages=messages, extra_body=fields, **SETTINGS
        )


def test_an_anthropic_prefill_is_continued(anthropic_client, openai_client, server, open_prompt):
    message = anthropic_client.messages.create(
        model=server.model_name,
        messages=CHAT,
        max_tokens=SETTINGS["max_tokens"],
        extra_body={"temperature": 0},
    )
    ids = server.engine.tokenizer.encode(open_prompt, add_special_tokens=False)
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == len(ids)
    continued = openai_client.completions.create(model=server.model_name, prompt=ids, **SETTINGS)
    assert message.content[0].text == continued.choices[0].text
