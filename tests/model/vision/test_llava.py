"""The LLaVA vision side against transformers: preprocessing to the pixel, the encoder and
projector's embeddings, and the checkpoints it refuses."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from tiny_models import noise_image

from astrai.config import ConfigError
from astrai.model import AutoModel
from astrai.model.families import read_config


@pytest.fixture(scope="module")
def model(llava_dir):
    return AutoModel.from_pretrained(llava_dir)


@pytest.fixture(scope="module")
def hf_processor(llava_dir):
    from transformers import CLIPImageProcessor

    return CLIPImageProcessor.from_pretrained(llava_dir)


IMAGES = {
    "landscape": lambda: noise_image(1, (40, 32)),
    "portrait": lambda: noise_image(2, (21, 67)),
    "square, larger": lambda: noise_image(3, (300, 300)),
    "smaller than the crop": lambda: noise_image(4, (9, 5)),
    "grey": lambda: noise_image(5, (33, 31), "L"),
    "transparent": lambda: noise_image(6, (30, 45), "RGBA"),
}


@pytest.mark.parametrize("name", IMAGES)
def test_preprocessing_equals_transformers_to_the_pixel(model, hf_processor, name):
    image = IMAGES[name]()
    expected = hf_processor(images=[image], return_tensors="pt")["pixel_values"][0]
    assert torch.equal(model.vision.processor(image), expected)


def test_image_embeddings_equal_transformers(model, llava_dir, hf_processor):
    from transformers import LlavaForConditionalGeneration

    hf = LlavaForConditionalGeneration.from_pretrained(llava_dir).eval()
    images = [noise_image(1), noise_image(2, (50, 30))]
    pixels = hf_processor(images=images, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        expected = hf.get_image_features(pixel_values=pixels).pooler_output
    embeddings = model.vision.encode(pixels)
    assert embeddings.shape == (2, model.vision.tokens_per_image, model.config.dim)
    torch.testing.assert_close(embeddings, torch.stack(list(expected)), rtol=1e-5, atol=1e-5)


def test_the_language_model_reads_text_config(model, llava_dir):
    config = read_config(llava_dir)
    text = json.loads((llava_dir / "config.json").read_text())["text_config"]
    assert (config.dim, config.n_layers, config.vocab_size) == (
        text["hidden_size"],
        text["num_hidden_layers"],
        text["vocab_size"],
    )
    assert model.vision.tokens_per_image == 16  # 28x28 in 7x7 patches, CLS dropped


def _edited_copy(llava_dir, tmp_path, **settings):
    directory = tmp_path / "llava"
    shutil.copytree(llava_dir, directory)
    config = json.loads((directory / "config.json").read_text())
    config.update(settings)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"vision_feature_select_strategy": "pooled"}, "vision_feature_select_strategy"),
        ({"vision_feature_layer": [-2, -1]}, "vision_feature_layer"),
        ({"projector_hidden_act": "relu"}, "projector_hidden_act"),
    ],
)
def test_unsupported_settings_are_refused_by_name(llava_dir, tmp_path, settings, message):
    with pytest.raises(ConfigError, match=message):
        AutoModel.from_pretrained(_edited_copy(llava_dir, tmp_path, **settings))


def test_a_checkpoint_without_its_image_processor_is_refused(llava_dir, tmp_path):
    directory = _edited_copy(llava_dir, tmp_path)
    (directory / "preprocessor_config.json").unlink()
    with pytest.raises(FileNotFoundError, match="preprocessor_config.json"):
        AutoModel.from_pretrained(directory)
