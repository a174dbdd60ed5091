"""Replicas on Ray Serve: two demo-model engines on a local Ray cluster, reached through Ray's
HTTP proxy with the official `openai` and `anthropic` clients."""

from __future__ import annotations

import asyncio
import collections
import re
import socket
import time
from dataclasses import dataclass

import anthropic
import httpx
import openai
import pytest
import ray
from ray import serve

from astrai.config import ConfigError
from astrai.deploy import app, build_app, prompt_text
from astrai.flags import serve_settings
from astrai.inference import GenerationParams, GenerationRequest
from astrai.launch import open_server

API_KEY = "test-key"
SERVE_FLAGS = ["--api-key", API_KEY, "--max-batch-size", "32", "--kv-cache-memory", "33554432"]
MODEL = "demo"  # the name the server gives the demo model
REPLICA = "x-astrai-replica"
# Long enough to fill several KV pages, so a replica that has seen it serves it from its cache.
SHARED_SYSTEM = "You answer questions about paged attention and continuous batching. " * 8


@dataclass
class Stream:
    replica: str
    text: str
    finish_reason: str
    started: float  # the response's headers arrived
    ended: float  # its last chunk arrived


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def base_url(tmp_path_factory):
    """Two replicas (half a CPU each, a torch thread each) behind Ray Serve's proxy."""
    env = {
        "RAY_USAGE_STATS_ENABLED": "0",
        # The replicas keep their kernel timings out of the user's cache, as every test does.
        "ASTRAI_CACHE_DIR": str(tmp_path_factory.mktemp("astrai-cache")),
    }
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        application = build_app(num_replicas=2, replica_cpus=0.5, serve_flags=SERVE_FLAGS)
        serve.run(application, name="astrai", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def local_engine():
    """The engine each replica runs, here in the test's process."""
    engine, _ = open_server(*serve_settings(SERVE_FLAGS))
    with engine:
        yield engine


def chat(question: str, system: str = "Be brief.") -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def test_64_concurrent_streams_complete_on_both_replicas(base_url, local_engine):
    client = openai.AsyncOpenAI(
        base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60
    )
    # Prompts that share no prefix worth following, so the router spreads them.
    conversations = [[{"role": "user", "content": f"{i} pages: why?"}] for i in range(64)]

    async def stream(messages) -> Stream:
        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, max_tokens=8, temperature=0, stream=True
        )
        started = time.monotonic()
        chunks = [chunk async for chunk in raw.parse()]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        reason = chunks[-1].choices[0].finish_reason
        return Stream(raw.headers[REPLICA], text, reason, started, time.monotonic())

    async def stream_all() -> list[Stream]:
        async with asyncio.timeout(90):
            return await asyncio.gather(*(stream(messages) for messages in conversations))

    streams = asyncio.run(stream_all())
    params = GenerationParams(max_tokens=8, temperature=0)
    expected = local_engine.generate([GenerationRequest(tuple(c), params) for c in conversations])
    assert [s.text for s in streams] == expected
    assert all(s.finish_reason in ("stop", "length") for s in streams)
    served = collections.Counter(s.replica for s in streams)
    assert len(served) == 2, served
    # They ran at once, not a few at a time behind the ingress.
    most_at_once = max(sum(o.started <= s.started < o.ended for o in streams) for s in streams)
    assert most_at_once >= 16, most_at_once  # Ray's default would allow 5


def test_a_shared_prefix_series_goes_to_the_replica_that_cached_it(base_url):
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    replicas, cached = set(), []
    for i in range(8):
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=chat(f"Question {i}?", SHARED_SYSTEM), max_tokens=2
        )
        replicas.add(raw.headers[REPLICA])
        cached.append(raw.parse().usage.prompt_tokens_details.cached_tokens)
    assert len(replicas) == 1
    # Only the first request computes the shared system prompt.
    assert cached[0] == 0 and min(cached[1:]) >= 64, cached


