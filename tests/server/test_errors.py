"""Bad requests, auth, overload, disconnects, /health and /metrics against a real server."""

from __future__ import annotations

import asyncio
import time

import anthropic
import httpx
import openai
import pytest
from live_server import MAX_SEQ_LEN, make_engine, start_server, stop_server

from astrai.server import create_app

USER = [{"role": "user", "content": "Hello"}]


def post(server, path: str, body=None, *, key: str | None = "default", **kwargs) -> httpx.Response:
    headers = kwargs.pop("headers", {})
    if key is not None:
        headers["Authorization"] = f"Bearer {server.api_key if key == 'default' else key}"
    return httpx.post(f"{server.base_url}{path}", json=body, headers=headers, timeout=30, **kwargs)


def wait_until_idle(engine, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        stats = engine.get_stats()
        if stats.pages_owned == 0 and stats.running == 0 and stats.waiting == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"the engine did not go idle: {engine.get_stats()}")


def metric(server, name: str) -> float:
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    values = [line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")]
    assert values, f"{name} is not in /metrics"
    return float(values[0])


@pytest.fixture(autouse=True)
def server_keeps_serving(server, openai_client):
    yield
    reply = openai_client.completions.create(model=server.model_name, prompt="Hi", max_tokens=2)
    assert reply.choices[0].finish_reason in ("stop", "length")


CHAT_CASES = [
    ({"messages": USER, "max_tokens": 0}, "max_tokens"),
    ({"messages": USER, "max_tokens": -5}, "max_tokens"),
    ({"messages": USER, "max_completion_tokens": -1}, "max_tokens"),
    ({"messages": USER, "top_p": 2}, "top_p"),
    ({"messages": USER, "temperature": -1}, "temperature"),
    ({"messages": USER, "n": 0}, "n must"),
    ({"messages": USER, "logprobs": True, "top_logprobs": 50}, "logprobs"),
    ({"messages": USER, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "", "content": "hi"}]}, "messages.0.role"),  # custom roles are text
    ({"messages": [{"role": 5, "content": "hi"}]}, "messages.0.role"),
    ({"messages": [{"role": "tool", "content": "hi"}]}, "needs a tool_call_id"),
    ({"messages": "hello"}, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "image_url.url"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "text content"),
    ({"messages": USER, "max_tokens": "many"}, "max_tokens"),
    ({"messages": USER, "temperature": "hot"}, "temperature"),
    ({"messages": USER, "stop": 5}, "stop"),
    ({"messages": USER, "stream": "yes please"}, "stream"),
]


@pytest.mark.parametrize(("body", "named"), CHAT_CASES)
def test_bad_chat_requests_get_400_naming_the_problem(server, openai_client, body, named):
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.chat.completions.create(model=server.model_name, **body)
    assert caught.value.status_code == 400
    assert named in caught.value.message
    assert caught.value.body["type"] == "invalid_request_error"


