"""ModelConfig: native config.json, conversion from each HF family, and refused settings;
EngineConfig and LoadConfig: their fields' command-line metadata, kv_cache_memory's parser."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from tiny_models import LLAMA3_ROPE, TINY

from astrai.config import ConfigError, EngineConfig, LoadConfig, ModelConfig, parse_kv_cache_memory
from astrai.model.families import config_from_hf, read_config


def hf_config(directory: Path, arch: str, **overrides) -> Path:
    """Write the config.json that transformers itself writes for this family."""
    import transformers

    classes = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }
    # transformers edits rope dicts in place; hand it copies so the constants stay as written.
    overrides = {k: dict(v) if isinstance(v, dict) else v for k, v in overrides.items()}
    classes[arch](**{**TINY, **overrides}).save_pretrained(directory)
    return directory


def write_json(directory: Path, content: dict) -> Path:
    (directory / "config.json").write_text(json.dumps(content))
    return directory


@pytest.mark.parametrize(
    ("arch", "overrides", "expected"),
    [
        ("llama", {}, {"head_dim": 16, "attention_bias": False, "use_qk_norm": False}),
        ("llama", {"tie_word_embeddings": True}, {"tie_weight": True}),
        ("mistral", {"sliding_window": None, "num_key_value_heads": 1}, {"n_kv_heads": 1}),
        ("qwen2", {}, {"attention_bias": True, "use_qk_norm": False, "head_dim": 16}),
        ("qwen3", {"head_dim": 32}, {"use_qk_norm": True, "attention_bias": False, "head_dim": 32}),
        ("llama", {"rope_theta": 500000.0}, {"rope_theta": 500000.0, "rope_scaling": None}),
        ("llama", {"rope_scaling": LLAMA3_ROPE}, {"rope_scaling": LLAMA3_ROPE}),
        (
            "llama",
            {"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "rope_theta": 1e6},
            {"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "rope_theta": 1e6},
        ),
    ],
)
def test_hf_families_convert(tmp_path, arch, overrides, expected):
    config = read_config(hf_config(tmp_path, arch, **overrides))
    common = dict(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, dim_ffn=128)
    common.update(norm_eps=1e-6, max_len=1024, tie_weight=False, rope_theta=10000.0)
    for field, value in {**common, **expected}.items():
        assert getattr(config, field) == value, field


def test_transformers_4_spelling_of_rope_settings(tmp_path):
    """Older config.json files carry rope_theta at top level and rope_scaling with "type"."""
    old = {
        "model_type": "llama",
        **TINY,
        "rope_theta": 250000.0,
        "rope_scaling": {"type": "linear", "factor": 4.0},
    }
    config = read_config(write_json(tmp_path, old))
    assert config.rope_theta == 250000.0
    assert config.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    llama3 = {k: v for k, v in LLAMA3_ROPE.items() if k != "original_max_position_embeddings"}
    config = config_from_hf({"model_type": "llama", **TINY, "rope_scaling": llama3})
    assert config.rope_scaling["original_max_position_embeddings"] == 1024


def test_missing_head_dim_and_kv_heads_fall_back_like_transformers():
    hf = {"model_type": "mistral", **TINY, "head_dim": None}
    del hf["num_key_value_heads"]
    config = config_from_hf(hf)
    assert (config.head_dim, config.n_kv_heads) == (16, 4)


def test_unknown_model_type_lists_the_supported_ones(tmp_path):
    with pytest.raises(ConfigError, match="'gpt2'.*astrai, llama, mistral, qwen2, qwen3"):
        read_config(write_json(tmp_path, {"model_type": "gpt2", **TINY}))


@pytest.mark.parametrize(
    ("arch", "overrides", "layer_types"),
    [
        ("mistral", {"sliding_window": 64}, None),  # every layer slides
        (
            "qwen2",
            {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1},
            ("full_attention", "sliding_attention"),
        ),
        (
            "qwen3",
            {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 0},
            ("sliding_attention", "sliding_attention"),
        ),
    ],
)
def test_sliding_window_shorter_than_the_context_is_read(tmp_path, arch, overrides, layer_types):
    config = read_config(hf_config(tmp_path, arch, **overrides))
    assert (config.sliding_window, config.layer_types) == (64, layer_types)
    windows = [config.layer_window(i) for i in range(config.n_layers)]
    assert windows == [None if kind == "full_attention" else 64 for kind in layer_types or [0, 0]]


def test_transformers_4_qwen2_config_slides_from_max_window_layers():
    hf = {"model_type": "qwen2", **TINY, "use_sliding_window": True, "sliding_window": 64}
    config = config_from_hf({**hf, "max_window_layers": 1})
    assert config.layer_types == ("full_attention", "sliding_attention")


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [
        ("mistral", {"sliding_window": 4096}),  # never reached within max_position_embeddings
        ("qwen2", {"use_sliding_window": False, "sliding_window": 64}),  # Qwen2.5's shape
        ("qwen2", {"use_sliding_window": True, "sliding_window": 64}),  # no layer >= 28 slides
    ],
)
def test_sliding_window_that_never_applies_is_dropped(tmp_path, arch, overrides):
    config = read_config(hf_config(tmp_path, arch, **overrides))
    assert (config.sliding_window, config.layer_types) == (None, None)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"rope_scaling": {"rope_type": "proportional"}}, "rope scaling type 'proportional'"),
        ({"rope_scaling": {"rope_type": "yarn"}}, r"'yarn' lacks \['factor'\]"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"attention_bias": True}, "o_proj bias"),
        ({"partial_rotary_factor": 0.5}, "partial rotary"),
        ({"quantization_config": {"quant_method": "awq"}}, "quantized"),
    ],
)
def test_settings_the_model_cannot_honour_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        config_from_hf({"model_type": "llama", **TINY, **overrides})


def test_missing_required_hf_key_is_named():
    hf = {"model_type": "qwen3", **TINY}
    del hf["intermediate_size"]
    with pytest.raises(ConfigError, match="'intermediate_size'"):
        config_from_hf(hf)


def native(**overrides) -> ModelConfig:
    settings = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8)
    return ModelConfig(**{**settings, "dim_ffn": 64, **overrides})


def test_native_round_trip(tmp_path):
    config = native(rope_scaling=LLAMA3_ROPE, tie_weight=True, use_qk_norm=True, max_len=512)
    config.save(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text()) == config.to_dict()
    assert config.to_dict()["model_type"] == "astrai"
    assert read_config(tmp_path) == config
    del_type = {k: v for k, v in config.to_dict().items() if k != "model_type"}
    assert read_config(write_json(tmp_path, del_type)) == config


def test_native_unknown_and_missing_fields_are_refused(tmp_path):
    content = native().to_dict()
    with pytest.raises(ConfigError, match=r"unknown fields.*\['attention_dropout'\]"):
        read_config(write_json(tmp_path, {**content, "attention_dropout": 0.1}))
    del content["dim_ffn"]
    with pytest.raises(ConfigError, match=r"lacks required fields: \['dim_ffn'\]"):
        read_config(write_json(tmp_path, content))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"n_kv_heads": 3}, "multiple of n_kv_heads"),
        ({"dim": 0}, "dim must be a positive integer"),
        ({"head_dim": 7}, "head_dim must be even"),
        ({"rope_scaling": {"rope_type": "ntk", "factor": 2.0}}, "rope_scaling type 'ntk'"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "lacks"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1.0}}, "unknown"),
        ({"rope_scaling": {"rope_type": "linear", "factor": -2.0}}, "must be positive numbers"),
        (
            {"rope_scaling": {"rope_type": "frequency_factors", "factors": [1.0, 2.0]}},
            "2 factors; a rotary dimension of 8 has 4 frequencies",
        ),
    ],
)
def test_invalid_native_values_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        native(**overrides)


def test_missing_directory_and_config_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_config(tmp_path / "absent")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        read_config(tmp_path)


@pytest.mark.parametrize("spec", dataclasses.fields(EngineConfig), ids=lambda spec: spec.name)
def test_every_engine_setting_has_command_line_help(spec):
    assert spec.metadata.get("help"), f"EngineConfig.{spec.name} has no help text for its flag"


@pytest.mark.parametrize(("text", "value"), [("8000000", 8e6), ("0.25", 0.25), ("4e9", 4e9)])
def test_kv_cache_memory_reads_bytes_or_a_fraction(text, value):
    assert parse_kv_cache_memory(text) == value
    assert EngineConfig(kv_cache_memory=parse_kv_cache_memory(text)).kv_cache_memory == value


def test_cuda_graphs_asked_for_beside_lora_adapters_are_refused():
    """A captured graph cannot follow each step's adapters: asking for both would be accepted
    and the graphs not replayed. Without the option, adapters are allowed."""
    with pytest.raises(ConfigError, match=r"cuda_graphs=True \(--cuda-graphs\) with LoRA"):
        EngineConfig(cuda_graphs=True, loras=("sql=adapters/sql",))
    assert EngineConfig(loras=("sql=adapters/sql",)).lora_slots == 1


@pytest.mark.parametrize("text", ["", "lots", "8GB"])
def test_kv_cache_memory_that_is_no_number_is_refused(text):
    with pytest.raises(ConfigError, match=f"byte count .* fraction .* got {text!r}"):
        parse_kv_cache_memory(text)


@pytest.mark.parametrize("spec", dataclasses.fields(LoadConfig), ids=lambda spec: spec.name)
def test_every_load_setting_has_command_line_help(spec):
    assert spec.metadata.get("help"), f"LoadConfig.{spec.name} has no help text for its flag"


def test_load_flags_are_load_config_fields():
    from astrai.flags import build_parser, from_flags

    flags = ["--model", "m.gguf", "--dtype", "bfloat16", "--dequantize", "--device", "cpu"]
    args = build_parser().parse_args(["generate", *flags, "Hi"])
    expected = LoadConfig(model="m.gguf", dtype="bfloat16", dequantize=True, device="cpu")
    assert from_flags(LoadConfig, args) == expected
    assert from_flags(LoadConfig, build_parser().parse_args(["generate", "Hi"])) == LoadConfig()
    with pytest.raises(ConfigError, match=r"dtype must be one of \['auto'"):
        LoadConfig(dtype="int8")
