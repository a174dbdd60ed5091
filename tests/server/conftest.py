"""Fixtures: a real uvicorn server on a free loopback port, serving a tiny random-weight model."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from live_server import API_KEY, RunningServer, make_engine, serving


@pytest.fixture(scope="session")
def server(llama_dir) -> Iterator[RunningServer]:
    engine = make_engine(llama_dir)
    with serving(engine) as server:
        yield server


@pytest.fixture(scope="session")
def openai_client(server):
    import openai

    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="session")
def anthropic_client(server):
    import anthropic

    return anthropic.Anthropic(base_url=server.base_url, api_key=API_KEY, max_retries=0)
