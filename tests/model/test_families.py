"""Phi-3 (longrope, partial rotary, a sliding window), OLMo 2, Granite and the yarn and dynamic
rope scalings against transformers.

Every scaled rope here has an original context of ORIGINAL tokens; the sequences run past it,
token by token as transformers' generate runs them (see astrai.model.rope on why that is the
reference for dynamic and longrope).
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import torch
from tiny_models import (
    TINY,
    hf_greedy_outputs,
    make_engine,
    run_ids,
    tokens_logprobs_cached,
    write_gguf,
    write_hf_model,
)

from astrai.config import ConfigError, ModelConfig
from astrai.inference import GenerationParams
from astrai.kernels.quant_ops import QuantizedWeight
from astrai.model import AutoModel
from astrai.model.families import config_from_hf
from astrai.tokenize import AutoTokenizer

ORIGINAL = 48
VARIANTS = {
    # Phi-3.5 / Phi-4-mini: longrope over half of each head, fused qkv_proj and gate_up_proj
    "phi3-longrope": (
        "phi3",
        {
            "pad_token_id": 0,
            "sliding_window": 24,  # every layer slides, as on Phi-3-mini-4k
            "partial_rotary_factor": 0.5,
            "original_max_position_embeddings": ORIGINAL,
            "rope_parameters": {
                "rope_type": "longrope",
                "short_factor": [1.0, 1.5, 2.0, 3.0],
                "long_factor": [1.0, 4.0, 16.0, 64.0],
            },
        },
    ),
    "olmo2": ("olmo2", {}),
    "granite": (
        "granite",
        {
            "embedding_multiplier": 3.0,
            "attention_multiplier": 0.1,
            "residual_multiplier": 0.5,
            "logits_scaling": 2.0,
        },
    ),
    "llama-yarn": (
        "llama",
        {
            "max_position_embeddings": 4 * ORIGINAL,
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": ORIGINAL,
                "beta_fast": 8,
            },
        },
    ),
    # dynamic NTK scales from max_position_embeddings, which astrai stretches by factor
    "llama-dynamic": (
        "llama",
        {
            "max_position_embeddings": ORIGINAL,
            "rope_parameters": {"rope_type": "dynamic", "factor": 4.0},
        },
    ),
}


# GGUF metadata and tensors as llama.cpp's converter writes them for these variants
GGUF_METADATA = {
    "phi3-longrope": {
        "rope.dimension_count": 8,
        "attention.sliding_window": 24,
        "rope.scaling.original_context_length": ORIGINAL,
        "rope.scaling.attn_factor": math.sqrt(1 + math.log(1024 / ORIGINAL) / math.log(ORIGINAL)),
    },
    "olmo2": {},
    "granite": {
        "embedding_scale": 3.0,
        "attention.scale": 0.1,
        "residual_scale": 0.5,
        "logit_scale": 2.0,
    },
}


class Variant(NamedTuple):
    name: str
    directory: Path
    model: torch.nn.Module  # astrai's
    reference: torch.nn.Module  # transformers'
    tokenizer: object


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tmp_path_factory) -> Variant:
    """One variant's random-weight checkpoint, loaded by astrai and by transformers."""
    import transformers

    arch, overrides = VARIANTS[request.param]
    directory = tmp_path_factory.mktemp(request.param)
    write_hf_model(directory, arch, seed=2, random_norms=True, **overrides)
    reference = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    model = AutoModel.from_pretrained(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    return Variant(request.param, directory, model, reference.eval(), tokenizer)


def test_config_reads_what_the_variant_changes(variant):
    name, config = variant.name, variant.model.config
    scaling = config.rope_scaling or {}
    expected = {
        "phi3-longrope": (config.rotary_dim, scaling.get("rope_type"), config.sliding_window)
        == (8, "longrope", 24),
        "olmo2": (config.pre_norms, config.post_norms, config.qk_norm_across_heads)
        == (False, True, True),
        "granite": (
            config.embedding_multiplier,
            config.attention_scale,
            config.residual_multiplier,
            config.logits_scaling,
        )
        == (3.0, 0.1, 0.5, 2.0),
        "llama-yarn": scaling.get("attention_factor", 1.0) > 1.0,
        "llama-dynamic": (config.max_len, scaling.get("original_max_position_embeddings"))
        == (4 * ORIGINAL, ORIGINAL),
    }
    assert expected[name]


def assert_logits_match_transformers_step_by_step(model, reference) -> None:
    """transformers prefills 16 tokens, then takes one token per call with its KV cache, past
    the original context; astrai's one dense forward over the same tokens gives the same
    logits at every position."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (1, 2 * ORIGINAL), generator=generator)
    with torch.no_grad():
        out = reference(input_ids=ids[:, :16], use_cache=True)
        steps = [out.logits[0]]
        for t in range(16, ids.shape[1]):
            out = reference(input_ids=ids[:, t : t + 1], cache=out.past_key_values)
            steps.append(out.logits[0])
        logits = model.forward_dense(ids)[0]
    assert (logits - torch.cat(steps)).abs().max().item() < 1e-4


def test_logits_past_the_original_context_match_transformers(variant):
    assert_logits_match_transformers_step_by_step(variant.model, variant.reference)


def test_gguf_file_matches_transformers(variant, tmp_path):
    if variant.name not in GGUF_METADATA:
        pytest.skip("llama.cpp writes its own yarn and dynamic parameters; astrai reads neither")
    arch = VARIANTS[variant.name][0]
    rope = VARIANTS[variant.name][1].get("rope_parameters", {})
    factors = {
        f"rope_factors_{kind}.weight": np.array(rope[f"{kind}_factor"], np.float32)
        for kind in ("short", "long")
        if f"{kind}_factor" in rope
    }
    path = write_gguf(
        tmp_path / "tiny.gguf", variant.directory, arch, factors, **GGUF_METADATA[variant.name]
    )
    model = AutoModel.from_pretrained(path)
    assert_logits_match_transformers_step_by_step(model, variant.reference)


def test_q8_0_on_load_quantizes_every_linear_and_keeps_the_choices(variant):
    model = AutoModel.from_pretrained(variant.directory, quantization="q8_0")
    layer_linears = [m for n, m in model.named_modules() if n.endswith(("wqkv", "wo", "w13", "w2"))]
    assert layer_linears and all(isinstance(m.weight, QuantizedWeight) for m in layer_linears)
    ids = torch.randint(0, 512, (1, 2 * ORIGINAL), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        quantized, dense = model.forward_dense(ids), variant.model.forward_dense(ids)
    assert (quantized.argmax(-1) == dense.argmax(-1)).float().mean() > 0.9


def test_native_round_trip_keeps_the_logits(variant, tmp_path):
    model = variant.model
    model.save_pretrained(tmp_path)
    ids = torch.randint(0, 512, (1, 2 * ORIGINAL), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(
            AutoModel.from_pretrained(tmp_path).forward_dense(ids), model.forward_dense(ids)
        )


def workload(seed: int = 0):
    """Prompts of 1 to 40 tokens, three sharing a 32-token prefix (two pages of 16), with up
    to 16 tokens to generate: several outputs cross the original context."""
    rng = random.Random(seed)
    shared = [rng.randrange(4, 512) for _ in range(32)]
    prompts = [[rng.randrange(4, 512) for _ in range(n)] for n in (1, 7, 20, 40)]
    prompts += [shared + [rng.randrange(4, 512) for _ in range(n)] for n in (3, 9, 14)]
    return prompts, [6, 16, 12, 16, 8, 16, 14]


@pytest.fixture(scope="module")
def reference_outputs(variant):
    reference, tokenizer = variant.reference, variant.tokenizer
    prompts, max_tokens = workload()
    expected = hf_greedy_outputs(reference, prompts, max_tokens, tokenizer.stop_token_ids)
    return prompts, max_tokens, expected


@pytest.mark.parametrize(
    "config",
    [{}, {"max_num_batched_tokens": 24, "page_size": 4}],
    ids=["whole-prompts", "chunked-small-pages"],
)
def test_greedy_batch_with_prefix_hits_equals_transformers(variant, reference_outputs, config):
    model, tokenizer = variant.model, variant.tokenizer
    prompts, max_tokens, expected = reference_outputs
    params = [GenerationParams(max_tokens=m, temperature=0.0) for m in max_tokens]
    with make_engine(model, tokenizer, **config) as engine:
        alone = run_ids(engine, prompts[-1:], params[-1:])  # caches the shared prefix
        batch = run_ids(engine, prompts, params)
        assert engine.get_stats().pages_owned == 0
    assert alone[0][0].token_ids == expected[-1]
    assert [result[0].token_ids for result in batch] == expected
    assert all(result[0].cached_tokens >= 32 for result in batch[-3:])
    assert max(len(p) + len(out) for p, out in zip(prompts, expected, strict=True)) > ORIGINAL


def test_prompts_longer_than_the_original_context_equal_transformers(variant):
    """Prompts of 1.5x and 3x the original context: transformers prefills each in one call, so
    every prompt token rotates for the prompt's length (longrope's long factors, dynamic NTK's
    base grown to it); astrai does the same in whatever chunks it computes them. Two long
    prompts sharing their first 3 pages share those pages' K under longrope (both long), but
    not under dynamic NTK, where each length has its own base."""
    if not variant.model.rope.length_dependent:
        pytest.skip("this rope rotates a token by its position alone")
    rng = random.Random(5)
    shared = [rng.randrange(4, 512) for _ in range(ORIGINAL)]
    prompts = [shared + [rng.randrange(4, 512) for _ in range(n)] for n in (24, 2 * ORIGINAL)]
    assert [len(p) for p in prompts] == [3 * ORIGINAL // 2, 3 * ORIGINAL]
    reference = variant.reference

    def reset() -> None:
        """transformers' dynamic NTK keeps the base of the longest sequence it has seen until
        a call shorter than the original context resets it: each prompt starts afresh."""
        with torch.no_grad():
            reference(torch.tensor([[5]]))

    expected, first_logprobs = [], []
    for prompt in prompts:
        reset()
        expected += hf_greedy_outputs(reference, [prompt], [8], set())
        reset()
        with torch.no_grad():  # the first token's logprob, from transformers' one prefill call
            logits = reference(torch.tensor([prompt])).logits[0, -1]
        first_logprobs.append(logits.log_softmax(-1).max().item())
    params = GenerationParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
    for config in ({}, {"max_num_batched_tokens": 24, "page_size": 4}):
        with make_engine(variant.model, variant.tokenizer, **config) as engine:
            results = [tokens_logprobs_cached(engine, prompt, params) for prompt in prompts]
        assert [tokens for tokens, _, _ in results] == expected
        logprobs = [logprobs[0] for _, logprobs, _ in results]
        assert logprobs == pytest.approx(first_logprobs, abs=1e-4)
        shares = variant.model.rope.rope_type == "longrope"
        assert results[1][2] == (ORIGINAL if shares else 0)


def test_phi3_su_rope_is_read_as_longrope():
    hf = {
        "model_type": "phi3",
        **TINY,
        "original_max_position_embeddings": 256,
        "rope_scaling": {"type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8},
    }
    scaling = config_from_hf(hf).rope_scaling
    assert scaling["rope_type"] == "longrope"
    assert scaling["attention_factor"] == pytest.approx((1 + 2 * 0.6931 / 5.5452) ** 0.5, 1e-4)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"model_type": "llama", "partial_rotary_factor": 0.5}, "phi3 only"),
        (
            {"model_type": "phi3", "rope_scaling": {"type": "longrope", "short_factor": [1.0]}},
            "lacks",
        ),
        (
            {
                "model_type": "phi3",
                "partial_rotary_factor": 0.5,
                "rope_scaling": {"type": "su", "short_factor": [1.0] * 8, "long_factor": [1.0] * 8},
            },
            "4 frequencies",
        ),
    ],
)
def test_rope_settings_it_cannot_honour_are_refused(settings, message):
    with pytest.raises(ConfigError, match=message):
        config_from_hf({**TINY, **settings})


def test_native_configs_check_rotary_dim_and_a_local_rope_beside_yarn():
    shape = dict(vocab_size=64, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16)
    shape["dim_ffn"] = 64
    with pytest.raises(ConfigError, match="rotary_dim"):
        ModelConfig(**shape, rotary_dim=6 + 1)
    yarn = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64}
    yarn.update(attention_factor=1.0, beta_fast=32, beta_slow=1, truncate=True)
    assert ModelConfig(**shape, rope_scaling=yarn).rope_scaling == yarn
    with pytest.raises(ConfigError, match="rope_local_theta"):
        ModelConfig(**shape, rope_scaling=yarn, rope_local_theta=1000.0)
