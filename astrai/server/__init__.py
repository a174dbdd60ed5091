"""HTTP serving: OpenAI- and Anthropic-compatible APIs, health and Prometheus metrics.

The names are imported on first use, so the CLI can read astrai.server.defaults without loading
FastAPI and uvicorn.
"""

from __future__ import annotations

import importlib

_EXPORTS = {"create_app": "astrai.server.app", "run_server": "astrai.server.lifecycle"}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'astrai.server' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
