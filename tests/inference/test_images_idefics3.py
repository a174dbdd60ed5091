"""Images in the prompt of a tiny SmolVLM (images split into tiles) and a tiny Idefics3 (one
tile an image): greedy output equals transformers' generate with one and two images, alone,
batched with text, in small chunks and after preemption (the prefix cache's test, for every
family, is in test_images.py)."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import make_engine, noise_image, run_ids, write_idefics3_gguf

from astrai.inference import GenerationParams
from astrai.model import AutoModel
from astrai.tokenize import AutoTokenizer

MAX_TOKENS = 10
GREEDY = GenerationParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
TEXTS = [
    ("Hello world!<image> What is this?", [noise_image(1)]),
    (
        "Paged attention<image> and<image> the quick brown fox",
        [noise_image(2, (30, 50)), noise_image(3, (100, 20))],
    ),
    ("Hello world!<image> What is this?", [noise_image(4)]),
]


@pytest.fixture(scope="module", params=["smolvlm_dir", "idefics3_dir"])
def checkpoint(request):
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def vlm(checkpoint):
    return AutoModel.from_pretrained(checkpoint), AutoTokenizer.from_pretrained(checkpoint)


def transformers_greedy(checkpoint, tokens_per_image: int) -> list[list[int]]:
    """transformers' greedy output of each of TEXTS, its prompt made by transformers' own
    processor."""
    import transformers

    model_type = json.loads((checkpoint / "config.json").read_text())["model_type"]
    name = {"smolvlm": "SmolVLM", "idefics3": "Idefics3"}[model_type]
    hf = getattr(transformers, f"{name}ForConditionalGeneration").from_pretrained(checkpoint)
    processor = transformers.Idefics3Processor(
        getattr(transformers, f"{name}ImageProcessorPil").from_pretrained(checkpoint),
        transformers.AutoTokenizer.from_pretrained(checkpoint),
        image_seq_len=tokens_per_image,
    )
    expected = []
    for text, images in TEXTS:
        inputs = processor(text=[text], images=[images], return_tensors="pt")
        with torch.no_grad():
            out = hf.eval().generate(
                **inputs, max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0
            )
        expected.append(out[0, inputs["input_ids"].shape[1] :].tolist())
    # A different image changes the output: the tests below would notice one left out.
    assert expected[0] != expected[2]
    return expected


@pytest.fixture(scope="module")
def cases(checkpoint, vlm):
    """(text, images) prompts, as token ids and images, and transformers' greedy output of
    each."""
    prompts = [(vlm[1].encode(text), images) for text, images in TEXTS]
    return prompts, transformers_greedy(checkpoint, vlm[0].vision.tokens_per_image)


def outputs(engine, prompts) -> list[list[int]]:
    """The greedy output of each prompt: token ids, or (token ids, images) pairs."""
    prompts = [p if isinstance(p[0], int) else engine.image_prompt(*p) for p in prompts]
    return [r[0].token_ids for r in run_ids(engine, prompts, [GREEDY] * len(prompts))]


def test_greedy_with_images_equals_transformers_alone(vlm, cases):
    prompts, expected = cases
    for prompt, tokens in zip(prompts, expected, strict=True):
        with make_engine(*vlm) as engine:
            assert outputs(engine, [prompt]) == [tokens]


def test_batched_with_text_in_small_chunks(vlm, cases):
    """7 tokens a step: every tile's 25 image tokens, and the layout text between tiles, are
    split across chunks of a ragged batch with text-only requests."""
    prompts, expected = cases
    text = [vlm[1].encode("The quick brown fox jumps over the lazy dog." * 3)]
    with make_engine(*vlm, enable_prefix_cache=False) as engine:
        [text_alone] = outputs(engine, text)
    with make_engine(*vlm, max_num_batched_tokens=7, enable_prefix_cache=False) as engine:
        assert outputs(engine, [text[0], *prompts, text[0]]) == [text_alone, *expected, text_alone]


def test_preempted_requests_recompute_with_their_tiles(vlm, cases):
    prompts, expected = cases
    model, tokenizer = vlm
    c = model.config
    token_bytes = c.n_layers * 2 * c.n_kv_heads * c.head_dim * 4
    with make_engine(model, tokenizer) as engine:
        prompt_tokens = sum(len(engine.image_prompt(*prompt)) for prompt in prompts)
    # Room for the three prompts and a page more: they cannot all grow to their outputs.
    pages = -(-prompt_tokens // 16) + 1
    with make_engine(
        model, tokenizer, kv_cache_memory=pages * 16 * token_bytes, enable_prefix_cache=False
    ) as engine:
        results = outputs(engine, prompts)
        preemptions = engine.get_stats().preemptions
    assert preemptions > 0
    assert results == expected


def test_a_gguf_language_model_with_its_mmproj_file_equals_transformers(smolvlm_dir, tmp_path):
    """SmolVLM as llama.cpp ships it: the language model's GGUF file and the vision tower's
    mmproj file (write_idefics3_gguf), loaded with mmproj=. An mmproj file keeps no splitting
    flag: its images are split into tiles, as SmolVLM's (and transformers' default) are."""
    language_model, mmproj = write_idefics3_gguf(tmp_path, smolvlm_dir)
    model = AutoModel.from_pretrained(language_model, mmproj=mmproj)
    tokenizer = AutoTokenizer.from_pretrained(language_model)
    prompts = [(tokenizer.encode(text), images) for text, images in TEXTS]
    with make_engine(model, tokenizer) as engine:
        results = outputs(engine, prompts)
    assert results == transformers_greedy(smolvlm_dir, model.vision.tokens_per_image)
