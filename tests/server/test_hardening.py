"""Hostile clients against a real server: oversized and slow requests, bad text, foreign hosts,
internals in errors, and a SIGTERM in the middle of running streams."""

from __future__ import annotations

import functools
import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

import anthropic
import httpx
import pytest
from live_server import API_KEY, MODEL_NAME, make_engine, start_server, stop_server
from serve_process import astrai_serve

from astrai.server import create_app
from astrai.server.limits import StrictH11Protocol

LIMIT = 64 << 10
READ_TIMEOUT = 1.0
# Long enough for any deadline above to have passed on a busy machine, short enough to fail fast.
PATIENCE = READ_TIMEOUT + 4


@pytest.fixture(scope="module")
def engine(llama_dir):
    engine = make_engine(llama_dir)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def hardened(engine):
    """A keyless server with a small body limit and a short read timeout; yields its port."""
    app = create_app(engine, MODEL_NAME, max_request_bytes=LIMIT, read_timeout=READ_TIMEOUT)
    protocol = functools.partial(StrictH11Protocol, header_timeout=READ_TIMEOUT)
    running = start_server(app, http=protocol)
    yield running.port
    stop_server(running)


@pytest.fixture
def serve_app():
    """Start apps on servers of their own; each is stopped after the test."""
    started = []

    def serve(app) -> str:
        started.append(start_server(app))
        return f"http://127.0.0.1:{started[-1].port}"

    yield serve
    for running in started:
        stop_server(running)


def exchange(port: int, *parts: bytes, pause: float = 0.0) -> tuple[bytes, bool]:
    """Send parts (pause seconds apart), then read until the server closes or PATIENCE runs out.

    Returns what the server sent and whether it closed the connection.
    """
    with socket.create_connection(("127.0.0.1", port)) as sock:
        for part in parts:
            try:
                sock.sendall(part)
            except OSError:  # the server closed the connection already
                break
            time.sleep(pause)
        received = b""
        deadline = time.monotonic() + PATIENCE
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                return received, False
            except ConnectionResetError:
                return received, True
            if not chunk:
                return received, True
            received += chunk
        return received, False


def head(path: str, *headers: str, method: str = "POST") -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", *headers, "", ""]
    return "\r\n".join(lines).encode()


# -- request bodies ---------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/messages"])
def test_a_body_declared_too_large_is_refused_before_it_is_sent(hardened, path):
    request = head(path, "Content-Type: application/json", f"Content-Length: {50 << 20}")
    reply, closed = exchange(hardened, request)
    assert reply.startswith(b"HTTP/1.1 413"), reply
    assert closed and b"connection: close" in reply.lower()  # the response says it, too
    assert b"--max-request-bytes" in reply
    if path == "/v1/messages":
        assert b'"request_too_large"' in reply


def test_a_chunked_body_is_refused_once_it_passes_the_limit(hardened):
    request = head(
        "/v1/completions", "Content-Type: application/json", "Transfer-Encoding: chunked"
    )
    chunk = b"%x\r\n%s\r\n" % (16 << 10, b" " * (16 << 10))
    # Five chunks pass the 64 KiB limit; the body never ends, so only counting can refuse it.
    reply, closed = exchange(hardened, request, *[chunk] * 5, pause=0.05)
    assert reply.startswith(b"HTTP/1.1 413"), reply
    assert closed


def test_a_body_within_the_limit_is_served(hardened):
    prompt = "Hello " * 1000
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2}
    reply = httpx.post(f"http://127.0.0.1:{hardened}/v1/completions", json=body, timeout=30)
    assert reply.status_code == 400, reply.text  # read and parsed: the prompt is too long
    assert reply.json()["error"]["code"] == "context_length_exceeded"


def test_a_body_that_stalls_is_answered_408(hardened):
    request = head("/v1/completions", "Content-Type: application/json", "Content-Length: 100")
    started = time.monotonic()
    reply, closed = exchange(hardened, request + b'{"prompt": ')
    assert reply.startswith(b"HTTP/1.1 408"), reply
    assert closed and b"connection: close" in reply.lower()
    assert time.monotonic() - started < READ_TIMEOUT + 2


