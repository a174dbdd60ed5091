"""The tiny Llama checkpoint loaded once per test module, and its tokenizer."""

from __future__ import annotations

import pytest
from kernel_switch import kernel_or_fallback

from astrai.model import AutoModel
from astrai.tokenize import AutoTokenizer


@pytest.fixture(scope="module")
def model(llama_dir):
    return AutoModel.from_pretrained(llama_dir)


@pytest.fixture(scope="module")
def tokenizer(llama_dir):
    return AutoTokenizer.from_pretrained(llama_dir)


@pytest.fixture(params=["c-kernel", "sdpa"])
def decode_attention(request, monkeypatch):
    """Run a test with each decode-attention backend: the C kernel, then gather + SDPA."""
    return kernel_or_fallback(request, monkeypatch, "paged_attention")
