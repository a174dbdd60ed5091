"""The demo model shipped in the package: it loads like any checkpoint, writes text, and the
held-out perplexity its model card reports is what astrai's scoring path measures."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import astrai
from astrai.model import AutoModel, Transformer
from astrai.tokenize import AutoTokenizer

DEMO_DIR = Path(astrai.__file__).parent / "assets" / "demo"


@pytest.fixture(scope="module")
def model() -> Transformer:
    return AutoModel.from_pretrained(DEMO_DIR, dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DEMO_DIR)


@torch.no_grad()
def greedy(model: Transformer, tokenizer, ids: list[int], max_tokens: int) -> list[int]:
    """New token ids, argmax at each step, through the first stop token."""
    new: list[int] = []
    while len(new) < max_tokens and not tokenizer.stop_token_ids & set(new[-1:]):
        new.append(int(model.forward_dense(torch.tensor([ids + new]))[0, -1].argmax()))
    return new


def test_demo_model_continues_a_prompt_in_english_words(model, tokenizer):
    prompt = tokenizer.encode("Return the")
    assert prompt[0] == tokenizer.bos_token_id
    new = greedy(model, tokenizer, prompt, 32)
    assert greedy(model, tokenizer, prompt, 32) == new
    words = re.findall(r"[A-Za-z]+", tokenizer.decode(new))
    assert len(words) >= 4, tokenizer.decode(new)
    common = {"the", "a", "of", "to", "is", "and", "in", "if", "for", "be", "or", "an", "as"}
    assert common & {word.lower() for word in words}, tokenizer.decode(new)


def test_demo_model_answers_in_the_chat_template_and_stops(model, tokenizer):
    messages = [{"role": "user", "content": "What does json.dumps() do?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    new = greedy(model, tokenizer, prompt, 64)
    assert new[-1] in tokenizer.stop_token_ids, tokenizer.decode(new)
    assert re.search(r"[A-Za-z]{3,}", tokenizer.decode(new))


def test_heldout_perplexity_matches_the_model_card(model, tokenizer):
    metrics = json.loads((DEMO_DIR / "metrics.json").read_text())
    chunk_len = metrics["score_chunk_len"]
    # The procedure of scripts/train_demo_model.py: chunks of the held-out text, each after <s>.
    ids = tokenizer.encode((DEMO_DIR / "heldout.txt").read_text(), add_special_tokens=False)
    n_chunks = len(ids) // chunk_len
    chunks = torch.tensor(ids[: n_chunks * chunk_len]).view(n_chunks, chunk_len)
    bos = torch.full((n_chunks, 1), tokenizer.bos_token_id)
    with torch.no_grad():
        logprobs = model.token_logprobs(torch.cat([bos, chunks], dim=1))
    perplexity = math.exp(-logprobs.double().mean().item())

    assert chunks.numel() == metrics["heldout_tokens"]
    assert perplexity == pytest.approx(metrics["heldout_perplexity"], rel=0.01)
    card = (DEMO_DIR / "README.md").read_text()
    assert f"**{metrics['heldout_perplexity']:.2f}**" in card


def test_demo_weights_are_small_bf16():
    path = DEMO_DIR / "model.safetensors"
    assert path.stat().st_size < 25 * 2**20
    assert {tensor.dtype for tensor in load_file(path).values()} == {torch.bfloat16}