# -- slow clients -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "parts",
    [
        pytest.param([], id="silent"),
        pytest.param([b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"], id="stalled"),
        pytest.param(
            [bytes([b]) for b in b"GET /health HTTP/1.1\r\nX-Slow: " + b"a" * 60], id="trickle"
        ),
    ],
)
def test_a_client_that_does_not_send_its_headers_in_time_is_disconnected(hardened, parts):
    started = time.monotonic()
    reply, closed = exchange(hardened, *parts, pause=0.05)
    assert closed
    assert reply == b""
    assert time.monotonic() - started < READ_TIMEOUT + 2


def test_the_unsent_body_of_a_refused_request_does_not_hold_the_connection(hardened):
    request = head("/v1/completions", "Content-Length: 1000").replace(b"127.0.0.1", b"evil.test")
    started = time.monotonic()
    reply, closed = exchange(hardened, request)
    assert reply.startswith(b"HTTP/1.1 403"), reply
    assert closed
    assert time.monotonic() - started < READ_TIMEOUT + 2


def test_a_huge_header_is_refused(hardened):
    request = head("/health", "X-Big: " + "a" * (1 << 20), method="GET")
    reply, closed = exchange(hardened, request)
    assert reply[:12] in (b"HTTP/1.1 400", b"HTTP/1.1 431"), reply[:100]
    assert closed


# -- framing a proxy could read otherwise (request smuggling) ----------------------------------

SMUGGLED = head("/health", method="GET")


def test_content_length_beside_transfer_encoding_is_refused_and_the_smuggled_request_unread(
    hardened,
):
    # A proxy that frames by Content-Length forwards all of it as one request; the chunked
    # reading ends the body at "0" and would answer the GET behind it as a second request.
    body = b"0\r\n\r\n" + SMUGGLED
    request = head(
        "/v1/completions",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        "Transfer-Encoding: chunked",
    )
    reply, closed = exchange(hardened, request + body)
    assert reply.startswith(b"HTTP/1.1 400"), reply
    assert b"both Content-Length and Transfer-Encoding" in reply
    assert reply.count(b"HTTP/1.1 ") == 1, reply  # the smuggled GET got no answer
    assert closed


@pytest.mark.parametrize(
    "headers",
    [
        pytest.param(["Content-Length: 2", "Content-Length: 40"], id="two-content-lengths"),
        pytest.param(["Content-Length: 2, 40"], id="content-length-list"),
        pytest.param(["Transfer-Encoding: chunked", "Transfer-Encoding: identity"], id="two-te"),
        pytest.param(["Transfer-Encoding: gzip, chunked"], id="te-not-chunked"),
        pytest.param(["Transfer-Encoding : chunked"], id="space-before-colon"),
        pytest.param(["Transfer-Encoding:", " chunked"], id="folded-transfer-encoding"),
        pytest.param(["X-Note: a", "\tb", "Content-Length: 2"], id="folded-header"),
    ],
)
def test_ambiguous_framing_is_refused_and_the_connection_closed(hardened, headers):
    request = head("/v1/completions", "Content-Type: application/json", *headers)
    reply, closed = exchange(hardened, request + b"{}" + SMUGGLED)
    assert reply.startswith(b"HTTP/1.1 4"), reply  # 400, or 501 for an unknown coding
    assert reply.count(b"HTTP/1.1 ") == 1, reply
    assert closed


def test_pipelined_requests_with_plain_framing_are_each_answered(hardened):
    # The framing check reads each head as h11 comes to it, pipelined or not.
    reply, _ = exchange(
        hardened, SMUGGLED + SMUGGLED + head("/health", "Connection: close", method="GET")
    )
    assert reply.count(b"HTTP/1.1 200") == 3, reply


# -- text that is not Unicode -------------------------------------------------------------------

BAD = "@BAD@"
USER_BAD = [{"role": "user", "content": BAD}]
USER_OK = [{"role": "user", "content": "Hi"}]
BAD_TEXT_CASES = [
    ("/v1/completions", {"prompt": BAD, "max_tokens": 2}),
    ("/v1/completions", {"prompt": ["Hi", BAD], "max_tokens": 2}),
    ("/v1/completions", {"prompt": "Hi", "stop": [BAD], "max_tokens": 2}),
    ("/v1/completions", {"model": BAD, "prompt": "Hi", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": USER_BAD, "max_tokens": 2}),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": BAD}]}]},
    ),
    ("/v1/messages", {"messages": USER_BAD, "max_tokens": 2}),
    ("/v1/messages", {"system": BAD, "messages": USER_OK, "max_tokens": 2}),
    (
        "/v1/messages",
        {"system": [{"type": "text", "text": BAD}], "messages": USER_OK, "max_tokens": 2},
    ),
    ("/v1/messages", {"messages": USER_OK, "stop_sequences": [BAD], "max_tokens": 2}),
    ("/v1/messages/count_tokens", {"messages": USER_BAD}),
    ("/v1/messages/count_tokens", {"system": BAD, "messages": USER_OK}),
]


