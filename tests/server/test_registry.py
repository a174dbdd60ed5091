"""`astrai serve --models-dir`: several models behind one server, each loaded when a request
names it, unloaded when idle or to make room, answering as a server of that model alone does."""

from __future__ import annotations

import asyncio
import importlib
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

import httpx
import huggingface_hub.constants
import ollama
import openai
import pytest
from live_server import make_engine, serving, start_server, stop_server
from serve_process import astrai_serve
from tiny_models import add_snapshot, write_gguf, write_hf_model

from astrai.cli import main
from astrai.config import ConfigError
from astrai.flags import serve_settings
from astrai.launch import open_router
from astrai.server.registry import ModelRegistry

ENGINE_FLAGS = ("--max-seq-len", "256", "--kv-cache-memory", str(64 << 20))
PROMPTS = ("Hello world!", "How are you today?", "The quick brown fox")
# The test tokenizer has 400 tokens: models of that vocabulary write the same text from a GGUF
# file (whose vocabulary is the tokenizer's) as from their directory.
VOCAB = 400


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory) -> Path:
    """A llama directory, a GGUF file of another llama one level down (as LM Studio keeps
    them), and a vision projector that is no model of its own."""
    root = tmp_path_factory.mktemp("models")
    write_hf_model(root / "llama", "llama", seed=1, vocab_size=VOCAB)
    other = write_hf_model(
        tmp_path_factory.mktemp("hf") / "other", "llama", seed=2, vocab_size=VOCAB
    )
    (root / "family").mkdir()
    write_gguf(root / "family" / "tiny.gguf", other, "llama", tokenizer=True)
    (root / "mmproj-tiny.gguf").write_bytes(b"GGUF")
    return root


MODELS = ("family/tiny.gguf", "llama")


@pytest.fixture(scope="module")
def expected(models_dir) -> dict[tuple[str, str], str]:
    """The greedy answer of each model to each prompt, from a server of that model alone."""
    answers = {}
    for name in MODELS:
        with serving(make_engine(models_dir / name)) as server:
            client = openai.OpenAI(
                base_url=f"{server.base_url}/v1", api_key=server.api_key, max_retries=0
            )
            for prompt in PROMPTS:
                answers[name, prompt] = _chat(client, server.model_name, prompt)
    assert answers[MODELS[0], PROMPTS[0]] != answers[MODELS[1], PROMPTS[0]]
    return answers


def _chat(client: openai.OpenAI, model: str, prompt: str, stream: bool = False) -> str:
    messages = [{"role": "user", "content": prompt}]
    if not stream:
        reply = client.chat.completions.create(
            model=model, messages=messages, max_tokens=8, temperature=0
        )
        return reply.choices[0].message.content
    chunks = client.chat.completions.create(
        model=model, messages=messages, max_tokens=8, temperature=0, stream=True
    )
    return "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)


@contextmanager
def router(models_dir: Path | None, *flags: str) -> Iterator[tuple[str, ModelRegistry]]:
    """`astrai serve --models-dir models_dir` (None: no --models-dir) with flags, as the command
    opens it, on a loopback port: (its base URL, its registry)."""
    given = [] if models_dir is None else ["--models-dir", str(models_dir)]
    args, config = serve_settings([*given, *ENGINE_FLAGS, *flags])
    models, app = open_router(args, config)
    running = start_server(app)
    try:
        yield f"http://127.0.0.1:{running.port}", models
    finally:
        stop_server(running)
        models.close()


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)


def _statuses(base: str) -> dict[str, str]:
    cards = httpx.get(f"{base}/v1/models", timeout=10).json()["data"]
    return {card["id"]: card["status"]["value"] for card in cards}


def _count_loads(models: ModelRegistry) -> dict[str, int]:
    """How often each model is loaded from now on."""
    loads = dict.fromkeys(models.models, 0)
    for model in models.models.values():

        def load(model=model, load=model.load):
            loads[model.name] += 1
            return load()

        model.load = load
    return loads


