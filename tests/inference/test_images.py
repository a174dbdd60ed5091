"""Images in the prompt (a tiny LLaVA): greedy output equals transformers' generate with one
and two images, alone, batched with text, in chunks and after preemption; each image is
encoded once; and, for every vision-language family, the prefix cache never hands one image's
KV to another and a hit answers as without it."""

from __future__ import annotations

import queue

import pytest
import torch
from tiny_models import make_engine, noise_image, run_ids, write_llava_gguf

from astrai.inference import STOP, GenerationParams, GenerationRequest
from astrai.inference.task import RequestError
from astrai.model import AutoModel
from astrai.tokenize import AutoTokenizer

MAX_TOKENS = 10
GREEDY = GenerationParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def llava(llava_dir):
    return AutoModel.from_pretrained(llava_dir)


@pytest.fixture(scope="module")
def llava_tokenizer(llava_dir):
    return AutoTokenizer.from_pretrained(llava_dir)


@pytest.fixture(scope="module")
def hf_llava(llava_dir):
    from transformers import CLIPImageProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(llava_dir).eval()
    return model, CLIPImageProcessor.from_pretrained(llava_dir)


def image_prompt(tokenizer, vision, texts, images) -> tuple[list[int], list]:
    """(texts[0] <image> texts[1] <image> ... as token ids, one placeholder per image; the
    images), as InferenceEngine.image_prompt takes them."""
    ids = tokenizer.encode(texts[0])
    for text in texts[1:]:
        ids += [vision.image_token_id] + tokenizer.encode(text, add_special_tokens=False)
    return ids, images


