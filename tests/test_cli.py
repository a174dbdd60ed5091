"""The `astrai` command line, run end to end in subprocesses on a tiny random-weight model."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

import astrai
from astrai.cli import DEMO_MODEL_DIR, main
from astrai.config import EngineConfig
from astrai.inference import GenerationParams, GenerationRequest, InferenceEngine
from astrai.model import AutoModel
from astrai.tokenize import AutoTokenizer

REPO_ROOT = Path(astrai.__file__).resolve().parent.parent
SMALL_ENGINE = ["--max-seq-len", "256", "--kv-cache-memory", "8000000", "--max-batch-size", "8"]
GREEDY = ["--temperature", "0", "--max-tokens", "10"]


def astrai_cli(*args: str, stdin: str | None = None, timeout: float = 120):
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "ASTRAI_API_KEY": ""}
    return subprocess.run(
        [sys.executable, "-m", "astrai", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=REPO_ROOT,
    )


@pytest.fixture(scope="module")
def engine(llama_dir):
    model = AutoModel.from_pretrained(llama_dir)
    config = EngineConfig(max_seq_len=256, kv_cache_memory=8_000_000, max_batch_size=8)
    with InferenceEngine(model, AutoTokenizer.from_pretrained(llama_dir), config) as engine:
        yield engine


def greedy_chat(engine, messages) -> str:
    request = GenerationRequest(tuple(messages), GenerationParams(max_tokens=10, temperature=0))
    return engine.generate(request)


def test_generate_streams_the_engines_greedy_text(llama_dir, engine):
    run = astrai_cli("generate", "--model", str(llama_dir), *SMALL_ENGINE, *GREEDY, "Hello world")
    assert run.returncode == 0, run.stderr
    assert run.stdout == engine.generate("Hello world", max_tokens=10, temperature=0) + "\n"
    assert "demo model" not in run.stderr


def test_generate_with_chat_template_and_stop(llama_dir, engine):
    expected = greedy_chat(engine, [{"role": "user", "content": "Hello"}])
    stop = expected[len(expected) // 2 :][:2]
    assert stop.strip(), f"the greedy text {expected!r} has no usable stop string"
    args = ["--model", str(llama_dir), *SMALL_ENGINE, *GREEDY, "--chat", "--stop", stop]
    run = astrai_cli("generate", *args, "Hello")
    assert run.returncode == 0, run.stderr
    assert run.stdout == expected[: expected.index(stop)] + "\n"


def test_chat_keeps_history_until_end_of_input(llama_dir, engine):
    args = ["--model", str(llama_dir), *SMALL_ENGINE, *GREEDY]
    run = astrai_cli("chat", *args, stdin="Hello\n\nHow are you?\n")
    assert run.returncode == 0, run.stderr
    history = [{"role": "user", "content": "Hello"}]
    first = greedy_chat(engine, history)
    history += [
        {"role": "assistant", "content": first},
        {"role": "user", "content": "How are you?"},
    ]
    second = greedy_chat(engine, history)
    assert run.stdout == f"{first}\n{second}\n"


def test_chat_reset_and_exit(llama_dir, engine):
    args = ["--model", str(llama_dir), *SMALL_ENGINE, *GREEDY]
    run = astrai_cli("chat", *args, stdin="Hello\n/reset\nHello\n/exit\nnever read\n")
    assert run.returncode == 0, run.stderr
    first = greedy_chat(engine, [{"role": "user", "content": "Hello"}])
    assert run.stdout == f"{first}\n{first}\n"


def test_bench_reports_a_summary_table(llama_dir):
    run = astrai_cli(
        "bench",
        "--model",
        str(llama_dir),
        *SMALL_ENGINE,
        "--num-requests",
        "6",
        "--input-len",
        "12",
        "--output-len",
        "5",
    )
    assert run.returncode == 0, run.stderr
    header, row = run.stdout.strip().splitlines()
    columns = ("requests", "prompt tokens", "output tokens", "seconds", "output tok/s")
    assert header.split() == " ".join(columns).split(" ")
    requests, prompt_tokens, output_tokens, seconds, rate = row.split()
    assert (requests, prompt_tokens, output_tokens) == ("6", "72", "30")
    assert float(seconds) > 0 and float(rate) > 0
    assert "6/6 requests done" in run.stderr


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_serve_answers_then_shuts_down_on_sigterm(llama_dir):
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "ASTRAI_API_KEY": "secret"}
    args = ["serve", "--model", str(llama_dir), "--port", str(port), *SMALL_ENGINE]
    process = subprocess.Popen(
        [sys.executable, "-m", "astrai", *args],
        env=env,
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, process.communicate()[1]
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        body = {"model": llama_dir.name, "prompt": "Hello", "max_tokens": 3}
        headers = {"Authorization": "Bearer secret"}
        reply = httpx.post(f"{base}/v1/completions", json=body, headers=headers, timeout=30)
        assert reply.status_code == 200, reply.text
        assert httpx.post(f"{base}/v1/completions", json=body, timeout=30).status_code == 401

        # A request still streaming when SIGTERM arrives ends cleanly, finished or aborted.
        stream_body = {**body, "max_tokens": 200, "stream": True, "ignore_eos": True}
        streamed = threading.Event()

        def stream() -> None:
            try:
                with httpx.stream(
                    "POST", f"{base}/v1/completions", json=stream_body, headers=headers
                ) as response:
                    for _ in response.iter_lines():
                        streamed.set()
            except httpx.HTTPError:
                pass

        client = threading.Thread(target=stream, daemon=True)
        client.start()
        assert streamed.wait(30)
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=30)
        client.join(timeout=10)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, stderr
    assert "Traceback" not in stderr


def test_without_model_the_demo_model_is_used_and_said_so():
    run = astrai_cli("generate", *SMALL_ENGINE, "--max-tokens", "4", "Hello")
    lines = [line for line in run.stderr.splitlines() if "demo model" in line]
    assert len(lines) == 1
    assert str(DEMO_MODEL_DIR) in lines[0]
    assert DEMO_MODEL_DIR == REPO_ROOT / "astrai" / "assets" / "demo"
    if (DEMO_MODEL_DIR / "config.json").is_file():
        assert run.returncode == 0, run.stderr
        assert run.stdout.strip()
    else:  # not trained yet: a clear error, not a traceback
        assert run.returncode == 1
        assert "Traceback" not in run.stderr
        assert "astrai: error:" in run.stderr


def test_a_missing_model_directory_is_a_clear_error(tmp_path):
    run = astrai_cli("generate", "--model", str(tmp_path / "nope"), "Hello")
    assert run.returncode == 1
    assert "does not exist" in run.stderr
    assert "Traceback" not in run.stderr


@pytest.mark.parametrize("command", ["serve", "generate", "chat", "bench"])
def test_help_explains_every_engine_flag(command, capsys):
    with pytest.raises(SystemExit) as exited:
        main([command, "--help"])
    assert exited.value.code == 0
    text = capsys.readouterr().out
    for flag in (
        "--model",
        "--dtype",
        "--device",
        "--max-batch-size",
        "--kv-cache-memory",
        "--page-size",
        "--max-num-batched-tokens",
        "--max-seq-len",
        "--no-prefix-cache",
    ):
        assert flag in text
    if command in ("generate", "chat"):
        for flag in ("--max-tokens", "--temperature", "--top-p", "--top-k", "--seed", "--stop"):
            assert flag in text
