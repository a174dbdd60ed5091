"""Images in the prompt of a tiny Qwen2-VL and a tiny Qwen2.5-VL (images of several sizes, M-RoPE
positions): greedy output equals transformers' generate with one and two images and with
text only, alone, in a ragged batch with small chunks, after preemption; a chat request
renders its image parts as Qwen2-VL's template does (the prefix cache's test, for every
family, is in test_images.py)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import assert_image_cases, make_engine, noise_image, run_ids

from astrai.inference import GenerationParams, GenerationRequest
from astrai.inference.task import RequestError
from astrai.model import AutoModel
from astrai.tokenize import AutoTokenizer

MAX_TOKENS = 10
GREEDY = GenerationParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
TEXTS = [
    (f"Hello world!{IMAGE} What is this?", [noise_image(1)]),
    (
        f"Paged attention{IMAGE} and{IMAGE} the quick brown fox",
        [noise_image(2, (30, 50)), noise_image(3, (100, 20))],
    ),
    (f"Hello world!{IMAGE} What is this?", [noise_image(4)]),
    ("The quick brown fox jumps over the lazy dog.", []),
]
FAMILIES = {"qwen2_vl_dir": "Qwen2VL", "qwen2_5_vl_dir": "Qwen2_5_VL"}


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request):
    return request.getfixturevalue(request.param), FAMILIES[request.param]


@pytest.fixture(scope="module")
def vlm(checkpoint):
    return AutoModel.from_pretrained(checkpoint[0]), AutoTokenizer.from_pretrained(checkpoint[0])


def hf_inputs(directory, token_ids: list[int], images: list) -> dict:
    """transformers' inputs for the prompt and images, as Qwen2VLProcessor makes them (it needs
    torchvision to build, so its expansion is written out): each `<|image_pad|>` repeated
    once per merged patch block of its image, and marked as an image token."""
    import transformers

    processor = transformers.Qwen2VLImageProcessorPil.from_pretrained(directory)
    pad = transformers.AutoTokenizer.from_pretrained(directory).convert_tokens_to_ids(
        "<|image_pad|>"
    )
    inputs = dict(processor(images=images, return_tensors="pt")) if images else {}
    blocks = processor.merge_size**2
    counts = iter((inputs["image_grid_thw"].prod(-1) // blocks).tolist() if images else [])
    ids = [t for token in token_ids for t in ([token] * next(counts) if token == pad else [token])]
    input_ids = torch.tensor([ids])
    return {
        **inputs,
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "mm_token_type_ids": (input_ids == pad).int(),
    }


def hf_generate(hf, directory, token_ids: list[int], images: list) -> list[int]:
    return hf_generate_with_logprobs(hf, directory, token_ids, images)[0]


def hf_generate_with_logprobs(
    hf, directory, token_ids: list[int], images: list
) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens and the logprob of each."""
    inputs = hf_inputs(directory, token_ids, images)
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
    logprobs = torch.stack(out.scores)[:, 0].log_softmax(-1)
    return tokens.tolist(), logprobs.gather(1, tokens[:, None])[:, 0]


def hf_token_ids(directory, text: str) -> list[int]:
    import transformers

    return transformers.AutoTokenizer.from_pretrained(directory)(text)["input_ids"]


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    import transformers

    directory, name = checkpoint
    model = getattr(transformers, f"{name}ForConditionalGeneration").from_pretrained(directory)
    return model.eval()


@pytest.fixture(scope="module")
def cases(checkpoint, vlm, hf_model):
    """(token ids, images) prompts and transformers' greedy output of each."""
    directory = checkpoint[0]
    generated = [
        hf_generate_with_logprobs(hf_model, directory, hf_token_ids(directory, text), images)
        for text, images in TEXTS
    ]
    expected = [tokens for tokens, _ in generated]
    # A different image changes the output: the tests below would notice one left out.
    assert expected[0] != expected[2]
    prompts = [(vlm[1].encode(text), images) for text, images in TEXTS]
    return prompts, expected, [logprobs for _, logprobs in generated]


def outputs(engine, prompts) -> list[list[int]]:
    """The greedy output of each (token ids, images) prompt."""
    prompts = [engine.image_prompt(*p) if p[1] else p[0] for p in prompts]
    return [r[0].token_ids for r in run_ids(engine, prompts, [GREEDY] * len(prompts))]


