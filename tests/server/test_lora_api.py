"""LoRA adapters over HTTP: the model field picks one on every route, /v1/models and Ollama's
lists list them, vLLM's load and unload routes (below --lora-dir only, behind the key), under
load."""

from __future__ import annotations

import asyncio

import anthropic
import httpx
import openai
import pytest
from live_server import API_KEY, MODEL_NAME, make_engine, serving
from tiny_models import write_lora_adapter

from astrai.inference import GenerationParams, GenerationRequest

pytest.importorskip("peft")
CHAT = [{"role": "user", "content": "Hello world!"}]


@pytest.fixture(scope="module")
def lora_dir(llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("loras")
    write_lora_adapter(llama_dir, root / "first", ("q_proj", "v_proj", "down_proj"), 4, seed=1)
    write_lora_adapter(llama_dir, root / "second", ("o_proj", "up_proj"), 8, seed=2)
    return root


@pytest.fixture(scope="module")
def server(llama_dir, lora_dir):
    loras = {"first": str(lora_dir / "first")}
    engine = make_engine(llama_dir, loras=loras, max_loras=2, max_lora_rank=8)
    with serving(engine, lora_dir=str(lora_dir)) as running:
        yield running


def clients(server):
    return (
        openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0),
        anthropic.Anthropic(base_url=server.base_url, api_key=API_KEY, max_retries=0),
    )


def engine_chat(engine, lora=None) -> str:
    params = GenerationParams(max_tokens=12, temperature=0.0, lora=lora)
    return engine.generate(GenerationRequest(tuple(CHAT), params))


def test_the_model_field_picks_the_adapter_on_every_route(server):
    client, claude = clients(server)
    assert [m.id for m in client.models.list().data] == [MODEL_NAME, "first"]
    assert client.models.retrieve("first").model_extra["parent"] == MODEL_NAME
    expected = engine_chat(server.engine, "first")
    assert expected != engine_chat(server.engine)
    chat = client.chat.completions.create(
        model="first", messages=CHAT, max_tokens=12, temperature=0
    )
    assert (chat.model, chat.choices[0].message.content) == ("first", expected)
    message = claude.messages.create(
        model="first", messages=CHAT, max_tokens=12, extra_body={"temperature": 0}
    )
    assert (message.model, message.content[0].text) == ("first", expected)
    response = client.responses.create(
        model="first", input=CHAT, max_output_tokens=12, temperature=0
    )
    assert (response.model, response.output_text) == ("first", expected)
    completion = client.completions.create(
        model="first", prompt="The fox", max_tokens=8, temperature=0
    )
    params = GenerationParams(max_tokens=8, temperature=0.0, lora="first")
    assert completion.choices[0].text == server.engine.generate("The fox", params)
    with pytest.raises(openai.NotFoundError, match=r"serves \['tiny-llama', 'first'\]"):
        client.chat.completions.create(model="third", messages=CHAT, max_tokens=2)


def test_ollama_s_model_picks_the_adapter_and_its_lists_show_it(server):
    import ollama

    client = ollama.Client(host=server.base_url, headers={"Authorization": f"Bearer {API_KEY}"})
    listed = client.list().models
    assert [m.model for m in listed] == [MODEL_NAME, "first"]
    assert [m.details.parent_model for m in listed] == ["", MODEL_NAME]
    assert [m.model for m in client.ps().models] == [MODEL_NAME, "first"]
    options = {"temperature": 0, "num_predict": 12}
    reply = client.chat("first:latest", messages=CHAT, options=options)
    assert (reply.model, reply.message.content) == (
        "first:latest",
        engine_chat(server.engine, "first"),
    )


def test_adapters_load_and_unload_below_the_lora_dir_only(server, lora_dir, tmp_path):
    url = server.base_url
    key = {"Authorization": f"Bearer {API_KEY}"}
    load = {"lora_name": "second", "lora_path": "second"}
    assert httpx.post(f"{url}/v1/load_lora_adapter", json=load).status_code == 401
    for path in ("../", str(tmp_path), "first/../../"):
        reply = httpx.post(
            f"{url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": path}, headers=key
        )
        assert reply.status_code == 403, path
        assert "outside the server's --lora-dir" in reply.json()["error"]["message"]
    reply = httpx.post(f"{url}/v1/load_lora_adapter", json=load, headers=key)
    assert reply.status_code == 200, reply.text
    client, _ = clients(server)
    assert [m.id for m in client.models.list().data] == [MODEL_NAME, "first", "second"]
    second = client.chat.completions.create(
        model="second", messages=CHAT, max_tokens=12, temperature=0
    )
    assert second.choices[0].message.content == engine_chat(server.engine, "second")
    reply = httpx.post(
        f"{url}/v1/load_lora_adapter", json=load | {"lora_name": "third"}, headers=key
    )
    assert reply.status_code == 400
    assert "all 2 adapter slots are taken" in reply.json()["error"]["message"]
    reply = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "second"}, headers=key)
    assert reply.status_code == 200
    reply = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "second"}, headers=key)
    assert reply.status_code == 404
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="second", messages=CHAT, max_tokens=2)


def test_loading_is_off_without_a_lora_dir(llama_dir, lora_dir):
    with serving(make_engine(llama_dir, max_loras=1)) as running:
        reply = httpx.post(
            f"{running.base_url}/v1/load_lora_adapter",
            json={"lora_name": "first", "lora_path": str(lora_dir / "first")},
            headers={"Authorization": f"Bearer {API_KEY}"},
        )
    assert reply.status_code == 403
    assert "--lora-dir" in reply.json()["error"]["message"]


def test_load_and_unload_under_load_lose_no_request(server):
    """Streams on the base and on an adapter run while another adapter is loaded and unloaded
    again and again; every stream ends with a finish reason and the text it would alone."""
    client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)
    key = {"Authorization": f"Bearer {API_KEY}"}
    expected = {
        m: engine_chat(server.engine, None if m == MODEL_NAME else m) for m in (MODEL_NAME, "first")
    }

    async def stream(model: str) -> tuple[str, str]:
        chunks = await client.chat.completions.create(
            model=model, messages=CHAT, max_tokens=12, temperature=0, stream=True
        )
        text, reason = "", None
        async for chunk in chunks:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                reason = chunk.choices[0].finish_reason or reason
        return text, reason

    async def churn() -> int:
        async with httpx.AsyncClient(base_url=server.base_url, headers=key) as http:
            for _ in range(6):
                loaded = await http.post(
                    "/v1/load_lora_adapter", json={"lora_name": "second", "lora_path": "second"}
                )
                unloaded = await http.post("/v1/unload_lora_adapter", json={"lora_name": "second"})
                assert (loaded.status_code, unloaded.status_code) == (200, 200)
        return 6

    async def main():
        models = [MODEL_NAME, "first"] * 8
        return await asyncio.gather(churn(), *(stream(m) for m in models)), models

    (_, *results), models = asyncio.run(main())
    for model, (text, reason) in zip(models, results, strict=True):
        assert reason in ("stop", "length")
        assert text == expected[model]
