"""Images fetched from http(s) URLs under --allowed-media-domains, from a real HTTP server on
a loopback port, through the real openai and anthropic clients: fetched from allowed hosts
only, never from a loopback (or other non-public) address, never past a redirect off the list,
within the size and time limits; each refusal a clear 400 after which the server serves on.

The one seam: the test server can only listen on loopback, which astrai refuses, so the
resolver (astrai.server.media.public_address) is replaced for the one made-up host
images.test, which it maps to the test server's loopback address without the public-address
check. Every other host resolves and is checked for real."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from live_server import API_KEY, make_engine, serving
from tiny_models import noise_image

from astrai.inference import GenerationParams, GenerationRequest
from astrai.server import media
from astrai.server.media import MediaFetchError, public_address

MAX_TOKENS = 8
MAX_IMAGE_BYTES = 1 << 16
FETCH_TIMEOUT = 1.0
TEST_HOST = "images.test"


def png(seed: int) -> bytes:
    buffer = io.BytesIO()
    noise_image(seed).save(buffer, "PNG")
    return buffer.getvalue()


class ImageHost(BaseHTTPRequestHandler):
    """/cat.png, an image; /redirect?to=URL, a 302 to URL; /big.png, over the byte limit by
    its Content-Length; /endless.png, a body without length that never ends; /slow.png,
    later than the time limit; anything else 404."""

    def do_GET(self):
        path, _, query = self.path.partition("?")
        if path == "/cat.png":
            self._send(png(1))
        elif path == "/redirect":
            self.send_response(302)
            self.send_header("Location", query.removeprefix("to="))
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif path == "/big.png":
            self._send(b"\0" * (MAX_IMAGE_BYTES + 1))
        elif path == "/endless.png":
            self.send_response(200)
            self.send_header("Connection", "close")
            self.end_headers()
            with contextlib.suppress(ConnectionError):  # until the fetch stops reading
                while True:
                    self.wfile.write(b"\0" * 4096)
        elif path == "/slow.png":
            time.sleep(3 * FETCH_TIMEOUT)
            with contextlib.suppress(ConnectionError):  # the fetch gave up long ago
                self._send(png(1))
        else:
            self.send_error(404)

    def _send(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def image_host():
    server = ThreadingHTTPServer(("127.0.0.1", 0), ImageHost)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def media_server(llava_dir, image_host):
    async def resolve(host: str, port: int) -> str:
        return "127.0.0.1" if host == TEST_HOST else await public_address(host, port)

    engine = make_engine(llava_dir, max_image_bytes=MAX_IMAGE_BYTES)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(media, "public_address", resolve)
        with serving(
            engine,
            allowed_media_domains=[TEST_HOST, "localhost"],
            media_fetch_timeout=FETCH_TIMEOUT,
        ) as server:
            yield server


@pytest.fixture(scope="module")
def clients(media_server):
    import anthropic
    import openai

    url = media_server.base_url
    return (
        openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0),
        anthropic.Anthropic(base_url=url, api_key=API_KEY, max_retries=0),
    )


def ask(client, url: str) -> str:
    reply = client.chat.completions.create(
        model="tiny-llama",
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": "What is this?"},
                ],
            }
        ],
        temperature=0,
        max_tokens=MAX_TOKENS,
    )
    return reply.choices[0].message.content


def engine_answer(engine) -> str:
    """The engine's own greedy answer about the image /cat.png serves."""
    parts = [{"type": "image", "image": noise_image(1)}, {"type": "text", "text": "What is this?"}]
    request = GenerationRequest(
        [{"role": "user", "content": parts}],
        GenerationParams(temperature=0.0, max_tokens=MAX_TOKENS),
    )
    return engine.generate(request)


def test_an_allowed_host_is_fetched_directly_after_a_redirect_and_over_each_api(
    media_server, clients, image_host
):
    openai_client, anthropic_client = clients
    expected = engine_answer(media_server.engine)
    cat = f"http://{TEST_HOST}:{image_host}/cat.png"
    assert ask(openai_client, cat) == expected
    assert ask(openai_client, f"http://{TEST_HOST}:{image_host}/redirect?to={cat}") == expected
    reply = anthropic_client.messages.create(
        model="tiny-llama",
        max_tokens=MAX_TOKENS,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image", "source": {"type": "url", "url": cat}},
                    {"type": "text", "text": "What is this?"},
                ],
            }
        ],
        extra_body={"temperature": 0},
    )
    assert reply.content[0].text == expected
    response = openai_client.responses.create(
        model="tiny-llama",
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_image", "image_url": cat},
                    {"type": "input_text", "text": "What is this?"},
                ],
            }
        ],
        temperature=0,
        max_output_tokens=MAX_TOKENS,
    )
    assert response.output_text == expected


REFUSALS = {
    "an off-list host": ("http://other.test:{port}/cat.png", "host 'other.test' is not one"),
    "a subdomain of an allowed host": (
        "http://cdn.images.test:{port}/cat.png",
        "host 'cdn.images.test' is not one",
    ),
    "a redirect to 127.0.0.1": (
        "http://images.test:{port}/redirect?to=http://127.0.0.1:{port}/cat.png",
        "host '127.0.0.1' is not one",
    ),
    "a redirect to an allowed host on loopback": (
        "http://images.test:{port}/redirect?to=http://localhost:{port}/cat.png",
        "'localhost' resolves to .* not a public address",
    ),
    "an allowed host on loopback": (
        "http://localhost:{port}/cat.png",
        "'localhost' resolves to .* not a public address",
    ),
    "a redirect to a file": (
        "http://images.test:{port}/redirect?to=file:///etc/passwd",
        "is not http\\(s\\)",
    ),
    "a file URL": ("file:///etc/passwd", "must be a data: URL"),
    "an image over the byte limit": (
        "http://images.test:{port}/big.png",
        f"over the limit of {MAX_IMAGE_BYTES} bytes",
    ),
    "an endless image": (
        "http://images.test:{port}/endless.png",
        f"over the limit of {MAX_IMAGE_BYTES} bytes",
    ),
    "a slow image": ("http://images.test:{port}/slow.png", "did not arrive within 1 seconds"),
    "a missing image": ("http://images.test:{port}/missing.png", "answered HTTP 404"),
}


@pytest.mark.parametrize("name", REFUSALS)
def test_refusals_are_clear_400s_and_the_server_serves_on(media_server, clients, image_host, name):
    import openai

    openai_client, _ = clients
    url, message = REFUSALS[name]
    with pytest.raises(openai.BadRequestError, match=message) as refused:
        ask(openai_client, url.format(port=image_host))
    assert "httpx" not in str(refused.value) and "Traceback" not in str(refused.value)
    inline = f"data:image/png;base64,{base64.b64encode(png(1)).decode()}"
    assert ask(openai_client, inline) == engine_answer(media_server.engine)


@pytest.mark.parametrize(
    "address", ["127.0.0.1", "10.1.2.3", "169.254.169.254", "::1", "::ffff:127.0.0.1", "0.0.0.0"]
)
def test_non_public_addresses_are_refused(address):
    with pytest.raises(MediaFetchError, match="not a public address"):
        asyncio.run(public_address(address, 80))


def test_a_public_address_is_the_one_connected_to():
    assert asyncio.run(public_address("93.184.215.14", 443)) == "93.184.215.14"
