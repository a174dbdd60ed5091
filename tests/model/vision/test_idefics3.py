"""The Idefics3 / SmolVLM vision side against transformers: tiling and preprocessing to the
pixel, the prompt layout around each tile, the SigLIP tower and connector's embeddings, and
the checkpoints it refuses."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from tiny_models import noise_image

from astrai.config import ConfigError
from astrai.inference import InferenceEngine
from astrai.model import AutoModel
from astrai.model.vision.idefics3 import idefics3_position_ids
from astrai.tokenize import AutoTokenizer

FAMILIES = ("smolvlm_dir", "idefics3_dir")


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request):
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def model(checkpoint):
    return AutoModel.from_pretrained(checkpoint)


@pytest.fixture(scope="module")
def hf_processor(checkpoint):
    """transformers' processor (Idefics3Processor writes SmolVLM's image layout too;
    SmolVLMProcessor itself needs num2words for videos)."""
    import transformers

    model_type = json.loads((checkpoint / "config.json").read_text())["model_type"]
    images = {"smolvlm": transformers.SmolVLMImageProcessorPil, "idefics3": None}[model_type]
    images = (images or transformers.Idefics3ImageProcessorPil).from_pretrained(checkpoint)
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    return transformers.Idefics3Processor(images, tokenizer, image_seq_len=25)


IMAGES = {
    "landscape": lambda: noise_image(1, (40, 32)),
    "portrait": lambda: noise_image(2, (21, 67)),
    "wide, one row of tiles": lambda: noise_image(3, (100, 20)),
    "larger than the longest edge": lambda: noise_image(4, (300, 200)),
    "smaller than a tile": lambda: noise_image(5, (9, 5)),
    "grey": lambda: noise_image(6, (33, 31), "L"),
    "transparent": lambda: noise_image(7, (30, 45), "RGBA"),
}


@pytest.mark.parametrize("name", IMAGES)
def test_tiles_equal_transformers_to_the_pixel(model, hf_processor, name):
    image = IMAGES[name]()
    expected = hf_processor.image_processor(images=[image], return_tensors="pt")
    tiles = model.vision.tile(image).pixel_values
    assert torch.equal(tiles, expected["pixel_values"][0])
    assert expected["pixel_attention_mask"].all()  # one image: no tile is padded


@pytest.mark.parametrize("name", ["landscape", "wide, one row of tiles"])
def test_prompt_layout_equals_transformers_processor(model, checkpoint, hf_processor, name):
    image = IMAGES[name]()
    text = "Hello<image> What is this?"
    expected = hf_processor(text=[text], images=[[image]])["input_ids"][0]
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    with InferenceEngine(model, tokenizer, kv_cache_memory=8 << 20) as engine:
        prompt = engine.image_prompt(tokenizer.encode(text), [image])
    assert prompt.token_ids == expected
    image_token = model.vision.image_token_id
    assert all(
        prompt.token_ids[tile.start : tile.end] == [image_token] * tile.length
        for tile in prompt.images
    )
    assert sum(tile.length for tile in prompt.images) == expected.count(image_token)


def test_image_embeddings_equal_transformers(model, checkpoint, hf_processor):
    import transformers

    model_type = json.loads((checkpoint / "config.json").read_text())["model_type"]
    hf_class = {
        "smolvlm": transformers.SmolVLMForConditionalGeneration,
        "idefics3": transformers.Idefics3ForConditionalGeneration,
    }[model_type]
    hf = hf_class.from_pretrained(checkpoint).eval()
    images = [noise_image(1), noise_image(3, (100, 20))]
    inputs = hf_processor.image_processor(images=images, return_tensors="pt")
    with torch.no_grad():
        expected = hf.model.get_image_features(**inputs).pooler_output
    tiles = torch.cat([model.vision.tile(image).pixel_values for image in images])
    embeddings = model.vision.encode(tiles)
    assert embeddings.shape == (len(tiles), model.vision.tokens_per_image, model.config.dim)
    torch.testing.assert_close(
        embeddings.reshape(-1, model.config.dim), torch.cat(expected), rtol=1e-5, atol=1e-5
    )


def test_positions_repeat_where_idefics3s_buckets_do():
    """25 patches a side (the tiny tower's) is a side where transformers' bucketed positions
    are not 0..24: the embeddings above match only with the same positions."""
    side = 25
    rows = idefics3_position_ids(side).view(side, side)[:, 0] // side
    assert rows.tolist() != list(range(side))
    assert idefics3_position_ids(32).tolist() == list(range(32 * 32))


def _edited_copy(checkpoint, tmp_path, file="config.json", **settings):
    directory = tmp_path / "idefics3"
    shutil.copytree(checkpoint, directory)
    config = json.loads((directory / file).read_text())
    config.update(settings)
    (directory / file).write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize(
    ("file", "settings", "message"),
    [
        ("config.json", {"scale_factor": 3}, "scale_factor 3"),
        ("preprocessor_config.json", {"max_image_size": {"longest_edge": 40}}, "40-pixel tiles"),
        ("preprocessor_config.json", {"do_normalize": False}, "do_normalize"),
        ("preprocessor_config.json", {"size": {"height": 9, "width": 9}}, "size"),
        ("preprocessor_config.json", {"image_processor_type": "Foo"}, "'Foo'"),
    ],
)
def test_unsupported_settings_are_refused_by_name(smolvlm_dir, tmp_path, file, settings, message):
    with pytest.raises(ConfigError, match=message):
        AutoModel.from_pretrained(_edited_copy(smolvlm_dir, tmp_path, file, **settings))
