"""The shipped demo model gives the same greedy text in-process, from the CLI and over HTTP."""

from __future__ import annotations

import subprocess
import sys

import pytest
from live_server import start_server, stop_server

from astrai.inference import InferenceEngine
from astrai.launch import DEMO_MODEL_DIR
from astrai.model import AutoModel
from astrai.server import create_app
from astrai.tokenize import AutoTokenizer

PROMPT = "Return the"
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def demo_engine():
    # The CLI's default dtype on CPU; the same weights as `astrai generate` loads.
    model = AutoModel.from_pretrained(DEMO_MODEL_DIR, dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    with InferenceEngine(model, tokenizer, kv_cache_memory=64 << 20) as engine:
        yield engine


@pytest.fixture(scope="module")
def expected(demo_engine) -> str:
    text = demo_engine.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0)
    assert text.strip()
    return text


def test_cli_generate_defaults_to_the_demo_model(expected):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "astrai",
            "generate",
            "--max-tokens",
            str(MAX_TOKENS),
            "--temperature",
            "0",
            PROMPT,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected + "\n"
    assert "demo model" in result.stderr


def test_http_completion_of_the_demo_model_equals_the_engine(demo_engine, expected):
    import openai

    running = start_server(create_app(demo_engine, "astrai-demo"))
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{running.port}/v1", api_key="none")
        completion = client.completions.create(
            model="astrai-demo", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0
        )
    finally:
        stop_server(running)
    assert completion.choices[0].text == expected
