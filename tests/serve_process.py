"""`astrai serve` in a process of its own on a free loopback port, for tests of the command."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

import astrai

REPO_ROOT = Path(astrai.__file__).resolve().parent.parent


@contextlib.contextmanager
def astrai_serve(
    model: Path | None, *flags: str, api_key: str = "", startup_timeout: float = 120
) -> Iterator[tuple[subprocess.Popen, str]]:
    """(the process, its base URL) once /health answers; killed on exit if still running.

    model None gives no --model (flags name the models: --models-dir)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    process = subprocess.Popen(
        [sys.executable, "-m", "astrai", "serve", "--port", str(port)]
        + (["--model", str(model)] if model is not None else [])
        + list(flags),
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "ASTRAI_API_KEY": api_key},
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            assert process.poll() is None, process.communicate()[1]
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        yield process, base
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
