"""`astrai serve` on the real SmolLM2-135M-Instruct GGUF file, asked by the real openai,
anthropic and ollama clients what the capital of France is."""

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


@pytest.mark.slow
def test_ollama_chat_and_generate_say_paris(base_url):
    import ollama

    client = ollama.Client(host=base_url)  # what OLLAMA_HOST sets, as the README has it
    kwargs = dict(
        model="SmolLM2-135M-Instruct.Q4_1.gguf", options={"temperature": 0, "num_predict": 24}
    )
    messages = [{"role": "user", "content": QUESTION}]
    reply = client.chat(messages=messages, **kwargs)
    assert "Paris" in reply.message.content
    streamed = client.chat(messages=messages, stream=True, **kwargs)
    assert "".join(part.message.content for part in streamed) == reply.message.content
    assert client.generate(prompt=QUESTION, **kwargs).response == reply.message.content
