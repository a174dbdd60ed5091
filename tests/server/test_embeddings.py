"""POST /v1/embeddings (through the openai client), Ollama's /api/embed and /api/embeddings
(through the ollama client and raw), and an engine of task embed, on real servers."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from live_server import MAX_SEQ_LEN, make_engine, serving

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed-size pages of the KV cache.",
    "Hello world! How are you today?",
]


@pytest.fixture(scope="module")
def hf_model(llama_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(llama_dir).eval()


def reference(hf_model, ids: list[int], dimensions: int | None = None) -> list[float]:
    """transformers' last hidden state (after the final norm) of the last token, cut to
    dimensions and L2-normalized: the served engine pools the last token."""
    with torch.no_grad():
        hidden = hf_model.model(torch.tensor([ids])).last_hidden_state[0, -1]
    return F.normalize(hidden[:dimensions], dim=-1).tolist()


def post(server, path: str, body: dict) -> httpx.Response:
    headers = {"Authorization": f"Bearer {server.api_key}"}
    return httpx.post(f"{server.base_url}{path}", json=body, headers=headers, timeout=60)


def encode(server, text: str) -> list[int]:
    return server.engine.tokenizer.encode(text)


def test_openai_client_embeddings_equal_transformers(server, openai_client, hf_model):
    """The client asks for base64 and decodes it; each vector is transformers' pooled hidden
    state, in input order, with usage counting every input's tokens."""
    reply = openai_client.embeddings.create(model=server.model_name, input=TEXTS)
    assert reply.model == server.model_name
    assert [d.index for d in reply.data] == [0, 1, 2]
    for text, item in zip(TEXTS, reply.data, strict=True):
        assert item.embedding == pytest.approx(reference(hf_model, encode(server, text)), abs=1e-5)
    tokens = sum(len(encode(server, text)) for text in TEXTS)
    assert (reply.usage.prompt_tokens, reply.usage.total_tokens) == (tokens, tokens)
    floats = openai_client.embeddings.create(
        model=server.model_name, input=TEXTS[0], encoding_format="float"
    )
    assert floats.data[0].embedding == pytest.approx(reply.data[0].embedding, abs=1e-6)


def test_inputs_of_token_ids_and_the_encodings(server, hf_model):
    ids = [encode(server, text) for text in TEXTS]
    by_lists = post(server, "/v1/embeddings", {"input": ids, "encoding_format": "float"}).json()
    one = post(server, "/v1/embeddings", {"input": ids[1]}).json()
    assert one["data"][0]["embedding"] == pytest.approx(by_lists["data"][1]["embedding"])
    assert one["usage"]["prompt_tokens"] == len(ids[1])
    as_base64 = post(server, "/v1/embeddings", {"input": ids[1], "encoding_format": "base64"})
    decoded = np.frombuffer(base64.b64decode(as_base64.json()["data"][0]["embedding"]), "<f4")
    assert decoded.tolist() == pytest.approx(one["data"][0]["embedding"])
    assert one["data"][0]["embedding"] == pytest.approx(reference(hf_model, ids[1]), abs=1e-5)


def test_dimensions_cut_and_renormalize(server, openai_client, hf_model):
    reply = openai_client.embeddings.create(model=server.model_name, input=TEXTS, dimensions=16)
    for text, item in zip(TEXTS, reply.data, strict=True):
        assert len(item.embedding) == 16
        expected = reference(hf_model, encode(server, text), dimensions=16)
        assert item.embedding == pytest.approx(expected, abs=1e-5)


