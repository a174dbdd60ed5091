"""The Qwen2-VL / Qwen2.5-VL vision side against transformers: preprocessing to the pixel
(smart_resize within the pixel budget, the patch layout, the token grid), the tower's
embeddings (Qwen2.5-VL's windows included), M-RoPE's positions as get_rope_index gives them,
and the checkpoints it refuses."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from tiny_models import QWEN2_VL_PIXELS, noise_image

from astrai.config import ConfigError
from astrai.inference.mrope import MRopePositions
from astrai.model import AutoModel

FAMILIES = {"qwen2_vl_dir": "Qwen2VL", "qwen2_5_vl_dir": "Qwen2_5_VL"}


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request):
    return request.getfixturevalue(request.param), FAMILIES[request.param]


@pytest.fixture(scope="module")
def model(checkpoint):
    return AutoModel.from_pretrained(checkpoint[0])


@pytest.fixture(scope="module")
def hf_processor(checkpoint):
    """transformers' Pillow image processor (its default one needs torchvision)."""
    import transformers

    return transformers.Qwen2VLImageProcessorPil.from_pretrained(checkpoint[0])


IMAGES = {
    "landscape": lambda: noise_image(1, (40, 32)),
    "portrait": lambda: noise_image(2, (21, 67)),
    "over the pixel budget": lambda: noise_image(3, (300, 200)),
    "under the pixel budget": lambda: noise_image(4, (9, 5)),
    "long and thin": lambda: noise_image(5, (100, 7)),
    "grey": lambda: noise_image(6, (33, 31), "L"),
    "transparent": lambda: noise_image(7, (30, 45), "RGBA"),
}


@pytest.mark.parametrize("name", IMAGES)
def test_patches_and_grid_equal_transformers_to_the_pixel(model, hf_processor, name):
    expected = hf_processor(images=[IMAGES[name]()], return_tensors="pt")
    tile = model.vision.tile(IMAGES[name]())
    [[t, h, w]] = expected["image_grid_thw"].tolist()
    merge = hf_processor.merge_size
    assert tile.grid == (t, h // merge, w // merge)
    assert tile.tokens_per_tile == t * h * w // merge**2
    patches = tile.pixel_values[0]  # [rows, cols, merge^2, patch_dim]
    assert torch.equal(patches.reshape(-1, patches.shape[-1]), expected["pixel_values"])


def test_sizes_stay_within_the_pixel_budget(model):
    patch = model.vision.processor.patch_size
    for name, image in IMAGES.items():
        _, rows, cols = model.vision.tile(image()).grid
        pixels = rows * cols * (2 * patch) ** 2
        assert QWEN2_VL_PIXELS["min_pixels"] <= pixels <= QWEN2_VL_PIXELS["max_pixels"], name


def test_image_embeddings_equal_transformers(model, checkpoint, hf_processor):
    """Images of three sizes in one call: Qwen2.5-VL's window blocks see whole windows and
    windows the image's edge cuts."""
    import transformers

    directory, name = checkpoint
    hf = getattr(transformers, f"{name}ForConditionalGeneration").from_pretrained(directory)
    images = [IMAGES[name]() for name in ("landscape", "portrait", "grey")]
    inputs = hf_processor(images=images, return_tensors="pt")
    with torch.no_grad():
        expected = hf.eval().model.get_image_features(**inputs).pooler_output
    embeddings = model.vision.encode_images(
        [model.vision.tile(image).pixel_values[0] for image in images]
    )
    assert [len(e) for e in embeddings] == [len(e) for e in expected]
    for got, want in zip(embeddings, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_mrope_positions_equal_get_rope_index(model, checkpoint, hf_processor):
    """Text, an image, text, another image, text: each image's tokens on its grid from the
    position after the text before it, the text after it from its largest position + 1."""
    import transformers

    directory, name = checkpoint
    hf = getattr(transformers, f"{name}ForConditionalGeneration").from_pretrained(directory)
    images = [IMAGES["landscape"](), IMAGES["portrait"]()]
    tiles = [model.vision.tile(image) for image in images]
    pad = model.vision.image_token_id
    ids = [1, 2, 3, *[pad] * tiles[0].tokens_per_tile, 4, *[pad] * tiles[1].tokens_per_tile, 5, 6]
    grids = [(3, tiles[0].grid), (3 + tiles[0].tokens_per_tile + 1, tiles[1].grid)]
    input_ids = torch.tensor([ids])
    expected, deltas = hf.model.get_rope_index(
        input_ids,
        mm_token_type_ids=(input_ids == pad).int(),
        image_grid_thw=hf_processor(images=images, return_tensors="pt")["image_grid_thw"],
    )
    positions = MRopePositions.of(len(ids), grids)
    assert positions.prompt.tolist() == expected[:, 0].tolist()
    assert positions.delta == deltas.item() < 0
    after = positions.rows(len(ids) - 1, 3)  # the prompt's last token, then two generated
    assert after.tolist() == [[expected[0, 0, -1].item() + i for i in range(3)]] * 3


def _edited_copy(directory, tmp_path, file="config.json", **settings):
    copy = tmp_path / "qwen2_vl"
    shutil.copytree(directory, copy)
    config = json.loads((copy / file).read_text())
    config.update(settings)
    (copy / file).write_text(json.dumps(config))
    return copy


def test_a_flat_config_as_the_hub_checkpoints_have_it_loads_alike(qwen2_vl_dir, tmp_path):
    """Qwen2-VL's published config.json (transformers 4) keeps the language model's settings
    at the top level with rope_scaling {"type": "mrope", ...}."""
    config = json.loads((qwen2_vl_dir / "config.json").read_text())
    text = config.pop("text_config")
    rope = text.pop("rope_parameters")
    text.pop("model_type")
    flat = {
        **config,
        **text,
        "rope_theta": rope["rope_theta"],
        "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]},
    }
    copy = _edited_copy(qwen2_vl_dir, tmp_path)
    (copy / "config.json").write_text(json.dumps(flat))
    assert AutoModel.from_pretrained(copy).config == AutoModel.from_pretrained(qwen2_vl_dir).config


@pytest.mark.parametrize(
    ("file", "settings", "message"),
    [
        ("config.json", {"vision_start_token_id": None}, "vision_start_token_id"),
        ("preprocessor_config.json", {"merge_size": 3}, "merge_size"),
        ("preprocessor_config.json", {"do_normalize": False}, "do_normalize"),
        ("preprocessor_config.json", {"image_processor_type": "Foo"}, "'Foo'"),
    ],
)
def test_unsupported_settings_are_refused_by_name(qwen2_vl_dir, tmp_path, file, settings, message):
    with pytest.raises(ConfigError, match=message):
        AutoModel.from_pretrained(_edited_copy(qwen2_vl_dir, tmp_path, file, **settings))


def test_an_mrope_section_that_does_not_split_the_head_is_refused(qwen2_vl_dir, tmp_path):
    """Without one, transformers' default (16, 24, 24) is for a head of 128 dims."""
    config = json.loads((qwen2_vl_dir / "config.json").read_text())
    del config["text_config"]["rope_parameters"]["mrope_section"]
    copy = _edited_copy(qwen2_vl_dir, tmp_path, text_config=config["text_config"])
    with pytest.raises(ConfigError, match="mrope_section"):
        AutoModel.from_pretrained(copy)