def test_bad_completion_requests_get_400(server):
    for body, named in [
        ({"prompt": "Hi", "max_tokens": -1}, "max_tokens"),
        ({"prompt": "Hi", "logprobs": 21}, "logprobs"),
        ({"prompt": [], "max_tokens": 2}, "prompt"),
        ({"prompt": [10**9], "max_tokens": 2}, "token ids"),
        ({"max_tokens": 2}, "prompt"),
        ({"prompt": "Hi", "prompt_logprobs": 21}, "prompt_logprobs must be in [0, 20]"),
        ({"prompt": "Hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs are not"),
        ({"prompt": "Hi", "echo": True, "logprobs": 1, "n": 2, "stream": True}, "echo"),
    ]:
        response = post(server, "/v1/completions", {"model": server.model_name, **body})
        assert response.status_code == 400, body
        assert named in response.json()["error"]["message"], body


def test_a_prompt_that_does_not_fit_says_the_three_numbers(server, openai_client):
    prompt = "Paged attention stores keys and values. " * 40
    prompt_tokens = len(server.engine.tokenizer.encode(prompt))
    assert prompt_tokens + 20 > MAX_SEQ_LEN
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.completions.create(model=server.model_name, prompt=prompt, max_tokens=20)
    message = caught.value.message
    for number in (prompt_tokens, 20, MAX_SEQ_LEN):
        assert str(number) in message
    assert caught.value.code == "context_length_exceeded"
    # Without max_tokens the request still does not fit: it leaves no room to generate.
    with pytest.raises(openai.BadRequestError):
        openai_client.completions.create(model=server.model_name, prompt=prompt * 2)


def test_malformed_json_gets_400_in_each_shape(server):
    headers = {"Content-Type": "application/json"}
    response = post(server, "/v1/chat/completions", content=b'{"messages": [', headers=headers)
    assert response.status_code == 400
    assert "JSON" in response.json()["error"]["message"]
    response = post(server, "/v1/messages", content=b"{not json", headers=headers)
    assert response.status_code == 400
    body = response.json()
    assert body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    assert "JSON" in body["error"]["message"]


def test_unknown_fields_are_refused_and_metadata_is_not(server):
    body = {"model": server.model_name, "messages": USER, "max_tokens": 2}
    assert post(server, "/v1/chat/completions", {**body, "user": "me", "tools": []}).is_success
    refused = post(server, "/v1/chat/completions", {**body, "frobnicate": [1]})
    assert refused.status_code == 400
    assert "frobnicate" in refused.json()["error"]["message"]
    assert post(server, "/v1/messages", {**body, "metadata": {"user_id": "a"}}).is_success
    refused = post(server, "/v1/messages", {**body, "frobnicate": 3})
    assert refused.status_code == 400
    assert "frobnicate" in refused.json()["error"]["message"]


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"messages": USER, "max_tokens": 0}, "max_tokens"),
        ({"messages": USER}, "max_tokens"),
        ({"messages": USER, "max_tokens": 5, "top_p": 2}, "top_p"),
        ({"messages": [], "max_tokens": 5}, "messages"),
        ({"messages": [{"role": "system", "content": "x"}], "max_tokens": 5}, "messages.0.role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image"}]}], "max_tokens": 5},
            "source",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "document"}]}], "max_tokens": 5},
            "text",
        ),
        ({"messages": USER, "max_tokens": 5, "stop_sequences": "END"}, "stop_sequences"),
    ],
)
def test_bad_messages_get_anthropic_errors(server, body, named):
    response = httpx.post(
        f"{server.base_url}/v1/messages",
        json={"model": server.model_name, **body},
        headers={"x-api-key": server.api_key},
        timeout=30,
    )
    assert response.status_code == 400
    error = response.json()
    assert error["type"] == "error"
    assert error["error"]["type"] == "invalid_request_error"
    assert named in error["error"]["message"]


def test_the_anthropic_client_sees_bad_requests(server, anthropic_client):
    with pytest.raises(anthropic.BadRequestError) as caught:
        anthropic_client.messages.create(model=server.model_name, messages=USER, max_tokens=0)
    assert "max_tokens" in caught.value.body["error"]["message"]


