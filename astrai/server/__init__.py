"""HTTP serving: OpenAI- and Anthropic-compatible APIs, health and Prometheus metrics."""

from astrai.server.app import create_app

__all__ = ["create_app"]