def test_anthropic_stream_and_the_other_routes_pass_through(base_url, local_engine):
    client = anthropic.Anthropic(base_url=base_url, api_key=API_KEY, max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "Hello world!"}]
    greedy = {"temperature": 0}  # the client no longer takes it; the API still does
    with client.messages.stream(
        model=MODEL, system="Be brief.", messages=messages, max_tokens=8, extra_body=greedy
    ) as stream:
        text = "".join(stream.text_stream)
    request = GenerationRequest(tuple(chat("Hello world!")), GenerationParams(max_tokens=8))
    assert text == local_engine.generate(request, temperature=0)

    keyed = {"Authorization": f"Bearer {API_KEY}"}
    assert httpx.get(f"{base_url}/v1/models", headers=keyed).json()["data"][0]["id"] == MODEL
    assert httpx.get(f"{base_url}/v1/models").status_code == 401  # the replica's own auth
    assert httpx.get(f"{base_url}/health").json() == {"status": "ok", "model": MODEL}
    assert "astrai_prefix_cache_hit_rate" in httpx.get(f"{base_url}/metrics").text


def test_a_client_gone_mid_stream_stops_its_generation(base_url):
    before = replica_metrics(base_url)
    body = {
        "model": MODEL,
        "messages": chat("Count pages."),
        "max_tokens": 2000,
        "ignore_eos": True,
        "stream": True,
    }
    keyed = {"Authorization": f"Bearer {API_KEY}"}
    url = f"{base_url}/v1/chat/completions"
    with httpx.stream("POST", url, json=body, headers=keyed, timeout=60) as response:
        replica = response.headers[REPLICA]
        next(response.iter_lines())  # generating; leaving the block drops the connection
    deadline = time.monotonic() + 30
    while "astrai_requests_running 1.0" in (after := replica_metrics(base_url))[replica]:
        assert time.monotonic() < deadline, "the generation went on"
    generated = metric(after[replica], "astrai_generation_tokens_total")
    assert generated - metric(before[replica], "astrai_generation_tokens_total") < 1000


def replica_metrics(base_url: str) -> dict[str, str]:
    """Each replica's /metrics, read until both have answered (Ray picks one at random)."""
    answers, deadline = {}, time.monotonic() + 30
    while len(answers) < 2:
        assert time.monotonic() < deadline, f"only {sorted(answers)} answered /metrics"
        response = httpx.get(f"{base_url}/metrics")
        answers[response.headers[REPLICA]] = response.text
    return answers


def metric(text: str, name: str) -> float:
    return float(re.search(rf"^{name} (\S+)$", text, re.MULTILINE).group(1))


def test_prompt_text_is_what_the_prompt_starts_with():
    openai_chat = b"""{"model": "m", "messages": [
        {"role": "system", "content": "Sys. "},
        {"role": "user", "content": [{"type": "text", "text": "Look "}, {"type": "image_url"}]},
        {"role": "user", "content": "here"}]}"""
    assert prompt_text(openai_chat) == "Sys. Look here"
    anthropic_messages = b"""{"system": [{"type": "text", "text": "Sys. "}],
        "messages": [{"role": "user", "content": [{"type": "tool_result", "content": "42"}]}]}"""
    assert prompt_text(anthropic_messages) == "Sys. 42"
    assert prompt_text(b'{"prompt": ["Once upon", " a time"]}') == "Once upon a time"
    assert prompt_text(b'{"prompt": [1, 2, 3]}') == ""
    assert prompt_text(b"not json") == prompt_text(b"[1]") == prompt_text(b"") == ""


def test_build_app_refuses_settings_it_cannot_serve():
    with pytest.raises(ConfigError, match="num_replicas must be at least 1"):
        build_app(num_replicas=0)
    with pytest.raises(ConfigError, match="max_replicas"):
        build_app(num_replicas=3, max_replicas=2)
    with pytest.raises(ConfigError, match="unrecognized arguments: --no-such-flag"):
        build_app(serve_flags=["--no-such-flag"])
    with pytest.raises(ConfigError, match="max_batch_size"):
        build_app(serve_flags=["--max-batch-size", "0"])
    with pytest.raises(ConfigError, match="--port has no effect"):
        build_app(serve_flags=["--port", "9000"])
    # `serve run astrai.deploy:app serve_flags="..."` splits the flags as a shell does.
    with pytest.raises(ConfigError, match="unrecognized arguments: --no-such-flag"):
        app({"serve_flags": "--max-batch-size 8 --no-such-flag"})
