"""A request that leaves its sampling out gets the model's generation_config.json settings, under
`astrai serve --override-generation-config` (vLLM's behaviour), over real HTTP."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
from live_server import start_server, stop_server

from astrai.config import ConfigError
from astrai.flags import serve_settings
from astrai.launch import open_router, open_server

FLAGS = ["--max-seq-len", "256", "--kv-cache-memory", "8000000", "--model-name", "tiny"]
PROMPT = "Hello world"


@pytest.fixture
def model(llama_dir, tmp_path):
    """The tiny Llama with a generation_config.json that samples at 0.5 among the top 3."""
    model = tmp_path / "model"
    shutil.copytree(llama_dir, model)
    path = model / "generation_config.json"
    generation = json.loads(path.read_text())
    path.write_text(json.dumps({**generation, "do_sample": True, "temperature": 0.5, "top_k": 3}))
    return model


def serve(*flags):
    """A client of `astrai serve FLAGS` on a loopback port, and its engine."""
    engine, app = open_server(*serve_settings([*flags, *FLAGS]))
    running = start_server(app)
    client = httpx.Client(base_url=f"http://127.0.0.1:{running.port}", timeout=60)
    return engine, client, running


def complete(client: httpx.Client, **fields) -> str:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 10, "seed": 0, **fields}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_requests_take_the_models_generation_config(model):
    engine, client, running = serve(str(model))
    try:
        sampled = {"max_tokens": 10, "seed": 0}
        expected = engine.generate(PROMPT, **sampled, temperature=0.5, top_k=3)
        assert expected != engine.generate(PROMPT, **sampled)
        assert complete(client) == expected
        # a field the request gives wins, even at the engine's own default
        assert complete(client, temperature=1) == engine.generate(PROMPT, **sampled, top_k=3)
    finally:
        client.close()
        stop_server(running)
        engine.close()


def test_the_override_goes_over_the_generation_config(model):
    engine, client, running = serve(str(model), "--override-generation-config", '{"top_k": 0}')
    try:
        sampled = {"max_tokens": 10, "seed": 0, "temperature": 0.5}
        assert complete(client) == engine.generate(PROMPT, **sampled)
        body = {"model": "tiny", "input": PROMPT, "max_output_tokens": 4}
        response = client.post("/v1/responses", json=body).json()
        assert (response["temperature"], response["top_p"]) == (0.5, 1.0)  # what it ran with
    finally:
        client.close()
        stop_server(running)
        engine.close()


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("{temperature: 0}", "--override-generation-config is not JSON"),
        ('{"max_new_tokens": 5}', "--override-generation-config takes a JSON object of"),
        ('{"top_p": 2}', "top_p must be in (0, 1], got 2"),
    ],
)
@pytest.mark.parametrize("several", [False, True])
def test_a_bad_override_is_refused_before_the_model_loads(
    llama_dir, tmp_path, override, message, several
):
    flags = ["--override-generation-config", override]
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        if several:  # several models, loaded when a request names one: refused at the start
            shutil.copytree(llama_dir, tmp_path / "models" / "llama")
            open_router(*serve_settings(["--models-dir", str(tmp_path / "models"), *flags]))
        else:
            open_server(*serve_settings([str(llama_dir), *flags]))
