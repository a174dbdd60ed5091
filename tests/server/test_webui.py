"""The chat page at /: served with the app (or not, with --no-webui), and used in a real browser,
Debian's chromium driven headless by Playwright, against a real server on the demo model."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from live_server import make_engine, start_server, stop_server

from astrai.cli import DEMO_MODEL_DIR, _parser
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
    assert _parser().parse_args(["serve", *([] if webui else ["--no-webui"])]).webui is webui


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
            sync_api.expect(page.locator("#model")).to_have_text("demo")
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