@pytest.mark.parametrize(
    "bad", [b"\\ud800", b"\xed\xa0\x80"], ids=["surrogate-escape", "invalid-utf8"]
)
@pytest.mark.parametrize(("path", "body"), BAD_TEXT_CASES)
def test_text_that_is_not_unicode_gets_400(server, path, bad, body):
    content = json.dumps(body).encode().replace(BAD.encode(), bad)
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    reply = httpx.post(f"{server.base_url}{path}", content=content, headers=headers, timeout=30)
    assert reply.status_code == 400, reply.text
    assert "not UTF-8" in reply.text


def test_a_body_of_bytes_that_are_no_text_gets_400(server):
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    content = b'{"prompt": "\xff\xfe", "max_tokens": 2}'
    reply = httpx.post(
        f"{server.base_url}/v1/completions", content=content, headers=headers, timeout=30
    )
    assert reply.status_code == 400, reply.text


# -- Anthropic's ranges -----------------------------------------------------------------------


def test_anthropic_temperature_above_one_is_refused(server, anthropic_client):
    request = {"model": server.model_name, "max_tokens": 2, "messages": USER_OK}
    with pytest.raises(anthropic.BadRequestError) as caught:
        anthropic_client.messages.create(**request, extra_body={"temperature": 1.5})
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    assert "between 0 and 1" in caught.value.message
    reply = anthropic_client.messages.create(**request, extra_body={"temperature": 1.0})
    assert reply.stop_reason in ("max_tokens", "end_turn")


# -- hosts --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "host", ["localhost", "LOCALHOST", "127.0.0.1", "[::1]", "10.1.2.3", "[fe80::1]"]
)
def test_loopback_names_and_addresses_are_accepted_as_host(hardened, host):
    reply = httpx.get(f"http://127.0.0.1:{hardened}/health", headers={"Host": f"{host}:{hardened}"})
    assert reply.status_code == 200, reply.text


@pytest.mark.parametrize("path", ["/health", "/v1/models", "/v1/messages"])
def test_a_foreign_host_is_refused(hardened, path):
    reply = httpx.get(
        f"http://127.0.0.1:{hardened}{path}", headers={"Host": f"rebind.example:{hardened}"}
    )
    assert reply.status_code == 403
    assert "'rebind.example'" in reply.text
    assert "--allowed-hosts" in reply.text


def test_allowed_hosts_admit_more_names_or_any(engine, serve_app):
    named = serve_app(create_app(engine, MODEL_NAME, allowed_hosts=["api.example.com"]))
    anything = serve_app(create_app(engine, MODEL_NAME, allowed_hosts=["*"]))
    assert httpx.get(f"{named}/health", headers={"Host": "api.example.com"}).status_code == 200
    assert httpx.get(f"{named}/health", headers={"Host": "other.example"}).status_code == 403
    assert httpx.get(f"{anything}/health", headers={"Host": "other.example"}).status_code == 200


# -- API docs -----------------------------------------------------------------------------------

DOCS = ["/docs", "/redoc", "/openapi.json"]


def test_api_docs_are_off_unless_asked_for(hardened, server):
    for base in (f"http://127.0.0.1:{hardened}", server.base_url):
        for path in DOCS:
            assert httpx.get(f"{base}{path}").status_code in (401, 404), path


def test_api_docs_asked_for_need_the_key_when_there_is_one(engine, serve_app):
    guarded = serve_app(create_app(engine, MODEL_NAME, api_key="k", docs=True))
    public = serve_app(create_app(engine, MODEL_NAME, docs=True))
    for path in DOCS:
        assert httpx.get(f"{guarded}{path}").status_code == 401, path
        keyed = httpx.get(f"{guarded}{path}", headers={"Authorization": "Bearer k"})
        assert keyed.status_code == 200, path
        assert httpx.get(f"{public}{path}").status_code == 200, path
    assert httpx.get(f"{guarded}/health").status_code == 200
    assert httpx.get(f"{guarded}/metrics").status_code == 200


