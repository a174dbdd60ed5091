"""The family table: each name belongs to one record, unknown names are refused by name, every
native tensor has its checkpoint names, and a record alone adds a family."""

from __future__ import annotations

import pytest
import torch
from tiny_models import TINY

from astrai.config import ConfigError
from astrai.model import CheckpointError, Transformer
from astrai.model import families as family_table
from astrai.model.families import FAMILIES, Family, config_from_hf, gguf_family, hf_family


def test_each_model_type_and_architecture_names_one_family():
    model_types = [t for family in FAMILIES for t in family.model_types]
    architectures = [a for family in FAMILIES for a in family.architectures]
    assert len(set(model_types)) == len(model_types)
    assert len(set(architectures)) == len(architectures)
    assert len({family.name for family in FAMILIES}) == len(FAMILIES)


def test_unknown_names_are_refused_naming_the_known_ones():
    with pytest.raises(ConfigError, match=r"'gpt2'.*astrai, llama, .*granite"):
        hf_family("gpt2")
    with pytest.raises(CheckpointError, match=r"'gpt2'.*'llama', .*'granite'\]"):
        gguf_family("gpt2")


# What a tiny config of a family needs beyond TINY: M-RoPE's split of TINY's 8 frequencies.
TINY_SETTINGS = {"qwen2_vl_text": {"rope_parameters": {"mrope_section": [2, 3, 3]}}}


@pytest.mark.parametrize("family", FAMILIES, ids=lambda family: family.name)
def test_every_native_tensor_has_its_checkpoint_names(family):
    """A tiny config.json of each model type, as transformers writes it, builds a model whose
    every tensor the record names in both formats."""
    import transformers

    settings = {**TINY, **TINY_SETTINGS.get(family.name, {})}
    hf = transformers.AutoConfig.for_model(family.model_types[0], **settings).to_dict()
    config = config_from_hf(hf)
    with torch.device("meta"):
        shapes = {name: tuple(t.shape) for name, t in Transformer(config).state_dict().items()}
    for name, shape in shapes.items():
        hf_parts = family.hf_tensors(config, name, shape)
        gguf_parts = family.gguf_tensors(config, name, shape)
        assert sum(rows for _, (rows, *_) in hf_parts) == shape[0], name
        assert [part for _, part in gguf_parts] == [part for _, part in hf_parts], name


def test_a_record_alone_adds_a_family(monkeypatch):
    toy = Family(
        "toy",
        model_types=("toy_llama",),
        settings={"use_qk_norm": True},
        hf_settings=lambda hf, decoder: {"max_len": decoder["max_len"] // 2},
    )
    monkeypatch.setattr(family_table, "FAMILIES", (*FAMILIES, toy))
    config = config_from_hf({"model_type": "toy_llama", **TINY})
    assert (config.use_qk_norm, config.max_len) == (True, TINY["max_position_embeddings"] // 2)
