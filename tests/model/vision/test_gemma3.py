"""The Gemma 3 vision side against transformers: preprocessing to the pixel, the prompt layout
Gemma3Processor writes (its token ids), the SigLIP tower and pooling projector's embeddings,
the checkpoint layouts it loads and the settings it refuses."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import noise_image

from astrai.config import ConfigError
from astrai.inference import InferenceEngine
from astrai.model import AutoModel
from astrai.tokenize import AutoTokenizer


@pytest.fixture(scope="module")
def model(gemma3_vlm_dir):
    return AutoModel.from_pretrained(gemma3_vlm_dir)


@pytest.fixture(scope="module")
def hf_processor(gemma3_vlm_dir, model):
    import transformers

    return transformers.Gemma3Processor(
        transformers.Gemma3ImageProcessorPil.from_pretrained(gemma3_vlm_dir),
        transformers.AutoTokenizer.from_pretrained(gemma3_vlm_dir),
        image_seq_length=model.vision.tokens_per_image,
    )


IMAGES = {
    "landscape": lambda: noise_image(1, (40, 32)),
    "portrait": lambda: noise_image(2, (21, 67)),
    "the tower's size": lambda: noise_image(3, (32, 32)),
    "larger": lambda: noise_image(4, (300, 200)),
    "tiny": lambda: noise_image(5, (3, 2)),
    "grey": lambda: noise_image(6, (33, 31), "L"),
    "transparent": lambda: noise_image(7, (30, 45), "RGBA"),
}


@pytest.mark.parametrize("name", IMAGES)
def test_pixels_equal_transformers(model, hf_processor, name):
    image = IMAGES[name]()
    expected = hf_processor.image_processor(images=[image], return_tensors="pt")
    tile = model.vision.tile(image)
    assert torch.equal(tile.pixel_values, expected["pixel_values"])
    assert expected["num_crops"].tolist() == [0]  # pan-and-scan off: the image alone


@pytest.mark.parametrize("n_images", [1, 2])
def test_prompt_layout_equals_transformers_processor(model, gemma3_vlm_dir, hf_processor, n_images):
    """`<start_of_image>` becomes `\\n\\n<start_of_image>`, mm_tokens_per_image soft tokens and
    `<end_of_image>\\n\\n`, token for token as Gemma3Processor writes it; the image tokens it
    marks (token_type_ids 1) are each image's run."""
    images = [noise_image(1), noise_image(2, (50, 20))][:n_images]
    text = "Hello<start_of_image> What is" + "<start_of_image> this" * (n_images - 1) + "?"
    expected = hf_processor(text=[text], images=[images])
    tokenizer = AutoTokenizer.from_pretrained(gemma3_vlm_dir)
    with InferenceEngine(model, tokenizer, kv_cache_memory=8 << 20) as engine:
        prompt = engine.image_prompt(tokenizer.encode(text), images)
    assert prompt.token_ids == expected["input_ids"][0]
    image_rows = [i for i, kind in enumerate(expected["token_type_ids"][0]) if kind == 1]
    assert [i for image in prompt.images for i in range(image.start, image.end)] == image_rows
    assert all(image.bidirectional for image in prompt.images)
    vision = model.vision
    soft = tokenizer.encode("<image_soft_token>", add_special_tokens=False)
    assert [vision.soft_token_id] == soft
    assert [vision.image_token_id] == tokenizer.encode("<start_of_image>", add_special_tokens=False)


def test_image_embeddings_equal_transformers(model, gemma3_vlm_dir, hf_processor):
    import transformers

    hf = transformers.Gemma3ForConditionalGeneration.from_pretrained(gemma3_vlm_dir).eval()
    images = [noise_image(1), noise_image(3, (100, 20))]
    inputs = hf_processor.image_processor(images=images, return_tensors="pt")
    with torch.no_grad():
        expected = hf.model.get_image_features(inputs["pixel_values"]).pooler_output
    pixels = torch.cat([model.vision.tile(image).pixel_values for image in images])
    embeddings = model.vision.encode(pixels)
    assert embeddings.shape == (2, model.vision.tokens_per_image, model.config.dim)
    assert expected.abs().max() > 0.1  # the test model's projector is not the zero it starts at
    torch.testing.assert_close(embeddings, expected, rtol=1e-5, atol=1e-5)


def _edited_copy(checkpoint, tmp_path, file="config.json", **settings):
    directory = tmp_path / "gemma3"
    shutil.copytree(checkpoint, directory)
    config = json.loads((directory / file).read_text())
    config.update(settings)
    (directory / file).write_text(json.dumps(config))
    return directory


def test_the_hubs_layout_loads_as_transformers_5s(model, gemma3_vlm_dir, tmp_path):
    """The hub's checkpoints (transformers 4) name the tower vision_tower.vision_model.*; a
    checkpoint renamed so loads to the same weights."""
    directory = _edited_copy(gemma3_vlm_dir, tmp_path)
    tensors = load_file(directory / "model.safetensors")
    renamed = {
        name.replace("vision_tower.", "vision_tower.vision_model.", 1): tensor
        for name, tensor in tensors.items()
    }
    assert renamed.keys() != tensors.keys()
    save_file(renamed, directory / "model.safetensors")
    loaded = AutoModel.from_pretrained(directory)
    pixels = model.vision.tile(noise_image(1)).pixel_values
    assert torch.equal(loaded.vision.encode(pixels), model.vision.encode(pixels))


@pytest.mark.parametrize(
    ("file", "settings", "message"),
    [
        ("config.json", {"mm_tokens_per_image": 9}, "mm_tokens_per_image 9"),
        ("preprocessor_config.json", {"do_pan_and_scan": True}, "do_pan_and_scan"),
        ("preprocessor_config.json", {"size": {"height": 16, "width": 16}}, "16 pixels"),
        ("preprocessor_config.json", {"size": {"height": 32, "width": 16}}, "square"),
        ("preprocessor_config.json", {"do_rescale": False}, "do_rescale"),
        ("preprocessor_config.json", {"image_processor_type": "Foo"}, "'Foo'"),
    ],
)
def test_unsupported_settings_are_refused_by_name(
    gemma3_vlm_dir, tmp_path, file, settings, message
):
    with pytest.raises(ConfigError, match=message):
        AutoModel.from_pretrained(_edited_copy(gemma3_vlm_dir, tmp_path, file, **settings))
