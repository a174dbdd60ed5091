"""Images in the prompt of a tiny LLaVA-NeXT (anyres: each image cut into a grid of tiles chosen
by its size, its tiles' features unpadded to its aspect with a newline per row), over a Mistral
and a Qwen2 language model: a prompt's image tokens are those LlavaNextProcessor writes, and
greedy tokens and their logprobs equal transformers' generate with one image, two of other
grids and text only, alone, in a ragged batch with small chunks and after preemption (the
prefix cache's test, for every family, is in test_images.py)."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image
from tiny_models import assert_image_cases, make_engine, noise_image, run_ids

from astrai.inference import GenerationParams
from astrai.model import AutoModel
from astrai.tokenize import AutoTokenizer

MAX_TOKENS = 10
GREEDY = GenerationParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
# (width, height): a 2x2 grid of tiles, then a 3x1 and a 1x3 one; each leaves an odd number
# of patch rows or columns outside its aspect.
TEXTS = [
    ("Hello world!<image> What is this?", [noise_image(1, (45, 30))]),
    (
        "Paged attention<image> and<image> the quick brown fox",
        [noise_image(2, (21, 67)), noise_image(3, (90, 25))],
    ),
    ("Hello world!<image> What is this?", [noise_image(4, (45, 30))]),
    ("The quick brown fox jumps over the lazy dog.", []),
]


@pytest.fixture(scope="module", params=["llava_next_dir", "llava_next_qwen2_dir"])
def checkpoint(request):
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def vlm(checkpoint):
    return AutoModel.from_pretrained(checkpoint), AutoTokenizer.from_pretrained(checkpoint)


def hf_processor(directory):
    """transformers' LlavaNextProcessor of the checkpoint, set as llava-hf's checkpoints set it
    (the tower's CLS feature dropped)."""
    import transformers

    vision = json.loads((directory / "config.json").read_text())["vision_config"]
    return transformers.LlavaNextProcessor(
        transformers.LlavaNextImageProcessorPil.from_pretrained(directory),
        transformers.AutoTokenizer.from_pretrained(directory),
        patch_size=vision["patch_size"],
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
    )


def hf_inputs(directory, text: str, images: list) -> dict:
    return dict(hf_processor(directory)(text=[text], images=images or None, return_tensors="pt"))


@pytest.fixture(scope="module")
def cases(checkpoint, vlm):
    """(token ids, images) prompts; transformers' greedy tokens and their logprobs for each."""
    import transformers

    hf = transformers.LlavaNextForConditionalGeneration.from_pretrained(checkpoint).eval()
    expected, logprobs = [], []
    for text, images in TEXTS:
        inputs = hf_inputs(checkpoint, text, images)
        with torch.no_grad():
            out = hf.generate(
                **inputs,
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                pad_token_id=0,
                output_scores=True,
                return_dict_in_generate=True,
            )
        tokens = out.sequences[0, inputs["input_ids"].shape[1] :]
        scores = torch.stack(out.scores)[:, 0].log_softmax(-1)
        expected.append(tokens.tolist())
        logprobs.append(scores.gather(1, tokens[:, None])[:, 0])
    # A different image changes the output: the tests below would notice one left out.
    assert expected[0] != expected[2]
    prompts = [(vlm[1].encode(text), images) for text, images in TEXTS]
    return prompts, expected, logprobs


def test_prompt_layout_equals_transformers_processor(vlm, checkpoint):
    """Each image's `<image>` is expanded to as many tokens as LlavaNextProcessor writes for
    its size (70, 76 and 68 here), the token ids all equal."""
    model, tokenizer = vlm
    for text, images in TEXTS[:2]:
        with make_engine(model, tokenizer) as engine:
            prompt = engine.image_prompt(tokenizer.encode(text), images)
        assert prompt.token_ids == hf_inputs(checkpoint, text, images)["input_ids"][0].tolist()
    assert [image.length for image in prompt.images] == [76, 68]


def test_greedy_equals_transformers_alone(vlm, cases):
    """One image, two of different grids and token counts, and text only."""
    assert_image_cases(vlm, cases, MAX_TOKENS)


def test_batched_in_small_chunks(vlm, cases):
    """7 tokens a step: every image's tokens are split across chunks of a ragged batch (its
    tiles are encoded once, each chunk takes its rows), beside text-only requests."""
    assert_image_cases(
        vlm, cases, MAX_TOKENS, [3, 0, 1, 2, 3], max_num_batched_tokens=7, enable_prefix_cache=False
    )


def test_preempted_requests_recompute_with_their_images(vlm, cases):
    prompts, expected, _ = cases
    model, tokenizer = vlm
    c = model.config
    token_bytes = c.n_layers * 2 * c.n_kv_heads * c.head_dim * 4
    with make_engine(model, tokenizer) as engine:
        image_prompts = [engine.image_prompt(*prompt) for prompt in prompts[:3]]
    # Room for the three prompts and a page more: they cannot all grow to their outputs.
    pages = sum(-(-len(prompt) // 16) for prompt in image_prompts) + 1
    with make_engine(
        model, tokenizer, kv_cache_memory=pages * 16 * token_bytes, enable_prefix_cache=False
    ) as engine:
        image_prompts = [engine.image_prompt(*prompt) for prompt in prompts[:3]]
        results = [r[0].token_ids for r in run_ids(engine, image_prompts, [GREEDY] * 3)]
        preemptions = engine.get_stats().preemptions
    assert preemptions > 0
    assert results == expected[:3]


def test_images_of_the_same_pixels_and_other_features_never_share_kv(vlm):
    """A grey 12x32 and 12x33 image preprocess to the same tiles, but the second's aspect
    keeps fewer of their features: its prompt must not reuse the first's KV (the prefix
    cache's key of an image covers the features its tokens take, not only its pixels)."""
    model, tokenizer = vlm
    images = [Image.new("RGB", (12, height), (90, 120, 150)) for height in (32, 33)]
    processor = model.vision.processor
    assert torch.equal(processor(images[0]), processor(images[1]))
    ids = tokenizer.encode("Hello world!<image> What is this?")
    with make_engine(model, tokenizer, enable_prefix_cache=False) as engine:
        expected = [
            r[0].token_ids
            for r in run_ids(
                engine, [engine.image_prompt(ids, [image]) for image in images], [GREEDY] * 2
            )
        ]
    with make_engine(model, tokenizer) as engine:
        first, other = (
            run_ids(engine, [engine.image_prompt(ids, [image])], [GREEDY])[0][0] for image in images
        )
    assert other.cached_tokens == 0
    assert [first.token_ids, other.token_ids] == expected