def test_missing_or_wrong_api_key_gets_401(server):
    for key in (None, "wrong"):
        response = post(server, "/v1/chat/completions", {"messages": USER}, key=key)
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"
        response = post(server, "/v1/messages", {"max_tokens": 1}, key=key)
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"
    bad = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    bad = anthropic.Anthropic(base_url=server.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        bad.messages.create(model=server.model_name, messages=USER, max_tokens=1)
    # Either header works on either API.
    body = {"model": server.model_name, "messages": USER, "max_tokens": 1}
    headers = {"x-api-key": server.api_key}
    assert post(server, "/v1/chat/completions", body, key=None, headers=headers).is_success
    assert post(server, "/v1/messages", body).is_success


def test_unknown_model_gets_404(server, openai_client, anthropic_client):
    with pytest.raises(openai.NotFoundError) as caught:
        openai_client.chat.completions.create(model="gpt-9", messages=USER, max_tokens=1)
    assert "gpt-9" in caught.value.message
    with pytest.raises(openai.NotFoundError):
        openai_client.models.retrieve("gpt-9")
    with pytest.raises(anthropic.NotFoundError) as caught:
        anthropic_client.messages.create(model="claude-9", messages=USER, max_tokens=1)
    assert caught.value.body["error"]["type"] == "not_found_error"
    assert post(server, "/v1/no-such-endpoint", {}).status_code == 404


def test_health(server):
    response = httpx.get(f"{server.base_url}/health", timeout=10)
    assert response.status_code == 200
    assert response.json()["status"] == "ok"


def test_metrics_count_requests_tokens_and_latency(server, openai_client):
    before = metric(server, "astrai_generation_tokens_total")
    openai_client.completions.create(
        model=server.model_name, prompt="Hello", max_tokens=4, extra_body={"ignore_eos": True}
    )
    assert metric(server, "astrai_generation_tokens_total") == before + 4
    post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": -1})
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    assert 'astrai_http_requests_total{endpoint="/v1/completions",status="200"}' in text
    assert 'astrai_http_requests_total{endpoint="/v1/completions",status="400"}' in text
    assert metric(server, "astrai_time_to_first_token_seconds_count") > 0
    assert metric(server, "astrai_inter_token_latency_seconds_count") > 0
    assert metric(server, "astrai_prompt_tokens_total") > 0
    for name in (
        "astrai_requests_running",
        "astrai_requests_waiting",
        "astrai_kv_pages_owned",
        "astrai_kv_pages_cached",
        "astrai_prefix_cache_hit_rate",
        "astrai_preemptions_total",
    ):
        metric(server, name)


def test_disconnect_mid_stream_frees_the_pages(server):
    body = {
        "model": server.model_name,
        "messages": USER,
        "max_tokens": 200,
        "stream": True,
        "ignore_eos": True,
    }
    headers = {"Authorization": f"Bearer {server.api_key}"}
    generated_before = server.engine.get_stats().generation_tokens
    with httpx.stream(
        "POST", f"{server.base_url}/v1/chat/completions", json=body, headers=headers, timeout=30
    ) as response:
        lines = response.iter_lines()
        for _ in range(6):
            next(lines)
        assert server.engine.get_stats().pages_owned > 0
    wait_until_idle(server.engine)
    assert metric(server, "astrai_kv_pages_owned") == 0
    # aborted, not run to the end: far fewer than the 200 tokens asked for were generated
    assert server.engine.get_stats().generation_tokens - generated_before < 100


def test_clients_that_give_up_leave_the_server_responsive(server):
    body = {
        "model": server.model_name,
        "prompt": "Hello world",
        # near the server's 256-token context: none of 200 ends within the clients' 0.05 s
        "max_tokens": 240,
        "ignore_eos": True,
    }
    headers = {"Authorization": f"Bearer {server.api_key}"}

    async def give_up(client: httpx.AsyncClient) -> None:
        with pytest.raises(httpx.TimeoutException):
            await client.post(f"{server.base_url}/v1/completions", json=body, headers=headers)

    async def flood() -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=0.05, limits=limits) as client:
            await asyncio.gather(*(give_up(client) for _ in range(200)))

    asyncio.run(flood())
    start = time.monotonic()
    fresh = post(server, "/v1/completions", {**body, "max_tokens": 4})
    assert fresh.status_code == 200
    assert time.monotonic() - start < 5
    wait_until_idle(server.engine)


def test_a_full_queue_gets_503_at_once(llama_dir):
    engine = make_engine(llama_dir, max_batch_size=1, max_waiting=1, max_seq_len=1024)
    running = start_server(create_app(engine, "tiny"))
    base = f"http://127.0.0.1:{running.port}"
    body = {"prompt": "Hello", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    try:
        url = f"{base}/v1/completions"
        with httpx.stream("POST", url, json=body, timeout=30) as first:
            lines = first.iter_lines()  # dropping the iterator would close the response
            next(lines)  # the first request runs and holds the only batch slot
            with httpx.stream("POST", url, json=body, timeout=30) as second:
                assert second.status_code == 200  # accepted: it waits in the queue
                assert engine.get_stats().waiting == 1
                started = time.monotonic()
                third = httpx.post(url, json=body, timeout=30)
                assert third.status_code == 503
                assert time.monotonic() - started < 2
                assert "queue" in third.json()["error"]["message"]
                anthropic_body = {"messages": USER, "max_tokens": 5}
                refused = httpx.post(f"{base}/v1/messages", json=anthropic_body, timeout=30)
                assert refused.status_code == 503
                assert refused.json()["error"]["type"] == "overloaded_error"
        wait_until_idle(engine)
    finally:
        stop_server(running)
        engine.close()


def test_a_batch_is_queued_whole_or_refused_whole(server, openai_client):
    long_prompt = "Paged attention stores keys and values. " * 40
    admitted = server.engine.get_stats().prompt_tokens
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.completions.create(
            model=server.model_name, prompt=["Hi", long_prompt], max_tokens=20
        )
    assert caught.value.code == "context_length_exceeded"
    # more samples than the waiting queue could ever hold: retrying would not help, so 400
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.completions.create(
            model=server.model_name, prompt=["Hi"] * 9, n=128, max_tokens=2
        )
    assert "1152 places" in caught.value.message
    wait_until_idle(server.engine)
    assert server.engine.get_stats().prompt_tokens == admitted