def test_many_inputs_are_embedded_as_one_by_one(server):
    rng = np.random.default_rng(0)
    inputs = [rng.integers(4, 500, rng.integers(1, 200)).tolist() for _ in range(120)]
    batch = post(server, "/v1/embeddings", {"input": inputs}).json()["data"]
    for i in (0, 57, 119):
        alone = post(server, "/v1/embeddings", {"input": inputs[i]}).json()["data"][0]
        assert batch[i]["embedding"] == pytest.approx(alone["embedding"], abs=1e-5)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"input": ""}, "input: Value error, the input must not be empty"),
        ({"input": []}, "input must hold at least one text or token id"),
        ({"input": ["a", ""]}, "an input must not be empty"),
        ({"input": [[5, 6], []]}, "an input must not be empty"),
        (
            {"input": [[5], [5] * (MAX_SEQ_LEN + 1)]},
            f"input 1 has {MAX_SEQ_LEN + 1} tokens, but the most this server embeds at once "
            f"(its context length) is {MAX_SEQ_LEN} tokens",
        ),
        ({"input": [5, 99999]}, "input holds token ids outside the vocabulary"),
        ({"input": "Hi", "dimensions": 65}, "this model's embeddings have 64; ask for at most 64"),
        ({"input": "Hi", "encoding_format": "int8"}, "encoding_format: Input should be"),
        ({"input": "Hi", "model": "other"}, "the model 'other' does not exist"),
        ({"input": "Hi", "normalize": False}, "normalize: astrai does not know this field"),
    ],
)
def test_bad_requests_say_what_was_wrong(server, body, message):
    response = post(server, "/v1/embeddings", body)
    assert response.status_code == (404 if "model" in body else 400)
    assert message in response.json()["error"]["message"]


def test_truncate_prompt_tokens_keeps_the_last_tokens(server):
    ids = list(range(10, 10 + MAX_SEQ_LEN + 40))
    cut = post(server, "/v1/embeddings", {"input": ids, "truncate_prompt_tokens": 100}).json()
    tail = post(server, "/v1/embeddings", {"input": ids[-100:]}).json()
    assert cut["data"][0]["embedding"] == pytest.approx(tail["data"][0]["embedding"], abs=1e-6)
    assert cut["usage"]["prompt_tokens"] == 100


# Ollama


def ollama_client(server):
    ollama = pytest.importorskip("ollama")
    headers = {"Authorization": f"Bearer {server.api_key}"}
    return ollama.Client(host=server.base_url, headers=headers)


def test_ollama_client_embed(server, hf_model):
    client = ollama_client(server)
    reply = client.embed(model=server.model_name, input=TEXTS)
    assert reply.model == server.model_name
    assert len(reply.embeddings) == len(TEXTS)
    for text, vector in zip(TEXTS, reply.embeddings, strict=True):
        assert list(vector) == pytest.approx(reference(hf_model, encode(server, text)), abs=1e-5)
    assert reply.prompt_eval_count == sum(len(encode(server, t)) for t in TEXTS)
    assert reply.total_duration > 0 and reply.load_duration == 0
    one = client.embed(model=f"{server.model_name}:latest", input=TEXTS[0], dimensions=8)
    assert list(one.embeddings[0]) == pytest.approx(
        reference(hf_model, encode(server, TEXTS[0]), dimensions=8), abs=1e-5
    )
    legacy = client.embeddings(model=server.model_name, prompt=TEXTS[1])
    assert list(legacy.embedding) == pytest.approx(list(reply.embeddings[1]), abs=1e-6)


def test_ollama_truncate_and_num_ctx(server):
    text = "The quick brown fox jumps over the lazy dog. " * 10
    ids = encode(server, text)
    body = {"model": server.model_name, "input": text, "options": {"num_ctx": 20}}
    cut = post(server, "/api/embed", body).json()
    first = post(server, "/v1/embeddings", {"input": ids[:20]}).json()["data"][0]["embedding"]
    assert cut["embeddings"][0] == pytest.approx(first, abs=1e-6)
    assert cut["prompt_eval_count"] == 20
    refused = post(server, "/api/embed", {**body, "truncate": False})
    assert refused.status_code == 400
    assert refused.json() == {
        "error": f"input 0 has {len(ids)} tokens, but the context length is 20 tokens; shorten "
        "it, or send truncate true"
    }