# -- errors -------------------------------------------------------------------------------------


def test_a_crash_is_logged_but_its_text_is_not_sent(engine, serve_app, caplog):
    app = create_app(engine, MODEL_NAME)

    @app.get("/v1/crash")
    async def crash() -> None:
        raise RuntimeError("secret detail of /usr/lib/python3/internals.py")

    base = serve_app(app)
    reply = httpx.get(f"{base}/v1/crash")
    assert reply.status_code == 500
    message = reply.json()["error"]["message"]
    assert "secret" not in reply.text and "RuntimeError" not in reply.text
    assert "error id" in message
    error_id = message.split("error id ")[1].split(")")[0]
    assert f"error id {error_id}" in caplog.text
    assert "secret detail" in caplog.text


# -- shutdown -----------------------------------------------------------------------------------

GRACE = 3


def _stream(base: str, path: str, body: dict, ending: dict) -> None:
    """Read one SSE response to its end; record its lines, or the transport error."""
    lines = []
    try:
        with httpx.stream("POST", f"{base}{path}", json=body, timeout=60) as response:
            ending["status"] = response.status_code
            lines.extend(response.iter_lines())
    except httpx.HTTPError as exc:
        ending["transport_error"] = repr(exc)
    ending["lines"] = lines


def _post(base: str, path: str, body: dict, ending: dict) -> None:
    try:
        response = httpx.post(f"{base}{path}", json=body, timeout=60)
        ending["status"] = response.status_code
        ending["body"] = response.json()
    except httpx.HTTPError as exc:
        ending["transport_error"] = repr(exc)


def _requests_in_engine(base: str) -> float:
    """Requests the engine is running or holds waiting, as /metrics shows them."""
    lines = httpx.get(f"{base}/metrics", timeout=10).text.splitlines()
    gauges = ("astrai_requests_running ", "astrai_requests_waiting ")
    return sum(float(line.split()[-1]) for line in lines if line.startswith(gauges))


def _ended(ending: dict) -> bool:
    return any(key in ending for key in ("lines", "body", "transport_error"))


def _ended_properly(kind: str, ending: dict) -> str:
    """'finished' or 'stopped' (a readable error); any other ending fails the test."""
    assert "transport_error" not in ending, ending
    if kind == "post":
        if ending["status"] == 200:
            return "finished"
        assert ending["status"] == 503, ending
        assert "shutting down" in json.dumps(ending["body"])
        return "stopped"
    lines = [line for line in ending["lines"] if line]
    if kind == "openai":
        assert lines[-1] == "data: [DONE]", lines[-3:]
        last = json.loads(lines[-2].removeprefix("data: "))
        if "error" in last:
            assert "shutting down" in last["error"]["message"]
            return "stopped"
        return "finished"
    if lines[-2:] == ["event: message_stop", 'data: {"type": "message_stop"}']:
        return "finished"
    assert lines[-2] == "event: error", lines[-3:]
    assert "shutting down" in json.loads(lines[-1].removeprefix("data: "))["error"]["message"]
    return "stopped"


def test_serve_flags_reach_the_server(llama_dir):
    flags = ["--allowed-hosts", "api.example.com,llm.internal", "--allowed-hosts", "other.test"]
    flags += ["--docs", "--max-request-bytes", "1000", "--read-timeout", "1"]
    with astrai_serve(llama_dir, *flags) as (_, base):
        for host in ("api.example.com", "llm.internal", "other.test", "localhost"):
            assert httpx.get(f"{base}/health", headers={"Host": host}).status_code == 200, host
        assert httpx.get(f"{base}/health", headers={"Host": "evil.test"}).status_code == 403
        assert httpx.get(f"{base}/openapi.json").status_code == 200
        reply = httpx.post(f"{base}/v1/completions", json={"prompt": "x" * 2000})
        assert reply.status_code == 413
        port = int(base.rsplit(":", 1)[1])
        started = time.monotonic()
        assert exchange(port, b"GET /health HTTP/1.1\r\n") == (b"", True)
        assert time.monotonic() - started < 1 + 2