def hf_generate(hf_llava, prompt: tuple[list[int], list], tokens_per_image: int) -> list[int]:
    """transformers' greedy output for the prompt, its placeholders expanded as LlavaProcessor
    expands `<image>`, its images preprocessed by transformers' own processor."""
    model, processor = hf_llava
    image_token = model.config.image_token_index
    token_ids, images = prompt
    ids = [
        t
        for token in token_ids
        for t in [token] * (tokens_per_image if token == image_token else 1)
    ]
    pixels = processor(images=images, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            pixel_values=pixels,
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


@pytest.fixture(scope="module")
def cases(llava, llava_tokenizer, hf_llava):
    """Prompts with one and two images and transformers' greedy output for each."""
    vision = llava.vision
    prompts = [
        image_prompt(llava_tokenizer, vision, ["Hello world!", " What is this?"], [noise_image(1)]),
        image_prompt(
            llava_tokenizer,
            vision,
            ["Paged attention", " and", " the quick brown fox"],
            [noise_image(2, (30, 50)), noise_image(3, (64, 40))],
        ),
        image_prompt(llava_tokenizer, vision, ["Hello world!", " What is this?"], [noise_image(4)]),
    ]
    expected = [hf_generate(hf_llava, p, vision.tokens_per_image) for p in prompts]
    # A different image changes the output: the tests below would notice one left out.
    assert expected[0] != expected[2]
    return prompts, expected


def outputs(engine, prompts) -> list[list[int]]:
    """The greedy output of each prompt: token ids, or (token ids, images) pairs."""
    prompts = [p if isinstance(p[0], int) else engine.image_prompt(*p) for p in prompts]
    return [r[0].token_ids for r in run_ids(engine, prompts, [GREEDY] * len(prompts))]


def test_greedy_with_images_equals_transformers_alone(llava, llava_tokenizer, cases):
    prompts, expected = cases
    for prompt, tokens in zip(prompts, expected, strict=True):
        with make_engine(llava, llava_tokenizer) as engine:
            assert outputs(engine, [prompt]) == [tokens]


def test_batched_with_text_in_small_chunks_each_image_encoded_once(
    llava, llava_tokenizer, cases, monkeypatch
):
    prompts, expected = cases
    text = [llava_tokenizer.encode("The quick brown fox jumps over the lazy dog." * 3)]
    with make_engine(llava, llava_tokenizer, enable_prefix_cache=False) as engine:
        [text_alone] = outputs(engine, text)
    encoded = []
    encode = llava.vision.encode
    monkeypatch.setattr(
        llava.vision, "encode", lambda pixels: encoded.append(len(pixels)) or encode(pixels)
    )
    # 7 tokens a step: every image's 16 placeholders are split across chunks.
    with make_engine(
        llava, llava_tokenizer, max_num_batched_tokens=7, enable_prefix_cache=False
    ) as engine:
        assert outputs(engine, [text[0], *prompts, text[0]]) == [text_alone, *expected, text_alone]
    assert sum(encoded) == 4  # four images, each encoded once


def test_embeddings_are_freed_once_their_placeholders_are_computed(llava, llava_tokenizer, cases):
    prompts, _ = cases
    events = queue.SimpleQueue()
    held_at_first_token = []

    def callback(task, event):
        if event is not STOP and len(task.output_ids) == 1:
            held_at_first_token.append([image.embeddings is not None for image in task.images])
        events.put(event)

    with make_engine(llava, llava_tokenizer, max_num_batched_tokens=7) as engine:
        tasks = [
            task
            for prompt in prompts
            for task in engine.submit(engine.image_prompt(*prompt), GREEDY, callback)
        ]
        for _ in tasks:
            while events.get(timeout=120) is not STOP:
                pass
    assert held_at_first_token == [[False] * len(images) for _, images in prompts]


@pytest.mark.parametrize(
    "checkpoint",
    [
        "llava_dir", "llava_next_dir", "smolvlm_dir", "idefics3_dir", "qwen2_vl_dir",
        "qwen2_5_vl_dir", "gemma3_vlm_dir",
    ],
)  # fmt: skip
def test_prefix_hits_keep_outputs_and_images_never_share_kv(request, checkpoint):
    """For every vision-language family: the same text with another image must not reuse the
    first image's KV (the poisoning case); the same text and image must, and answer as
    without the cache (each family's output without it equals transformers', above and in
    test_images_llava_next.py, test_images_idefics3.py, test_images_qwen2_vl.py and
    test_images_gemma3.py)."""
    directory = request.getfixturevalue(checkpoint)
    model, tokenizer = (
        AutoModel.from_pretrained(directory),
        AutoTokenizer.from_pretrained(directory),
    )
    ids = tokenizer.encode("Hello world! The quick brown fox")
    ids += [*model.vision.placeholder_ids, *tokenizer.encode(" What?", add_special_tokens=False)]
    images = [noise_image(1), noise_image(4)]
    with make_engine(model, tokenizer, enable_prefix_cache=False) as engine:
        expected = outputs(engine, [(ids, [image]) for image in images])
    # A different image changes the output: a hit on the first image's KV would show.
    assert expected[0] != expected[1]
    with make_engine(model, tokenizer, max_num_batched_tokens=16) as engine:
        first, again, other = (
            run_ids(engine, [engine.image_prompt(ids, [image])], [GREEDY])[0][0]
            for image in (images[0], images[0], images[1])
        )
    assert first.cached_tokens == 0
    assert again.cached_tokens > 0
    assert other.cached_tokens == 0
    assert [first.token_ids, again.token_ids, other.token_ids] == [*expected[:1], *expected]


def test_a_gguf_language_model_with_its_mmproj_file_equals_transformers(
    llava, llava_dir, cases, tmp_path
):
    """LLaVA-1.5 as llama.cpp ships it: the language model's GGUF file and the vision tower's
    mmproj file ("mlp" projector, written as llama.cpp's converter writes it:
    write_llava_gguf), loaded with mmproj=: its images' pixels and embeddings are those of the
    checkpoint directory's vision module (equal to transformers', tests/model/vision/
    test_llava.py), its greedy output transformers'."""
    language_model, mmproj = write_llava_gguf(tmp_path, llava_dir)
    model = AutoModel.from_pretrained(language_model, mmproj=mmproj)
    images = [noise_image(1), noise_image(2, (30, 50))]
    pixels = torch.stack([model.vision.processor(image) for image in images])
    assert torch.equal(pixels, torch.stack([llava.vision.processor(image) for image in images]))
    torch.testing.assert_close(model.vision.encode(pixels), llava.vision.encode(pixels))
    tokenizer = AutoTokenizer.from_pretrained(language_model)
    prompts, expected = cases
    with make_engine(model, tokenizer) as engine:
        assert outputs(engine, prompts) == expected


def test_preempted_requests_recompute_with_their_images(llava, llava_tokenizer, cases):
    prompts, expected = cases
    c = llava.config
    token_bytes = c.n_layers * 2 * c.n_kv_heads * c.head_dim * 4
    # 6 pages of 16 tokens: the three prompts (about 40 to 60 tokens each) cannot all grow.
    with make_engine(
        llava, llava_tokenizer, kv_cache_memory=6 * 16 * token_bytes, enable_prefix_cache=False
    ) as engine:
        results = outputs(engine, prompts)
        preemptions = engine.get_stats().preemptions
    assert preemptions > 0
    assert results == expected


def test_a_chat_request_places_its_image_parts(llava, llava_tokenizer, hf_llava):
    image = noise_image(7)
    request = GenerationRequest(
        [
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": image},
                    {"type": "text", "text": "What is this?"},
                ],
            }
        ],
        params=GREEDY,
    )
    placeholder = llava_tokenizer.id_to_token(llava.vision.image_token_id)
    assert placeholder == "<image>"
    ids = llava_tokenizer.apply_chat_template(
        [{"role": "user", "content": "<image>\nWhat is this?"}]
    )
    expected = hf_generate(hf_llava, (ids, [image]), llava.vision.tokens_per_image)
    with make_engine(llava, llava_tokenizer) as engine:
        assert engine.generate_results(request).token_ids == expected


def test_image_prompts_that_cannot_run_are_refused(llava, llava_tokenizer, model, tokenizer):
    ids, images = image_prompt(
        llava_tokenizer, llava.vision, ["a", "b", "c"], [noise_image(1), noise_image(2)]
    )
    with make_engine(llava, llava_tokenizer, max_images_per_request=1) as engine:
        with pytest.raises(RequestError, match="2 images, over the limit of 1"):
            engine.image_prompt(ids, images)
        with pytest.raises(RequestError, match="2 image placeholder.* but 1 image"):
            engine.image_prompt(ids, images[:1])
        with pytest.raises(RequestError, match="image token but no image"):
            engine.submit(ids, GREEDY, lambda *_: None)
    with make_engine(model, tokenizer) as engine, pytest.raises(RequestError, match="text only"):
        engine.image_prompt([1, 2, 3], [noise_image(1)])