def test_prompt_layout_equals_transformers_processor(vlm, checkpoint):
    model, tokenizer = vlm
    for text, images in TEXTS[:2]:
        with make_engine(model, tokenizer) as engine:
            prompt = engine.image_prompt(tokenizer.encode(text), images)
        ids = hf_token_ids(checkpoint[0], text)
        expected = hf_inputs(checkpoint[0], ids, images)["input_ids"][0].tolist()
        assert prompt.token_ids == expected
        assert [image.length for image in prompt.images] == [
            model.vision.tile(image).tokens_per_tile for image in images
        ]


def test_greedy_equals_transformers_alone(vlm, cases):
    """One image, two of different sizes, and text only."""
    assert_image_cases(vlm, cases, MAX_TOKENS)


def test_batched_in_small_chunks(vlm, cases):
    """7 tokens a step: every image's tokens are split across chunks of a ragged batch (the
    encoder runs once for the whole image, each chunk takes its rows and their M-RoPE
    positions), beside text-only requests at other offsets."""
    assert_image_cases(
        vlm, cases, MAX_TOKENS, [3, 0, 1, 2, 3], max_num_batched_tokens=7, enable_prefix_cache=False
    )


def test_preempted_requests_recompute_with_their_images_and_positions(vlm, cases):
    """Three image prompts that outgrow the pool side by side: the one preempted recomputes
    its images and M-RoPE positions and answers as with room for all (30 tokens each)."""
    prompts = cases[0][:3]
    model, tokenizer = vlm
    params = GenerationParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    with make_engine(model, tokenizer) as engine:
        image_prompts = [engine.image_prompt(*prompt) for prompt in prompts]
        expected = [r[0].token_ids for r in run_ids(engine, image_prompts, [params] * 3)]
    c = model.config
    token_bytes = c.n_layers * 2 * c.n_kv_heads * c.head_dim * 4
    # Room for the three prompts and a page more; each grows by two pages to its output.
    pages = sum(-(-len(prompt) // 16) for prompt in image_prompts) + 1
    with make_engine(
        model, tokenizer, kv_cache_memory=pages * 16 * token_bytes, enable_prefix_cache=False
    ) as engine:
        image_prompts = [engine.image_prompt(*prompt) for prompt in prompts]
        results = [r[0].token_ids for r in run_ids(engine, image_prompts, [params] * 3)]
        preemptions = engine.get_stats().preemptions
    assert preemptions > 0
    assert results == expected


def test_a_chat_request_renders_its_image_parts_as_qwen2_vl_does(vlm, checkpoint, hf_model):
    """An image part renders as Qwen2-VL's own template writes one of a content list (no
    newline after it): the prompt is transformers' apply_chat_template's, expanded as its
    processor expands it, and the answer transformers'."""
    import transformers

    model, tokenizer = vlm
    image = noise_image(7, (50, 30))
    parts = [{"type": "image", "image": image}, {"type": "text", "text": "What is this?"}]
    request = GenerationRequest([{"role": "user", "content": parts}], params=GREEDY)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint[0])
    text = hf_tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, parts[1]]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert f"{IMAGE}What is this?<|im_end|>" in text
    ids = hf_tokenizer(text, add_special_tokens=False)["input_ids"]
    expected = hf_generate(hf_model, checkpoint[0], ids, [image])
    with make_engine(model, tokenizer) as engine:
        assert engine.image_placeholder == IMAGE
        prompt = engine.encode(request)
        assert prompt.token_ids == hf_inputs(checkpoint[0], ids, [image])["input_ids"][0].tolist()
        assert engine.generate_results(request).token_ids == expected


def test_an_image_too_narrow_for_qwen2_vl_is_refused_by_its_number(vlm):
    """transformers refuses an aspect ratio over 200; so does the engine, as a request error
    (a 400 from the server), naming the image."""
    model, tokenizer = vlm
    ids = tokenizer.encode(TEXTS[1][0])
    refused = pytest.raises(RequestError, match=r"image 2: the image is 402x2 pixels.*narrow")
    with make_engine(model, tokenizer) as engine, refused:
        engine.image_prompt(ids, [noise_image(1), noise_image(2, (402, 2))])
