"""Start a real uvicorn server in a background thread on a free loopback port."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import uvicorn

from astrai.config import EngineConfig
from astrai.inference import InferenceEngine
from astrai.model import AutoModel
from astrai.tokenize import AutoTokenizer

API_KEY = "test-key"
MODEL_NAME = "tiny-llama"
# Small enough that a too-long prompt is easy to write, big enough for every other test.
MAX_SEQ_LEN = 256


@dataclass
class RunningServer:
    base_url: str
    engine: InferenceEngine
    model_name: str = MODEL_NAME
    api_key: str = API_KEY


@dataclass
class _ServerThread:
    server: uvicorn.Server
    thread: threading.Thread
    port: int


def start_server(app, **options) -> _ServerThread:
    """Run app under uvicorn in a background thread; return once it accepts connections.

    options are uvicorn.Config's, such as the http protocol class.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2, **options)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    return _ServerThread(server, thread, sock.getsockname()[1])


def stop_server(running: _ServerThread) -> None:
    running.server.should_exit = True
    running.thread.join(timeout=30)


@contextmanager
def serving(engine: InferenceEngine, **app_options) -> Iterator[RunningServer]:
    """The engine served by the app (create_app's app_options) on a loopback port, with the
    tests' model name and API key; the server stopped and the engine closed after."""
    from astrai.server import create_app

    running = start_server(create_app(engine, MODEL_NAME, api_key=API_KEY, **app_options))
    try:
        yield RunningServer(f"http://127.0.0.1:{running.port}", engine)
    finally:
        stop_server(running)
        engine.close()


def make_engine(model_dir, **config) -> InferenceEngine:
    model = AutoModel.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    settings = dict(
        max_batch_size=64, kv_cache_memory=64 << 20, max_seq_len=MAX_SEQ_LEN, check_invariants=True
    )
    settings.update(config)
    return InferenceEngine(model, tokenizer, EngineConfig(**settings))