def test_a_large_prompt_does_not_stall_other_clients(llama_dir):
    # The server runs apart from this process, whose threads a held GIL would stall as well.
    with astrai_serve(llama_dir) as (_, base):
        body = {"prompt": "The quick brown fox jumps over the lazy dog. " * 70_000}
        done = threading.Event()

        def send_large() -> None:
            httpx.post(f"{base}/v1/completions", json=body, timeout=60)
            done.set()

        sender = threading.Thread(target=send_large)
        sender.start()
        slowest = 0.0
        while not done.is_set():
            started = time.perf_counter()
            assert httpx.get(f"{base}/health", timeout=30).status_code == 200
            slowest = max(slowest, time.perf_counter() - started)
            time.sleep(0.02)
        sender.join()
    assert slowest < 1.0  # 3.3 s while the encoding held the GIL


HOSTILE_TEMPLATE = (
    "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"
)


def _cpu_seconds(pid: int) -> float:
    """The user and system CPU time process pid has spent (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_template_that_never_ends_is_stopped_with_400_while_others_are_served(
    llama_dir, tmp_path
):
    template = tmp_path / "hostile.jinja"
    template.write_text(HOSTILE_TEMPLATE)
    with astrai_serve(llama_dir, "--chat-template", str(template)) as (process, base):
        chat = {"messages": USER_OK, "max_tokens": 2}
        replies = {}

        def send_chat(index: int) -> None:
            replies[index] = httpx.post(f"{base}/v1/chat/completions", json=chat, timeout=60)

        senders = [threading.Thread(target=send_chat, args=(i,)) for i in range(3)]
        for sender in senders:
            sender.start()
        while any(sender.is_alive() for sender in senders):  # others are served meanwhile
            completion = {"prompt": "Hello", "max_tokens": 2}
            reply = httpx.post(f"{base}/v1/completions", json=completion, timeout=30)
            assert reply.status_code == 200, reply.text
        for reply in replies.values():
            assert reply.status_code == 400, reply.text
            assert "stopped: it looped or called more than" in reply.json()["error"]["message"]
        spent = _cpu_seconds(process.pid)
        time.sleep(1.0)
        assert _cpu_seconds(process.pid) - spent < 0.3  # no render is left running


def test_sigterm_drains_running_requests_then_exits_cleanly(llama_dir):
    # One request at a time, so most are still queued or running when the grace period ends.
    flags = ["--max-batch-size", "1", "--max-seq-len", "1024", "--shutdown-timeout", str(GRACE)]
    with astrai_serve(llama_dir, *flags) as (process, base):
        deadline = time.monotonic() + 60
        long = {"max_tokens": 900, "ignore_eos": True}
        prompt, messages = {"prompt": "Hello"}, {"messages": USER_OK}
        requests = [("openai", "/v1/completions", {**prompt, "max_tokens": 200, "stream": True})]
        requests += [
            ("openai", "/v1/completions", {**prompt, **long, "stream": True}),
            ("openai", "/v1/chat/completions", {**messages, **long, "stream": True}),
            ("anthropic", "/v1/messages", {**messages, "max_tokens": 900, "stream": True}),
            ("post", "/v1/completions", {**prompt, **long}),
            ("post", "/v1/messages", {**messages, "max_tokens": 900}),
        ] * 5  # 25 of 900 tokens, one at a time: several times the grace period's work
        endings = [{} for _ in requests]
        clients = []
        for (kind, path, body), ending in zip(requests, endings, strict=True):
            run = _post if kind == "post" else _stream
            clients.append(threading.Thread(target=run, args=(base, path, body, ending)))
            clients[-1].start()
            # Each queued before the next is sent: the short one runs first, the others wait.
            while _requests_in_engine(base) + sum(_ended(e) for e in endings) < len(clients):
                assert time.monotonic() < deadline, "the requests were not all accepted"
                time.sleep(0.02)

        process.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        refused = httpx.post(f"{base}/v1/completions", json={**prompt, "max_tokens": 2})
        assert refused.status_code == 503
        assert refused.headers["Retry-After"].isdigit()
        assert "shutting down" in refused.json()["error"]["message"]
        assert httpx.get(f"{base}/health").status_code == 503
        _, stderr = process.communicate(timeout=GRACE + 30)
        for client in clients:
            client.join(timeout=10)
    assert process.returncode == 0, stderr
    assert "Traceback" not in stderr
    assert "ERROR" not in stderr, stderr
    outcomes = [_ended_properly(kind, e) for (kind, _, _), e in zip(requests, endings, strict=True)]
    assert outcomes[0] == "finished", (outcomes, endings[0])
    assert "stopped" in outcomes
