"""`astrai serve` on the real SmolLM2-135M-Instruct GGUF file, asked by the real openai and
anthropic clients what the capital of France is."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from tiny_models import real_gguf

REPO_ROOT = Path(__file__).resolve().parents[2]
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    with socket.socket() as probe:  # a free loopback port for the server to take
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [
        sys.executable, "-m", "astrai", "serve", "--model", str(real_gguf()),
        "--port", str(port), "--max-seq-len", "512", "--kv-cache-memory", "64000000",
        "--dequantize",  # the reference's weights: llama.cpp's int8 activations say L'Étoile
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "ASTRAI_API_KEY": ""}
    server = subprocess.Popen(command, env=env, cwd=REPO_ROOT, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                pytest.fail(f"astrai serve did not start:\n{server.stderr.read()[-3000:]}")
            time.sleep(0.2)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=60)


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
