"""Session fixtures shared by every test directory; the builders live in tiny_models.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_models import write_hf_model, write_tokenizer

from astrai.kernels import linear_ops


@pytest.fixture(autouse=True)
def untuned_linears(monkeypatch, tmp_path):
    """Each test starts on the linear paths used before any timing; an engine it builds
    applies its own (timed once a process), and they end with the test. Timings are kept in
    a cache of the test's own, never the user's, so a faked timing stays in its test."""
    monkeypatch.setattr(linear_ops, "_paths", {})
    monkeypatch.setenv("ASTRAI_CACHE_DIR", str(tmp_path / "astrai-cache"))


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    return write_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory) -> Path:
    return write_hf_model(tmp_path_factory.mktemp("llama"), "llama")
