"""Fixtures: a real uvicorn server on a free loopback port, serving a tiny random-weight model."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from live_server import API_KEY, MODEL_NAME, RunningServer, make_engine, start_server, stop_server

from astrai.server import create_app


@pytest.fixture(scope="session")
def server(llama_dir) -> Iterator[RunningServer]:
    engine = make_engine(llama_dir)
    running = start_server(create_app(engine, MODEL_NAME, api_key=API_KEY))
    try:
        yield RunningServer(f"http://127.0.0.1:{running.port}", engine)
    finally:
        stop_server(running)
        engine.close()


@pytest.fixture(scope="session")
def openai_client(server):
    import openai

    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="session")
def anthropic_client(server):
    import anthropic

    return anthropic.Anthropic(base_url=server.base_url, api_key=API_KEY, max_retries=0)
