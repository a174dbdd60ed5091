"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE) against transformers."""

from __future__ import annotations

import random

import gguf
import pytest
import torch
from kernel_switch import CountingKernels
from tiny_models import hf_greedy, make_engine, run_ids, write_gguf, write_hf_model

from astrai.config import ConfigError, ModelConfig, MoEConfig
from astrai.inference import GenerationParams
from astrai.kernels import Linear, native
from astrai.kernels.quant_ops import QuantizedWeight
from astrai.model import AutoModel
from astrai.model.families import config_from_hf
from astrai.model.moe import GateProjection, MoEFeedForward
from astrai.tokenize import AutoTokenizer

# Each family with the settings that tell its layers apart: Mixtral sparse everywhere with
# renormalised weights; Qwen2-MoE's shared expert, q/k/v bias and a dense layer in
# mlp_only_layers; Qwen3-MoE's q/k norm, top-3 renormalised, sparse every second layer.
FAMILIES = {
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=64),
    "qwen2_moe": dict(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=96,
        mlp_only_layers=[1],
        num_hidden_layers=3,
    ),
    "qwen3_moe": dict(
        num_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        decoder_sparse_step=2,
        head_dim=32,
    ),
}
Q8_0 = gguf.GGMLQuantizationType.Q8_0
SPARSE_LAYERS = {
    "mixtral": [True, True],
    "qwen2_moe": [True, False, True],
    "qwen3_moe": [False, True],
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def checkpoint(request, tmp_path_factory):
    """(family, directory, transformers model) of a random-weight checkpoint."""
    import transformers

    family = request.param
    directory = write_hf_model(tmp_path_factory.mktemp(family), family, seed=2, **FAMILIES[family])
    reference = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    return family, directory, reference.eval()


@pytest.fixture(scope="module")
def model(checkpoint):
    return AutoModel.from_pretrained(checkpoint[1])


def test_logits_match_transformers(checkpoint, model):
    family, _, reference = checkpoint
    sparse = [isinstance(layer.feed_forward, MoEFeedForward) for layer in model.layers]
    assert sparse == SPARSE_LAYERS[family]
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (3, 11), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # a left-padded row
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model.forward_dense(ids, mask)
        expected = reference(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    real = mask.bool()
    assert (logits[real] - expected[real]).abs().max().item() < 1e-4


def test_fused_expert_layout_loads_the_same_weights(checkpoint, model, tmp_path):
    """transformers 5's own layout: a layer's experts in one gate_up_proj and one down_proj."""
    from safetensors import safe_open

    _, _, reference = checkpoint
    reference.save_pretrained(tmp_path, save_original_format=False)
    with safe_open(tmp_path / "model.safetensors", framework="pt") as stored:
        names = list(stored.keys())  # noqa: SIM118
    assert any(name.endswith("experts.gate_up_proj") for name in names)
    assert not any(name.endswith("experts.0.gate_proj.weight") for name in names)
    fused = AutoModel.from_pretrained(tmp_path)
    expected = model.state_dict()
    assert fused.state_dict().keys() == expected.keys()
    assert all(torch.equal(t, expected[name]) for name, t in fused.state_dict().items())


def test_greedy_through_the_engine_alone_and_in_a_ragged_batch(checkpoint, model):
    """One prompt alone, then a batch that reuses its cached prefix, prefilled in chunks
    beside decodes, each token for token as transformers' greedy generate."""
    _, directory, reference = checkpoint
    tokenizer = AutoTokenizer.from_pretrained(directory)
    rng = random.Random(0)
    shared = [rng.randrange(4, 512) for _ in range(40)]
    first = shared + [rng.randrange(4, 512) for _ in range(5)]
    rest = [shared + [rng.randrange(4, 512) for _ in range(n)] for n in (12, 1)] + [
        [rng.randrange(4, 512) for _ in range(n)] for n in (1, 7, 70)
    ]
    expected = [hf_greedy(reference, p, 8, tokenizer.stop_token_ids) for p in [first, *rest]]
    params = GenerationParams(max_tokens=8, temperature=0.0)
    with make_engine(model, tokenizer, max_num_batched_tokens=24, page_size=4) as engine:
        alone = run_ids(engine, [first], [params])
        batch = run_ids(engine, rest, [params] * len(rest))
    results = [group[0] for group in alone + batch]
    assert [r.token_ids for r in results] == expected
    assert results[1].cached_tokens >= 40 and results[2].cached_tokens >= 40


def test_experts_given_zero_one_and_many_rows_match_transformers(checkpoint, model):
    """A batch routed so that some expert gets no row, some one, some many: each expert's
    grouped product, the weighting and the sum match transformers' sparse block."""
    family, _, reference = checkpoint
    layer = SPARSE_LAYERS[family].index(True)
    moe = model.layers[layer].feed_forward
    router = moe.router.weight
    generator = torch.Generator().manual_seed(0)
    # Rows along an expert's router weight go to that expert first: four to expert 1, one to
    # expert 5, and a row of noise.
    x = torch.cat([router[[1, 1, 1, 1, 5]] * 4, torch.randn(1, router.shape[1])])
    x = x + 0.1 * torch.randn(x.shape, generator=generator)
    with torch.no_grad():
        _, experts = moe.route(x)
        counts = torch.bincount(experts.flatten(), minlength=router.shape[0]).tolist()
        out = moe(x)
        expected = reference.model.layers[layer].mlp(x[None])[0]
    assert 0 in counts and 1 in counts and max(counts) >= 4, counts
    assert (out - expected).abs().max() < 1e-5 * expected.abs().max()


@pytest.mark.skipif(native.skinny_linear is None, reason="the C skinny-linear kernel was not built")
def test_a_decode_row_reaches_the_skinny_kernel_in_every_expert_it_runs(
    checkpoint, model, monkeypatch
):
    """One row: the router, each of its top-k experts' two linears and (Qwen2-MoE) the shared
    expert and its gate, each one call of the few-row kernel."""
    calls: list[str] = []
    monkeypatch.setattr(native, "skinny_linear", CountingKernels(native.skinny_linear, calls))
    moe = next(m for m in model.modules() if isinstance(m, MoEFeedForward))
    with torch.no_grad():
        moe(torch.randn(1, model.config.dim))
    shared = 0 if moe.shared_expert is None else 3
    assert calls == ["linear"] * (1 + 2 * moe.top_k + shared)


def test_quantization_on_load_covers_the_experts_and_keeps_the_router_dense(
    checkpoint, model, monkeypatch
):
    """Every expert's linears hold q8_0 blocks (the logits are those of the dense model with
    the weights round-tripped through them); the router and the shared expert's gate do not."""
    _, directory, _ = checkpoint
    quantized = AutoModel.from_pretrained(directory, quantization="q8_0")
    reference = AutoModel.from_pretrained(directory)
    experts = 0
    for name, module in reference.named_modules():
        if isinstance(module, Linear):
            assert isinstance(quantized.get_submodule(name).weight, QuantizedWeight), name
            weight = gguf.quants.quantize(module.weight.numpy(), Q8_0)
            module.weight.data = torch.from_numpy(gguf.quants.dequantize(weight, Q8_0))
            experts += ".experts." in name
    assert experts == 2 * 8 * SPARSE_LAYERS[checkpoint[0]].count(True)
    gates = [name for name, m in reference.named_modules() if isinstance(m, GateProjection)]
    assert gates and all(
        torch.equal(quantized.get_submodule(name).weight, model.get_submodule(name).weight)
        for name in gates
    )
    # Along the GEMM path the blocks are dequantized exactly, so both models compute the same.
    monkeypatch.setenv("ASTRAI_LINEAR_PATH", "gemm")
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference.forward_dense(ids)
        torch.testing.assert_close(quantized.forward_dense(ids), expected, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(model.forward_dense(ids), expected)


# Each family as llama.cpp's converter writes it: Mixtral as a llama file with experts.
GGUF_FILES = {
    "mixtral": ("llama", {"expert_count": 8, "expert_used_count": 2}),
    "qwen2_moe": (
        "qwen2moe",
        {
            "expert_count": 8,
            "expert_used_count": 2,
            "expert_feed_forward_length": 32,
            "expert_shared_feed_forward_length": 96,
        },
    ),
    "qwen3_moe": (
        "qwen3moe",
        {"expert_count": 8, "expert_used_count": 3, "expert_feed_forward_length": 32},
    ),
}
QUANTIZED_EXPERTS = {
    end: Q8_0
    for end in (
        "exps.weight",
        "ffn_gate_shexp.weight",
        "ffn_up_shexp.weight",
        "ffn_down_shexp.weight",
    )
}


def test_gguf_files_match_transformers_and_keep_the_experts_blocks(
    checkpoint, model, tmp_path, monkeypatch
):
    """A GGUF file's 3-D expert tensors load as each expert's linear: F32 ones give
    transformers' logits, Q8_0 ones stay blocks that compute the dequantized model."""
    family, directory, reference = checkpoint
    arch, metadata = GGUF_FILES[family]
    plain = AutoModel.from_pretrained(
        write_gguf(tmp_path / "f32.gguf", directory, arch, **metadata)
    )
    sparse = [isinstance(layer.feed_forward, MoEFeedForward) for layer in plain.layers]
    assert sparse == SPARSE_LAYERS[family]
    assert plain.config.moe.norm_topk_prob == model.config.moe.norm_topk_prob
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(
            plain.forward_dense(ids), reference(ids).logits, atol=1e-4, rtol=1e-4
        )
    path = write_gguf(tmp_path / "q8.gguf", directory, arch, types=QUANTIZED_EXPERTS, **metadata)
    quantized = AutoModel.from_pretrained(path)
    moe = next(m for m in quantized.modules() if isinstance(m, MoEFeedForward))
    assert all(isinstance(expert.w13.weight, QuantizedWeight) for expert in moe.experts)
    # Along the GEMM path the blocks are dequantized exactly, so both models compute the same.
    monkeypatch.setenv("ASTRAI_LINEAR_PATH", "gemm")
    with torch.no_grad():
        expected = AutoModel.from_pretrained(path, dequantize=True).forward_dense(ids)
        torch.testing.assert_close(quantized.forward_dense(ids), expected, atol=1e-4, rtol=1e-4)


def test_native_format_round_trip(model, tmp_path):
    model.save_pretrained(tmp_path)
    loaded = AutoModel.from_pretrained(tmp_path)
    assert loaded.config == model.config and loaded.config.moe is not None
    ids = torch.tensor([[5, 9, 200, 31]])
    with torch.no_grad():
        assert torch.equal(loaded.forward_dense(ids), model.forward_dense(ids))


def test_moe_config_refuses_what_it_cannot_run():
    with pytest.raises(ConfigError, match="cannot exceed"):
        MoEConfig(n_experts=4, n_experts_per_token=5, dim_expert=8)
    with pytest.raises(ConfigError, match="dim_shared_expert"):
        MoEConfig(n_experts=4, n_experts_per_token=2, dim_expert=8, dim_shared_expert=0)
    native = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8)
    with pytest.raises(ConfigError, match="invalid moe settings"):
        ModelConfig(dim_ffn=64, moe={"n_experts": 4, "top_k": 2, "dim_expert": 8}, **native)
    hf = dict(
        model_type="mixtral",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=4096,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    assert config_from_hf(hf).moe == MoEConfig(4, 2, 64)
    with pytest.raises(ConfigError, match="sliding_window=1024"):
        config_from_hf({**hf, "sliding_window": 1024})
    qwen2_moe = {**hf, "model_type": "qwen2_moe", "num_experts": 4, "moe_intermediate_size": 8}
    with pytest.raises(ConfigError, match="lacks shared_expert_intermediate_size"):
        config_from_hf(qwen2_moe)
    assert config_from_hf({**qwen2_moe, "shared_expert_intermediate_size": 16}).moe == (
        MoEConfig(4, 2, 8, norm_topk_prob=False, dim_shared_expert=16)
    )
