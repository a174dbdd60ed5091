"""Images in the prompt of a tiny Gemma 3 (Gemma3ForConditionalGeneration), whose image tokens
attend to each other: greedy tokens and their logprobs equal transformers' generate with one
and two images and with none, alone and in a ragged batch of small chunks, on the C kernel and
on SDPA, after preemption, and from a GGUF language model with its mmproj file (the prefix
cache's test, for every family, is in test_images.py)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import (
    greedy_with_logprobs,
    make_engine,
    noise_image,
    write_gemma3_gguf,
    write_gemma3_vlm_model,
)

from astrai.model import AutoModel
from astrai.tokenize import AutoTokenizer

MAX_TOKENS = 10
TEXTS = [
    ("Hello world!<start_of_image> What is this?", [noise_image(1)]),
    (
        "Paged attention<start_of_image> and<start_of_image> the quick brown fox",
        [noise_image(2, (30, 50)), noise_image(3, (100, 20))],
    ),
    ("Hello world!<start_of_image> What is this?", [noise_image(4)]),
    ("The quick brown fox jumps over the lazy dog.", []),
]


@pytest.fixture(scope="module")
def vlm(gemma3_vlm_dir):
    return AutoModel.from_pretrained(gemma3_vlm_dir), AutoTokenizer.from_pretrained(gemma3_vlm_dir)


@pytest.fixture(scope="module")
def expected(gemma3_vlm_dir):
    return transformers_greedy(gemma3_vlm_dir)


def transformers_greedy(checkpoint) -> tuple[list[list[int]], torch.Tensor]:
    """transformers' greedy tokens and their logprobs for each of TEXTS, its prompt made by
    Gemma3Processor (whose token_type_ids make each image's tokens see each other)."""
    import transformers

    hf = transformers.Gemma3ForConditionalGeneration.from_pretrained(checkpoint).eval()
    processor = transformers.Gemma3Processor(
        transformers.Gemma3ImageProcessorPil.from_pretrained(checkpoint),
        transformers.AutoTokenizer.from_pretrained(checkpoint),
        image_seq_length=hf.config.mm_tokens_per_image,
    )
    tokens, logprobs = [], []
    for text, images in TEXTS:
        inputs = processor(text=[text], images=[images] if images else None, return_tensors="pt")
        with torch.no_grad():
            out = hf.generate(
                **inputs, max_new_tokens=MAX_TOKENS, do_sample=False, output_scores=True,
                return_dict_in_generate=True, pad_token_id=0,
            )  # fmt: skip
        new = out.sequences[0, inputs["input_ids"].shape[1] :]
        scores = torch.log_softmax(torch.cat(out.scores).float(), dim=-1)
        tokens.append(new.tolist())
        logprobs.append(scores.gather(1, new[:, None])[:, 0])
    # A different image changes the output: the tests below would notice one left out.
    assert tokens[0] != tokens[2]
    return tokens, torch.stack(logprobs)


def prompts(engine, tokenizer) -> list:
    return [
        engine.image_prompt(tokenizer.encode(text), images) if images else tokenizer.encode(text)
        for text, images in TEXTS
    ]


def assert_equal(got, expected, rows=slice(None)) -> None:
    tokens, logprobs = got
    assert tokens == expected[0][rows]
    torch.testing.assert_close(logprobs, expected[1][rows], atol=1e-4, rtol=0)


def test_greedy_with_images_equals_transformers_alone(vlm, expected, decode_attention):
    for i in range(len(TEXTS)):
        with make_engine(*vlm) as engine:
            got = greedy_with_logprobs(engine, prompts(engine, vlm[1])[i : i + 1], MAX_TOKENS)
        assert_equal(got, expected, slice(i, i + 1))


def test_batched_in_small_chunks(vlm, expected, decode_attention):
    """5 tokens a step: the text around the images is split across chunks of a ragged batch,
    each image's 16 tokens computed in one chunk (past the budget), as they see each other."""
    with make_engine(*vlm, max_num_batched_tokens=5, enable_prefix_cache=False) as engine:
        got = greedy_with_logprobs(engine, prompts(engine, vlm[1]), MAX_TOKENS)
    assert_equal(got, expected)


def test_preempted_requests_recompute_with_their_images(vlm, expected):
    model, tokenizer = vlm
    c = model.config
    token_bytes = c.n_layers * 2 * c.n_kv_heads * c.head_dim * 4
    with make_engine(model, tokenizer) as engine:
        prompt_tokens = sum(len(prompt) for prompt in prompts(engine, tokenizer))
    # Room for the prompts and a page more: they cannot all grow to their outputs.
    pages = -(-prompt_tokens // 16) + 1
    with make_engine(
        model, tokenizer, kv_cache_memory=pages * 16 * token_bytes, enable_prefix_cache=False
    ) as engine:
        got = greedy_with_logprobs(engine, prompts(engine, tokenizer), MAX_TOKENS)
        preemptions = engine.get_stats().preemptions
    assert preemptions > 0
    assert_equal(got, expected)


def test_a_gguf_language_model_with_its_mmproj_file_equals_transformers(tmp_path):
    """Gemma 3 as llama.cpp ships it: the language model's GGUF file (whose layers slide 5 in
    6, so the twin's 3 all slide, over a window the images stay in) and the tower and
    projector's mmproj file (write_gemma3_gguf), loaded with mmproj=."""
    checkpoint = write_gemma3_vlm_model(
        tmp_path / "hf", layer_types=["sliding_attention"] * 3, sliding_window=32
    )
    language_model, mmproj = write_gemma3_gguf(tmp_path, checkpoint)
    model = AutoModel.from_pretrained(language_model, mmproj=mmproj)
    tokenizer = AutoTokenizer.from_pretrained(language_model)
    with make_engine(model, tokenizer) as engine:
        got = greedy_with_logprobs(engine, prompts(engine, tokenizer), MAX_TOKENS)
    assert_equal(got, transformers_greedy(checkpoint))