def test_ollama_empty_inputs_embed_nothing(server):
    body = {"model": server.model_name, "input": []}
    assert post(server, "/api/embed", body).json()["embeddings"] == []
    legacy = {"model": server.model_name, "prompt": ""}
    assert post(server, "/api/embeddings", legacy).json() == {"embedding": []}


@pytest.mark.parametrize(
    ("path", "body", "status", "message"),
    [
        ("/api/embed", {"model": "llama3", "input": "Hi"}, 404, "the model 'llama3' does not"),
        ("/api/embed", {"model": None, "input": "Hi"}, 400, "model: Field required"),
        ("/api/embed", {"input": "Hi", "options": {"temperature": 0}}, 400, "options.temperature"),
        ("/api/embed", {"input": "Hi", "keep_alive": 0}, 400, "asks to unload the model"),
        ("/api/embeddings", {"prompt": "Hi", "keep_alive": "5m"}, 400, "after 300s, but a server"),
        ("/api/embed", {"input": "Hi", "dimensions": 100}, 400, "ask for at most 64"),
    ],
)
def test_ollama_errors_are_ollama_s_shape(server, path, body, status, message):
    body = {"model": server.model_name, **body}
    response = post(server, path, {k: v for k, v in body.items() if v is not None})
    assert response.status_code == status
    assert list(response.json()) == ["error"]
    assert message in response.json()["error"]


def test_ollama_keep_alive_for_ever_is_honoured(server):
    for keep_alive in ("-1m", -1):
        body = {"model": server.model_name, "input": "Hi", "keep_alive": keep_alive}
        assert post(server, "/api/embed", body).status_code == 200


# --task embed


def test_an_embedding_server_refuses_generation(llama_dir, hf_model):
    with serving(make_engine(llama_dir, task="embed")) as server:
        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        for path, body in (("/v1/chat/completions", chat), ("/v1/completions", {"prompt": "Hi"})):
            response = post(server, path, body)
            assert response.status_code == 400
            assert "serves embeddings only" in response.json()["error"]["message"]
        ollama = post(server, "/api/generate", {"model": server.model_name, "prompt": "Hi"})
        assert ollama.status_code == 400
        assert "serves embeddings only" in ollama.json()["error"]
        vector = post(server, "/v1/embeddings", {"input": TEXTS[0]}).json()["data"][0]
        expected = reference(hf_model, encode(server, TEXTS[0]))
        assert vector["embedding"] == pytest.approx(expected, abs=1e-5)


# LoRA


def test_the_model_field_picks_the_adapter_that_embeds(llama_dir, tmp_path):
    """/v1/embeddings and /api/embed under an adapter give PEFT's hidden states."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    from tiny_models import write_lora_adapter

    adapter = write_lora_adapter(llama_dir, tmp_path / "first", ("q_proj", "down_proj"), 4, 1)
    base = transformers.AutoModelForCausalLM.from_pretrained(llama_dir).eval()
    hf_model = peft.PeftModel.from_pretrained(base, adapter).base_model.model.eval()
    with serving(make_engine(llama_dir, loras={"first": str(adapter)})) as server:
        ids = encode(server, TEXTS[0])
        reply = post(server, "/v1/embeddings", {"model": "first", "input": ids}).json()
        assert reply["model"] == "first"
        assert reply["data"][0]["embedding"] == pytest.approx(reference(hf_model, ids), abs=1e-5)
        base_vector = post(server, "/v1/embeddings", {"input": ids}).json()["data"][0]
        assert base_vector["embedding"] != pytest.approx(reply["data"][0]["embedding"], abs=1e-3)
        ollama = post(server, "/api/embed", {"model": "first:latest", "input": TEXTS[0]}).json()
        assert ollama["embeddings"][0] == pytest.approx(reply["data"][0]["embedding"], abs=1e-6)
        unknown = post(server, "/v1/embeddings", {"model": "second", "input": ids})
        assert unknown.status_code == 404
