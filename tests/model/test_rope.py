"""Rotary frequencies of every scaling type equal transformers' bit for bit."""

from __future__ import annotations

import pytest
import torch
from tiny_models import LLAMA3_ROPE, TINY

from astrai.config import ModelConfig
from astrai.model.families import config_from_hf
from astrai.model.rope import RotaryEmbedding, dynamic_ntk_inv_freq, rope_inv_freq

ROPES = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": LLAMA3_ROPE,
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn-mscale": {
        "rope_type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": 128,
        "mscale": 0.707,
        "mscale_all_dim": 1.0,
        "beta_fast": 16,
        "truncate": False,
    },
    "dynamic": {"rope_type": "dynamic", "factor": 2.5},
}


def hf_config(rope: dict, **settings):
    import transformers

    if "partial_rotary_factor" in settings:
        return transformers.Phi3Config(**TINY, rope_parameters=dict(rope), **settings)
    return transformers.LlamaConfig(**TINY, rope_parameters=dict(rope), **settings)


def astrai_config(hf) -> ModelConfig:
    return config_from_hf(hf.to_dict())


@pytest.mark.parametrize("name", list(ROPES))
def test_frequencies_and_attention_factor_equal_transformers(name):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = hf_config(ROPES[name])
    config = astrai_config(hf)
    if name == "default":
        expected = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.int64).float() / 16))
        attention_factor = 1.0
    else:
        expected, attention_factor = ROPE_INIT_FUNCTIONS[ROPES[name]["rope_type"]](hf, "cpu")
    assert torch.equal(rope_inv_freq(config), expected)
    assert RotaryEmbedding(config).attention_factor == attention_factor


def test_dynamic_frequencies_grow_with_the_position_as_transformers_computes_them():
    """transformers recomputes dynamic NTK's frequencies for position + 1 tokens when a step
    reaches past max_position_embeddings; astrai computes them per token."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = hf_config(ROPES["dynamic"])
    rope = RotaryEmbedding(astrai_config(hf))
    positions = torch.tensor([0, 1023, 1024, 1500, 2559])
    freqs = rope.token_inv_freq(positions + 1)[0]
    assert torch.equal(freqs[0], freqs[1])  # within the original context: the plain ones
    for row, position in enumerate(positions.tolist()[1:], 1):
        grown, _ = ROPE_INIT_FUNCTIONS["dynamic"](hf, "cpu", seq_len=torch.tensor(position + 1))
        assert torch.equal(freqs[row], grown if position >= 1024 else rope.inv_freq[0])
    assert torch.equal(dynamic_ntk_inv_freq(rope.config, positions[2:3] + 1)[0], freqs[2])


def test_longrope_switches_to_long_factors_past_the_original_context():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    longrope = {
        "rope_type": "longrope",
        "short_factor": [1.0, 1.5, 2.0, 3.0],
        "long_factor": [1.0, 4.0, 16.0, 64.0],
    }
    hf = hf_config(longrope, partial_rotary_factor=0.5, original_max_position_embeddings=64)
    rope = RotaryEmbedding(astrai_config(hf))
    short, attention_factor = ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu")
    long, _ = ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu", seq_len=65)
    freqs = rope.token_inv_freq(torch.tensor([0, 63, 64, 900]) + 1)[0]
    assert [torch.equal(f, short) for f in freqs] == [True, True, False, False]
    assert [torch.equal(f, long) for f in freqs] == [False, False, True, True]
    assert rope.attention_factor == attention_factor > 1.0
    cos, sin = rope(torch.tensor([70]))
    assert torch.allclose(cos**2 + sin**2, torch.full_like(cos, attention_factor**2))
    rope.to(torch.bfloat16)  # both sets stay fp32
    assert torch.equal(rope.inv_freq[0], short) and torch.equal(rope.long_inv_freq, long)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotation_rows_are_what_forward_computes_for_the_position_whatever_the_batch(dtype):
    """The table rotation() looks decode steps up in: grown past its first 1024 positions,
    rebuilt for another dtype and after .to(), each row transformers' cos and sin, and a
    position's row the same alone as in any batch."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf = hf_config(ROPES["llama3"])
    rope = RotaryEmbedding(astrai_config(hf))
    rope.rotation(torch.tensor([5]), None, dtype)
    assert rope.tables[0].shape[1] == 1024
    positions = torch.tensor([3000, 0, 5, 1023, 1024, 700, 5])
    cos, signed_sin = rope.rotation(positions, None, dtype)
    assert rope.tables[0].shape[1] == 4096 and rope.tables[0].dtype == dtype
    hf_cos, hf_sin = LlamaRotaryEmbedding(hf)(torch.zeros(1, dtype=dtype), positions[None])
    half = hf_sin.shape[-1] // 2
    tolerance = {"rtol": 0, "atol": 1e-6} if dtype == torch.float32 else {}
    torch.testing.assert_close(cos[0, :, 0], hf_cos[0], **tolerance)
    torch.testing.assert_close(signed_sin[0, :, 0, half:], hf_sin[0, :, half:], **tolerance)
    torch.testing.assert_close(signed_sin[0, :, 0, :half], -hf_sin[0, :, :half], **tolerance)
    for i, position in enumerate(positions.tolist()):
        alone = rope.rotation(torch.tensor([position]), None, dtype)
        assert torch.equal(alone[0][:, 0], cos[:, i]) and torch.equal(
            alone[1][:, 0], signed_sin[:, i]
        )
    rope.to(torch.float64)
    assert rope.tables is None
