"""The chat page at /: served with the app (or not, with --no-webui), and used in a real browser,
Debian's chromium driven headless by Playwright, against a real server on the demo model or a
router of two tiny models."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from live_server import API_KEY, make_engine, start_server, stop_server
from tiny_models import write_hf_model

from astrai.flags import build_parser, serve_settings
from astrai.launch import DEMO_MODEL_DIR, open_router
from astrai.server import create_app

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


# An answer in Markdown with a code block, and markup of the model's own that must stay text.
MARKDOWN_ANSWER = (
    "Run **this**:\n\n```python\ndef greet(name):\n    return f'hi {name}'\n```\n\n"
    '<script>window.injected = 1</script> <img src=x onerror="window.injected = 2">'
)


@pytest.fixture(scope="module")
def demo_engine():
    engine = make_engine(DEMO_MODEL_DIR)
    yield engine
    engine.close()


@pytest.mark.parametrize("webui", [True, False])
def test_the_page_is_served_at_the_root_unless_turned_off(demo_engine, webui):
    app = create_app(demo_engine, "demo", allowed_hosts=["testserver"], webui=webui)
    with TestClient(app) as client:
        page = client.get("/")
        script = client.get("/webui/chat.js")
    assert page.status_code == (200 if webui else 404)
    assert script.status_code == (200 if webui else 404)
    if webui:
        assert "<title>astrai chat</title>" in page.text
        assert "/v1/chat/completions" in script.text
    assert build_parser().parse_args(["serve", *([] if webui else ["--no-webui"])]).webui is webui


def test_behind_an_api_key_the_page_is_public_and_every_api_route_is_not(demo_engine):
    """The page and its static files answer without the key (a browser's navigation cannot send
    it); every API route (the app's OpenAPI schema lists them) refuses a request without it, and
    takes one with it. With --no-webui nothing but the probes is public."""
    app = create_app(demo_engine, "demo", api_key=API_KEY, allowed_hosts=["testserver"], docs=True)
    keyed = {"Authorization": f"Bearer {API_KEY}"}
    with TestClient(app) as client:
        for path in ("/", "/webui/chat.js", "/webui/chat.css", "/webui/vendor/marked.umd.js"):
            assert client.get(path).status_code == 200, path
        schema = client.get("/openapi.json", headers=keyed).json()["paths"]
        routes = [
            (method.upper(), re.sub(r"\{[^}]*\}", "x", path))
            for path, methods in schema.items()
            if path not in ("/health", "/metrics")
            for method in methods
        ]
        assert ("GET", "/v1/models") in routes and ("POST", "/v1/chat/completions") in routes
        for method, path in routes:
            assert client.request(method, path).status_code == 401, (method, path)
        assert client.get("/v1/models", headers=keyed).status_code == 200
        assert client.get("/webui/../v1/models").status_code != 200
    app = create_app(
        demo_engine, "demo", api_key=API_KEY, allowed_hosts=["testserver"], webui=False
    )
    with TestClient(app) as client:
        assert client.get("/").status_code == 401
        assert client.get("/webui/chat.js").status_code == 401


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs chromium: apt-get install chromium")
def test_behind_an_api_key_the_page_asks_for_it_keeps_it_and_chats_with_it(demo_engine, tmp_path):
    """The page asks for the key when the API answers 401, says so when a wrong one is refused,
    chats with the right one, and keeps it (localStorage) over a reload."""
    from playwright.sync_api import expect

    running = start_server(create_app(demo_engine, "demo", api_key=API_KEY))
    try:
        with browser_page(f"http://127.0.0.1:{running.port}/") as page:
            dialog, message = page.locator("#key-dialog"), page.locator("#key-message")
            expect(dialog).to_be_visible()
            expect(message).to_contain_text("needs an API key")
            page.fill("#api-key", "wrong-key")
            page.press("#api-key", "Enter")
            expect(message).to_contain_text("refused this key (invalid API key)")
            expect(dialog).to_be_visible()
            page.fill("#api-key", API_KEY)
            page.press("#api-key", "Enter")
            expect(dialog).to_be_hidden()
            expect(page.locator("#model")).to_have_value("demo")
            ask(page, "Hello")
            expect(page.locator("#status")).to_contain_text("tokens/s")
            assert page.locator(".message.assistant").inner_text().strip()
            page.reload()
            expect(page.locator("#model")).to_have_value("demo")
            expect(dialog).to_be_hidden()
            ask(page, "Hello again")
            expect(page.locator(".message")).to_have_count(4)
            assert page.locator(".message.assistant").nth(1).inner_text().strip()
            page.screenshot(path=tmp_path / "keyed.png")
    finally:
        stop_server(running)
    assert (tmp_path / "keyed.png").stat().st_size > 0


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs chromium: apt-get install chromium")
def test_a_message_typed_in_the_browser_gets_a_streamed_answer_kept_over_a_reload(
    demo_engine, tmp_path
):
    sync_api = pytest.importorskip("playwright.sync_api")
    running = start_server(create_app(demo_engine, "demo"))
    try:
        with sync_api.sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_FLAGS)
            page = browser.new_page()
            page.goto(f"http://127.0.0.1:{running.port}/")
            sync_api.expect(page.locator("#model")).to_have_value("demo")
            page.fill("#input", "Hello")
            page.press("#input", "Enter")
            answer = page.locator(".message.assistant")
            sync_api.expect(answer).not_to_have_class("message assistant streaming", timeout=60_000)
            sync_api.expect(page.locator("#status")).to_contain_text("tokens/s")
            text = answer.inner_text()
            assert text.strip()
            page.screenshot(path=tmp_path / "chat.png")
            page.reload()  # the conversation comes back from localStorage
            sync_api.expect(page.locator(".message")).to_have_count(2)
            assert page.locator(".message.user").inner_text() == "Hello"
            assert page.locator(".message.assistant").inner_text() == text
            browser.close()
    finally:
        stop_server(running)
    assert (tmp_path / "chat.png").stat().st_size > 0


@contextmanager
def browser_page(url: str) -> Iterator:
    """A page of headless chromium at url."""
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_FLAGS)
        page = browser.new_page()
        page.goto(url)
        yield page
        browser.close()


def ask(page, text: str) -> None:
    """Type text as the message and wait until its answer has streamed to the end."""
    from playwright.sync_api import expect

    page.fill("#input", text)
    page.press("#input", "Enter")
    expect(page.locator("#stop")).to_be_hidden(timeout=60_000)
    expect(page.locator(".message.streaming")).to_have_count(0)


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs chromium: apt-get install chromium")
def test_an_answer_in_markdown_is_rendered_with_its_code_highlighted_and_its_markup_as_text(
    demo_engine, tmp_path
):
    """The real demo model writes MARKDOWN_ANSWER, held to it by a guided_choice the browser adds
    to the page's own request: its code block is a highlighted <pre><code>, and the <script> and
    <img onerror> it writes are shown as text, never run."""
    running = start_server(create_app(demo_engine, "demo"))
    try:
        with browser_page(f"http://127.0.0.1:{running.port}/") as page:

            def constrain(route):
                body = json.loads(route.request.post_data)
                route.continue_(post_data=json.dumps({**body, "guided_choice": [MARKDOWN_ANSWER]}))

            page.route("**/v1/chat/completions", constrain)
            ask(page, "Show me a Python function")
            answer = page.locator(".message.assistant")
            stored = page.evaluate("JSON.parse(localStorage['astrai.chat.messages'])[1].content")
            assert stored == MARKDOWN_ANSWER
            assert answer.locator("strong").inner_text() == "this"
            code = answer.locator("pre > code.hljs.language-python")
            assert code.inner_text() == "def greet(name):\n    return f'hi {name}'"
            assert code.locator("span.hljs-keyword").first.inner_text() == "def"
            assert answer.locator("script, img").count() == 0
            assert "<script>window.injected = 1</script>" in answer.inner_text()
            assert '<img src=x onerror="window.injected = 2">' in answer.inner_text()
            assert page.evaluate("window.injected") is None
            page.screenshot(path=tmp_path / "markdown.png")
    finally:
        stop_server(running)
    assert (tmp_path / "markdown.png").stat().st_size > 0


@pytest.fixture(scope="module")
def two_models(tmp_path_factory) -> Path:
    """A --models-dir of two tiny llamas with different weights."""
    root = tmp_path_factory.mktemp("models")
    for seed, name in enumerate(("first", "second"), start=1):
        write_hf_model(root / name, "llama", seed=seed)
    return root


@contextmanager
def router(models_dir: Path) -> Iterator[str]:
    """`astrai serve --models-dir models_dir` on a loopback port: its base URL."""
    args, config = serve_settings(
        ["--models-dir", str(models_dir), "--max-seq-len", "256", "--kv-cache-memory", "8000000"]
    )
    models, app = open_router(args, config)
    running = start_server(app)
    try:
        yield f"http://127.0.0.1:{running.port}"
    finally:
        stop_server(running)
        models.close()


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs chromium: apt-get install chromium")
def test_the_picker_lists_every_served_model_and_the_one_picked_answers(two_models, tmp_path):
    """With a router of two models, the picker lists both; a message sent with the second picked
    (greedy, 8 tokens, from the settings) gets that model's answer, not the first's, and the
    picked model and settings are remembered over a reload."""
    with router(two_models) as base:
        greedy = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8}
        greedy["temperature"] = 0
        expected = {
            name: httpx.post(
                f"{base}/v1/chat/completions", json={**greedy, "model": name}, timeout=60
            ).json()["choices"][0]["message"]["content"]
            for name in ("first", "second")
        }
        assert expected["first"] != expected["second"]
        with browser_page(f"{base}/") as page:
            from playwright.sync_api import expect

            picker = page.locator("#model")
            expect(picker.locator("option")).to_have_text(["first", "second"])
            expect(picker).to_have_value("first")
            picker.select_option("second")
            page.click("#settings summary")
            page.fill("#temperature", "0")
            page.fill("#max-tokens", "8")
            page.locator("#max-tokens").blur()
            ask(page, "Hello")
            stored = page.evaluate("JSON.parse(localStorage['astrai.chat.messages'])[1]")
            assert stored == {"role": "assistant", "content": expected["second"], "model": "second"}
            expect(page.locator(".message.assistant")).to_have_attribute("data-model", "second")
            page.screenshot(path=tmp_path / "picker.png")
            page.reload()
            expect(picker).to_have_value("second")
            expect(page.locator("#temperature")).to_have_value("0")
    assert (tmp_path / "picker.png").stat().st_size > 0
