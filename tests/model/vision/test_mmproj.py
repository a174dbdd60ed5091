"""llama.cpp's vision projector files (mmproj GGUF) that astrai cannot use are refused before
anything loads, saying what is wrong. (Loading one: tests/inference/test_images_idefics3.py and
test_images.py.)"""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
from tiny_models import write_gguf, write_idefics3_gguf, write_llava_gguf

from astrai.config import ConfigError
from astrai.model import AutoModel
from astrai.model.checkpoint import CheckpointError


def mmproj_metadata(path: Path, projector_type: str, projection_dim: int) -> Path:
    """An mmproj file of metadata only, which the loader reads before any tensor."""
    writer = gguf.GGUFWriter(path, "clip")
    writer.add_type("mmproj")
    writer.add_string("clip.projector_type", projector_type)
    writer.add_uint32("clip.vision.projection_dim", projection_dim)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def smolvlm_gguf(smolvlm_dir, tmp_path_factory) -> tuple[Path, Path]:
    return write_idefics3_gguf(tmp_path_factory.mktemp("smolvlm-gguf"), smolvlm_dir)


def test_a_file_that_is_no_projector_is_refused(smolvlm_gguf):
    language_model, _ = smolvlm_gguf
    with pytest.raises(CheckpointError, match="not a vision projector.*general.type is None"):
        AutoModel.from_pretrained(language_model, mmproj=language_model)


def test_a_projector_type_astrai_lacks_is_named(smolvlm_gguf, tmp_path):
    language_model, _ = smolvlm_gguf
    mmproj = mmproj_metadata(tmp_path / "mmproj.gguf", "qwen2vl", 64)
    with pytest.raises(CheckpointError, match="'qwen2vl' vision projector.*idefics3"):
        AutoModel.from_pretrained(language_model, mmproj=mmproj)


def test_a_projector_for_another_language_model_is_refused(smolvlm_gguf, tmp_path):
    language_model, _ = smolvlm_gguf
    mmproj = mmproj_metadata(tmp_path / "mmproj.gguf", "idefics3", 576)
    with pytest.raises(CheckpointError, match="576-wide.*embeds tokens in 64.*not one model"):
        AutoModel.from_pretrained(language_model, mmproj=mmproj)


def test_a_language_model_without_the_image_token_is_refused(smolvlm_gguf, llama_dir, tmp_path):
    text_only = write_gguf(tmp_path / "llama.gguf", llama_dir, "llama", tokenizer=True)
    with pytest.raises(CheckpointError, match="no '<image>' token"):
        AutoModel.from_pretrained(text_only, mmproj=smolvlm_gguf[1])


def test_an_mmproj_file_goes_with_a_gguf_language_model_only(smolvlm_gguf, smolvlm_dir):
    with pytest.raises(ConfigError, match="goes with a GGUF language model"):
        AutoModel.from_pretrained(smolvlm_dir, mmproj=smolvlm_gguf[1])
    with pytest.raises(ConfigError, match="does not exist"):
        AutoModel.from_pretrained(smolvlm_gguf[0], mmproj=smolvlm_gguf[1].with_name("none.gguf"))


@pytest.mark.parametrize(
    ("arrays", "message"),
    [
        ({"image_grid_pinpoints": [28, 56, 56, 28]}, "LLaVA-NeXT's"),
        ({"feature_layer": [1, 2]}, r"hidden states \[1, 2\].*reads one"),
    ],
)
def test_llava_projectors_astrai_cannot_run_are_refused(llava_dir, tmp_path, arrays, message):
    language_model, mmproj = write_llava_gguf(tmp_path, llava_dir, arrays)
    with pytest.raises(CheckpointError, match=message):
        AutoModel.from_pretrained(language_model, mmproj=mmproj)
