"""`astrai serve` on the real SmolLM2-135M-Instruct GGUF file, asked by the real openai and
anthropic clients what the capital of France is."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from serve_process import astrai_serve
from tiny_models import real_gguf

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    # the default activation precision (with --activation-precision int8, llama.cpp's
    # rounding, it says L'Étoile on an AVX-512 EPYC)
    flags = ["--max-seq-len", "512", "--kv-cache-memory", "64000000"]
    with astrai_serve(real_gguf(), *flags) as (process, url):
        yield url
        process.terminate()
        process.wait(timeout=60)


def test_openai_chat_says_paris(base_url):
    import openai

    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1.gguf",
        messages=[{"role": "user", "content": QUESTION}],
        temperature=0,
        max_tokens=24,
    )
    assert "Paris" in reply.choices[0].message.content
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1.gguf",
        messages=[{"role": "user", "content": QUESTION}],
        temperature=0,
        max_tokens=24,
        stream=True,
    )
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert streamed == reply.choices[0].message.content


def test_anthropic_message_says_paris(base_url):
    import anthropic

    client = anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0)
    reply = client.messages.create(
        model="SmolLM2-135M-Instruct.Q4_1.gguf",
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=24,
        extra_body={"temperature": 0},  # this SDK no longer takes temperature as an argument
    )
    assert "Paris" in reply.content[0].text
