"""A checkpoint's pooling: a sentence-transformers directory's config (read, honoured by astrai
serve, embedding as sentence-transformers itself does) and a GGUF file's pooling_type."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from tiny_models import write_gguf

from astrai.flags import serve_settings
from astrai.launch import open_server
from astrai.model.checkpoint import CheckpointError
from astrai.model.pooling import checkpoint_pooling

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Hello world! How are you today?"]


def write_sentence_transformers(directory: Path, pooling: dict) -> Path:
    """Make an HF checkpoint a sentence-transformers model: modules.json with a Transformer,
    a Pooling module of the given config and a Normalize module."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
        {
            "idx": 2,
            "name": "2",
            "path": "2_Normalize",
            "type": "sentence_transformers.models.Normalize",
        },
    ]
    (directory / "modules.json").write_text(json.dumps(modules))
    (directory / "1_Pooling").mkdir(exist_ok=True)
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    (directory / "2_Normalize").mkdir(exist_ok=True)
    (directory / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 256}))
    # sentence-transformers pads its batches
    config_file = directory / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "pad_token": "</s>"}))
    return directory


def legacy(mode: str) -> dict:
    """An older sentence-transformers Pooling config: a boolean key per mode."""
    keys = {
        "cls": "pooling_mode_cls_token",
        "mean": "pooling_mode_mean_tokens",
        "max": "pooling_mode_max_tokens",
        "lasttoken": "pooling_mode_lasttoken",
    }
    return {"word_embedding_dimension": 64, **{key: m == mode for m, key in keys.items()}}


@pytest.fixture
def st_dir(llama_dir, tmp_path) -> Path:
    directory = tmp_path / "st-llama"
    shutil.copytree(llama_dir, directory)
    return directory


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"embedding_dimension": 64, "pooling_mode": "lasttoken"}, "last"),
        ({"embedding_dimension": 64, "pooling_mode": ["mean"]}, "mean"),
        (legacy("lasttoken"), "last"),
        (legacy("mean"), "mean"),
    ],
)
def test_the_pooling_config_is_read(st_dir, config, expected):
    assert checkpoint_pooling(write_sentence_transformers(st_dir, config)) == expected


def test_a_checkpoint_without_one_has_none(llama_dir, tmp_path):
    assert checkpoint_pooling(llama_dir) is None
    assert checkpoint_pooling(write_gguf(tmp_path / "plain.gguf", llama_dir, "llama")) is None
    none = write_gguf(tmp_path / "none.gguf", llama_dir, "llama", pooling_type=0)
    assert checkpoint_pooling(none) is None


@pytest.mark.parametrize(("pooling_type", "expected"), [(1, "mean"), (3, "last")])
def test_a_gguf_file_s_pooling_type_is_read(llama_dir, tmp_path, pooling_type, expected):
    path = write_gguf(tmp_path / "model.gguf", llama_dir, "llama", pooling_type=pooling_type)
    assert checkpoint_pooling(path) == expected


@pytest.mark.parametrize("pooling_type", [2, 4, 9])
def test_a_gguf_pooling_astrai_does_not_compute_is_refused(llama_dir, tmp_path, pooling_type):
    path = write_gguf(tmp_path / "model.gguf", llama_dir, "llama", pooling_type=pooling_type)
    with pytest.raises(CheckpointError, match="llama.pooling_type .*--pooling last or --pooling"):
        checkpoint_pooling(path)


@pytest.mark.parametrize(
    "config",
    [legacy("cls"), legacy("max"), {"pooling_mode": ["mean", "max"]}],
    ids=["cls", "max", "two"],
)
def test_a_pooling_astrai_does_not_compute_is_refused(st_dir, config):
    write_sentence_transformers(st_dir, config)
    with pytest.raises(CheckpointError, match="--pooling last or --pooling mean"):
        checkpoint_pooling(st_dir)


@pytest.mark.parametrize("mode", ["mean", "lasttoken"])
def test_embeddings_equal_sentence_transformers(st_dir, mode):
    """astrai serve takes the directory's pooling, and its embeddings are
    sentence-transformers' own (Transformer, Pooling, Normalize)."""
    st = pytest.importorskip("sentence_transformers")
    write_sentence_transformers(st_dir, {"embedding_dimension": 64, "pooling_mode": mode})
    reference = st.SentenceTransformer(str(st_dir), device="cpu", local_files_only=True)
    expected = torch.from_numpy(reference.encode(TEXTS, batch_size=1))
    engine, _ = open_server(*serve_settings([str(st_dir), "--max-seq-len", "256"]))
    with engine:
        assert engine.pooling == {"mean": "mean", "lasttoken": "last"}[mode]
        got = engine.embed(TEXTS)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_the_pooling_flag_overrides_the_config(st_dir):
    write_sentence_transformers(st_dir, legacy("cls"))  # refused, unless a flag chooses
    engine, _ = open_server(*serve_settings([str(st_dir), "--pooling", "mean"]))
    with engine:
        assert engine.pooling == "mean"
