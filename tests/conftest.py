"""Session fixtures shared by every test directory; the builders live in tiny_models.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_models import write_hf_model, write_tokenizer


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    return write_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory) -> Path:
    return write_hf_model(tmp_path_factory.mktemp("llama"), "llama")