def test_models_are_listed_and_each_answers_as_served_alone(models_dir, expected):
    with router(models_dir) as (base, models):
        assert _statuses(base) == dict.fromkeys(MODELS, "unloaded")
        tags = httpx.get(f"{base}/api/tags", timeout=10).json()["models"]
        assert [tag["name"] for tag in tags] == list(MODELS)
        assert httpx.get(f"{base}/api/ps", timeout=10).json()["models"] == []
        # Ollama's clients name a model with its tag, and read how long it took to load.
        generate = {"model": "llama:latest", "prompt": "Hi", "stream": False}
        generate["options"] = {"num_predict": 2}
        loads = [
            httpx.post(f"{base}/api/generate", json=generate, timeout=60).json()["load_duration"]
            for _ in range(2)
        ]
        assert loads[0] > 0 and loads[1] == 0
        client = _client(base)
        for name in MODELS:
            for prompt in PROMPTS:
                assert _chat(client, name, prompt) == expected[name, prompt]
        assert _statuses(base) == dict.fromkeys(MODELS, "loaded")
        # --kv-cache-memory is shared by the models loaded at once: here both.
        budgets = [model.service.engine.config.kv_cache_memory for model in models.loaded()]
        assert budgets == [(64 << 20) // 2] * 2
        running = httpx.get(f"{base}/api/ps", timeout=10).json()["models"]
        assert sorted(entry["name"] for entry in running) == sorted(MODELS)


def test_two_models_interleaved_under_load_with_one_loaded_at_a_time(models_dir, expected):
    """Requests to both models at once, streamed and not, on a server that holds one model:
    each waits for its model, none is lost or answered by the other model, and no model is
    unloaded under a request (a stream included)."""
    with router(models_dir, "--max-loaded-models", "1") as (base, models):
        loads = _count_loads(models)
        most_loaded, polling = 0, True

        def poll() -> None:
            nonlocal most_loaded
            while polling:
                loaded = sum(s == "loaded" for s in _statuses(base).values())
                most_loaded = max(most_loaded, loaded)
                time.sleep(0.01)

        poller = threading.Thread(target=poll)
        poller.start()
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        jobs = [(MODELS[i % 2], PROMPTS[i % len(PROMPTS)], i % 4 >= 2) for i in range(24)]

        async def ask(model: str, prompt: str, stream: bool) -> str:
            messages = [{"role": "user", "content": prompt}]
            settings = dict(model=model, messages=messages, max_tokens=8, temperature=0)
            if not stream:
                reply = await client.chat.completions.create(**settings)
                return reply.choices[0].message.content
            chunks = await client.chat.completions.create(**settings, stream=True)
            return "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])

        async def ask_all() -> list[str]:
            return await asyncio.gather(*(ask(*job) for job in jobs))

        try:
            answers = asyncio.run(ask_all())
        finally:
            polling = False
            poller.join()
        assert answers == [expected[model, prompt] for model, prompt, _ in jobs]
        assert most_loaded == 1
        assert all(count >= 1 for count in loads.values()), loads
        assert sum(s == "loaded" for s in _statuses(base).values()) == 1


def test_requests_for_a_loading_model_wait_for_one_load(models_dir, expected):
    with router(models_dir) as (base, models):
        loads = _count_loads(models)
        client = _client(base)

        def ask(prompt: str) -> str:
            return _chat(client, "llama", prompt)

        threads_answers: list[str] = []
        threads = [
            threading.Thread(target=lambda p=p: threads_answers.append((p, ask(p))))
            for p in PROMPTS * 2
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert sorted(threads_answers) == sorted((p, expected["llama", p]) for p in PROMPTS * 2)
        assert loads == {"family/tiny.gguf": 0, "llama": 1}


def test_an_idle_model_is_unloaded_and_loads_again(models_dir, expected):
    with router(models_dir, "--idle-unload", "0.3") as (base, models):
        client = _client(base)
        prompt = PROMPTS[0]
        assert _chat(client, "llama", prompt, stream=True) == expected["llama", prompt]
        assert _statuses(base)["llama"] == "loaded"
        deadline = time.monotonic() + 10
        while _statuses(base)["llama"] != "unloaded":
            assert time.monotonic() < deadline, "the idle model was not unloaded"
            time.sleep(0.05)
        assert httpx.get(f"{base}/api/ps", timeout=10).json()["models"] == []
        assert _chat(client, "llama", prompt) == expected["llama", prompt]


def _unloaded_after(base: str, name: str, start: float, within: float) -> float:
    """Seconds from start until the model name is unloaded (a failure past within)."""
    while _statuses(base)[name] != "unloaded":
        assert time.monotonic() - start < within, f"{name} was not unloaded in {within}s"
        time.sleep(0.05)
    return time.monotonic() - start


def _expires_in(base: str) -> dict[str, float]:
    """Seconds until each loaded model is unloaded, as /api/ps says."""
    running = httpx.get(f"{base}/api/ps", timeout=10).json()["models"]
    now = datetime.now(UTC)
    return {
        entry["name"]: (datetime.fromisoformat(entry["expires_at"]) - now).total_seconds()
        for entry in running
    }


def test_ollama_keep_alive_sets_how_long_each_model_stays_loaded(models_dir):
    """Over real HTTP with Ollama's client, on a router whose default --idle-unload is a minute:
    a time unloads the model that long after its request, 0 once the answer is sent, a negative
    time never, none the default again; keep_alive 0 without a prompt (`ollama stop`) unloads
    the model at once."""
    with router(models_dir, "--idle-unload", "60") as (base, models):
        client = ollama.Client(host=base, timeout=60)
        options = {"num_predict": 2, "temperature": 0}
        client.generate("llama", "Hi", options=options, keep_alive=-1)
        client.chat("family/tiny.gguf", [{"role": "user", "content": "Hi"}], keep_alive="2s")
        answered = time.monotonic()
        expires = _expires_in(base)
        assert expires["llama"] > 1e9  # Ollama's far date for a model kept for ever
        assert 0 < expires["family/tiny.gguf"] <= 2
        assert _unloaded_after(base, "family/tiny.gguf", answered, within=20) > 1.9
        assert _statuses(base)["llama"] == "loaded"

        client.generate("family/tiny.gguf", "Hi", options=options, keep_alive=0)
        _unloaded_after(base, "family/tiny.gguf", time.monotonic(), within=10)

        client.generate("llama", "Hi", options=options)
        assert 50 < _expires_in(base)["llama"] <= 60  # --idle-unload again
        stopped = client.generate("llama", keep_alive=0)
        assert (stopped.done, stopped.done_reason) == (True, "unload")
        assert _statuses(base) == dict.fromkeys(MODELS, "unloaded")
        assert client.generate("llama", keep_alive=0).done_reason == "unload"  # loads nothing
        assert _statuses(base)["llama"] == "unloaded"


def test_hub_ids_from_the_cache_and_files_by_model_repeated(
    models_dir, expected, tmp_path, monkeypatch
):
    """`--model` given more than once serves each, a hub id from the local cache among them."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    importlib.reload(huggingface_hub.constants)  # it reads the environment once, at import
    try:
        add_snapshot(tmp_path / "hf" / "hub", "org/tiny", "a" * 40, models_dir / "llama", "main")
        gguf = models_dir / "family" / "tiny.gguf"
        with router(None, "--model", "org/tiny", "--model", str(gguf)) as (base, _):
            assert _statuses(base) == {"org/tiny": "unloaded", "tiny.gguf": "unloaded"}
            client = _client(base)
            assert _chat(client, "org/tiny", PROMPTS[0]) == expected["llama", PROMPTS[0]]
            assert _chat(client, "tiny.gguf", PROMPTS[0]) == expected[MODELS[0], PROMPTS[0]]
    finally:
        monkeypatch.undo()
        importlib.reload(huggingface_hub.constants)


def test_unknown_or_missing_model_names_the_served_ones(models_dir):
    with router(models_dir) as (base, _):
        body = {"model": "nope", "messages": [{"role": "user", "content": "Hi"}]}
        reply = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=10)
        assert reply.status_code == 404
        error = reply.json()["error"]
        assert error["code"] == "model_not_found"
        assert all(name in error["message"] for name in MODELS)
        del body["model"]
        reply = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=10)
        assert reply.status_code == 400
        assert "several models" in reply.json()["error"]["message"]
        assert httpx.get(f"{base}/v1/models/nope", timeout=10).status_code == 404
        assert _statuses(base) == dict.fromkeys(MODELS, "unloaded")


def test_a_model_that_fails_to_load_is_a_500_and_the_others_serve(models_dir, tmp_path, expected):
    for name in MODELS:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).symlink_to(models_dir / name)
    (tmp_path / "broken.gguf").write_bytes(b"GGUF" + bytes(20))
    with router(tmp_path) as (base, _):
        body = {"model": "broken.gguf", "messages": [{"role": "user", "content": "Hi"}]}
        reply = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=30)
        assert reply.status_code == 500
        assert "'broken.gguf' failed to load" in reply.json()["error"]["message"]
        assert _statuses(base)["broken.gguf"] == "unloaded"
        assert _chat(_client(base), "llama", PROMPTS[0]) == expected["llama", PROMPTS[0]]


@pytest.mark.parametrize(
    "flags, refused",
    [
        (["--lora", "adapter"], "--lora"),
        (["--lora-dir", "."], "--lora-dir"),
        (["--served-model-name", "x"], "--model-name"),
    ],
)
def test_one_models_flags_are_refused_with_several(models_dir, flags, refused):
    args, config = serve_settings(["--models-dir", str(models_dir), *flags])
    with pytest.raises(ConfigError, match=f"{refused}.*several models"):
        open_router(args, config)


def test_router_flags_need_several_models(llama_dir, capsys):
    assert main(["serve", str(llama_dir), "--idle-unload", "5", "--port", "0"]) == 1
    assert "--idle-unload are for several models" in capsys.readouterr().err


def test_memory_goes_back_when_a_model_is_unloaded(tmp_path):
    """The RSS of an `astrai serve` process falls by about the model's weights when it unloads
    the model, and again after it loads it a second time."""
    models = tmp_path / "models"
    big = write_hf_model(
        models / "big",
        "llama",
        vocab_size=VOCAB,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
    )
    weights = (big / "model.safetensors").stat().st_size
    flags = ("--models-dir", str(models), "--idle-unload", "0.5", *ENGINE_FLAGS)
    with astrai_serve(None, *flags) as (process, base):

        def rss() -> int:
            status = Path(f"/proc/{process.pid}/status").read_text()
            [line] = [line for line in status.splitlines() if line.startswith("VmRSS:")]
            return int(line.split()[1]) * 1024

        def load_and_unload() -> tuple[int, int]:
            _chat(_client(base), "big", PROMPTS[0])
            loaded = rss()
            deadline = time.monotonic() + 30
            while _statuses(base)["big"] != "unloaded":
                assert time.monotonic() < deadline, "the idle model was not unloaded"
                time.sleep(0.1)
            return loaded, rss()

        loaded, unloaded = load_and_unload()
        assert loaded - unloaded > 0.8 * weights, (loaded, unloaded, weights)
        # Loaded again, it takes its memory once more, no leftover of the first load beside it.
        again, unloaded_again = load_and_unload()
        assert again - unloaded_again > 0.8 * weights, (again, unloaded_again, weights)
        assert again < loaded + 0.5 * weights, (loaded, again, weights)
