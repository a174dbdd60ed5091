"""The LLaVA-NeXT vision side against transformers: anyres preprocessing to the pixel, the image
features packed as LlavaNextModel packs them (unpadded, a newline per row), and the checkpoints
it refuses."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from tiny_models import noise_image

from astrai.config import ConfigError
from astrai.model import AutoModel

# (width, height) -> the grid of 28-pixel tiles its best resolution holds (rows, cols); the
# first three leave an odd number of patch rows or columns outside their aspect.
IMAGES = {
    "landscape": (noise_image(1, (45, 30)), (2, 2)),
    "portrait, tall": (noise_image(2, (21, 67)), (3, 1)),
    "wide": (noise_image(3, (90, 25)), (1, 3)),
    "square, larger": (noise_image(4, (300, 300)), (2, 2)),
    "smaller than a tile": (noise_image(5, (9, 5)), (1, 2)),
    "grey": (noise_image(6, (20, 36), "L"), (2, 1)),
    "transparent": (noise_image(7, (36, 20), "RGBA"), (1, 2)),
}


@pytest.fixture(scope="module")
def model(llava_next_dir):
    return AutoModel.from_pretrained(llava_next_dir)


@pytest.fixture(scope="module")
def hf_processor(llava_next_dir):
    from transformers import LlavaNextImageProcessorPil

    return LlavaNextImageProcessorPil.from_pretrained(llava_next_dir)


@pytest.mark.parametrize("name", IMAGES)
def test_preprocessing_equals_transformers_to_the_pixel(model, hf_processor, name):
    image, (rows, cols) = IMAGES[name]
    expected = hf_processor(images=[image], return_tensors="pt")["pixel_values"][0]
    assert model.vision.processor.grid(image.height, image.width) == (rows, cols)
    assert torch.equal(model.vision.processor(image), expected)


def test_image_features_equal_transformers_packing(model, llava_next_dir, hf_processor):
    """Each image's tokens take its tiles' features within its aspect and a newline per row,
    as transformers' get_image_features packs them, for images of three grids at once."""
    from transformers import LlavaNextForConditionalGeneration

    hf = LlavaNextForConditionalGeneration.from_pretrained(llava_next_dir).eval()
    images = [IMAGES[name][0] for name in ("landscape", "portrait, tall", "wide")]
    inputs = hf_processor(images=images, return_tensors="pt")
    with torch.no_grad():
        expected = hf.model.get_image_features(**inputs).pooler_output
    vision = model.vision
    tiled = [vision.tile(image) for image in images]
    encoded = vision.encode_images([image.pixel_values[0] for image in tiled])
    for image, encoding, features in zip(tiled, encoded, expected, strict=True):
        assert image.tokens_per_tile == len(features)
        torch.testing.assert_close(encoding[image.feature_rows], features, rtol=1e-5, atol=1e-5)


def _edited_copy(llava_next_dir, tmp_path, config=None, preprocessor=None):
    directory = tmp_path / "llava_next"
    shutil.copytree(llava_next_dir, directory)
    for name, settings in (("config.json", config), ("preprocessor_config.json", preprocessor)):
        edited = json.loads((directory / name).read_text())
        edited.update(settings or {})
        (directory / name).write_text(json.dumps(edited))
    return directory


@pytest.mark.parametrize(
    ("config", "preprocessor", "message"),
    [
        ({"vision_feature_select_strategy": "full"}, None, "without their CLS token"),
        ({"vision_feature_layer": [-2, -1]}, None, "vision_feature_layer"),
        ({"image_grid_pinpoints": [[28, 56]]}, None, "image_grid_pinpoints .* differ"),
        (
            {"image_grid_pinpoints": [[28, 50]]},
            {"image_grid_pinpoints": [[28, 50]]},
            "whole 28-pixel tiles",
        ),
        (None, {"crop_size": {"height": 28, "width": 14}}, "not square"),
        (None, {"image_processor_type": "CLIPImageProcessor"}, "LlavaNextImageProcessor"),
    ],
)
def test_unsupported_settings_are_refused_by_name(
    llava_next_dir, tmp_path, config, preprocessor, message
):
    with pytest.raises(ConfigError, match=message):
        AutoModel.from_pretrained(_edited_copy(llava_next_dir, tmp_path, config, preprocessor))
