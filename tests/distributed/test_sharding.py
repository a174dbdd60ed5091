"""Each rank loads its Megatron share of every tensor, and nothing else."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from gguf import GGMLQuantizationType
from tiny_models import write_gguf, write_hf_model

from astrai.config import ConfigError, ModelConfig, MoEConfig
from astrai.distributed import TensorShard, check_shardable
from astrai.kernels.quant_ops import ConcatenatedWeight, QuantizedWeight
from astrai.launch import DEMO_MODEL_DIR
from astrai.model import AutoModel
from astrai.model.weights.gguf import shard_problems


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    """Qwen2: biased q/k/v, 4 query heads over 2 KV heads."""
    return write_hf_model(tmp_path_factory.mktemp("qwen2"), "qwen2")


def shards(directory, size):
    return [
        AutoModel.from_pretrained(directory, shard=TensorShard(rank, size)) for rank in range(size)
    ]


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory):
    """Phi-3: q/k/v in one qkv_proj, gate and up in one gate_up_proj."""
    return write_hf_model(tmp_path_factory.mktemp("phi3"), "phi3", pad_token_id=0)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    """Qwen2-MoE: 4 experts, a shared expert with its gate, a dense layer."""
    settings = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    settings |= dict(shared_expert_intermediate_size=64, mlp_only_layers=[1])
    return write_hf_model(tmp_path_factory.mktemp("qwen2_moe"), "qwen2_moe", **settings)


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    """A Llama GGUF (q/k rows permuted as llama.cpp stores them) of Q8_0 linears and
    embedding, but for a Q4_1 v: a wqkv of two block types."""
    directory = tmp_path_factory.mktemp("gguf")
    hf_dir = write_hf_model(directory / "hf", "llama")
    linears = ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    types = {f"{name}.weight": GGMLQuantizationType.Q8_0 for name in linears}
    types["token_embd.weight"] = types["output.weight"] = GGMLQuantizationType.Q8_0
    types["attn_v.weight"] = GGMLQuantizationType.Q4_1
    return write_gguf(directory / "model.gguf", hf_dir, "llama", types=types)


def dense_weights(model) -> dict[str, torch.Tensor]:
    """The model's tensors by name, a quantized linear's weight decoded from its blocks."""
    state = dict(model.state_dict())
    for name, module in model.named_modules():
        if isinstance(getattr(module, "weight", None), QuantizedWeight | ConcatenatedWeight):
            state[f"{name}.weight"] = module.weight.dequantize()
    return {name: t for name, t in state.items() if not name.split(".")[-2].isdigit()}


@pytest.mark.parametrize("checkpoint", ["qwen2", "phi3", "native", "gguf", "moe"])
@pytest.mark.parametrize("size", [2, 4])
def test_the_ranks_shards_put_back_together_are_the_whole_model(
    qwen2_dir, phi3_dir, gguf_file, moe_dir, size, checkpoint
):
    """q, k and v split by heads (KV heads replicated when there are fewer than ranks), gate
    and up split each, wo and w2 split by columns; the rest held whole by every rank. Qwen2's
    checkpoints hold q, k, v, gate and up apart; Phi-3's and the native format fused; the GGUF
    file's linears stay in blocks, rows of them or columns cut at block boundaries (dequantized
    where a rank's columns would cut them: size 4 here)."""
    checkpoints = {"qwen2": qwen2_dir, "phi3": phi3_dir, "native": DEMO_MODEL_DIR}
    directory = {**checkpoints, "gguf": gguf_file, "moe": moe_dir}[checkpoint]
    dequantize = checkpoint == "gguf" and bool(shard_problems(gguf_file, size))
    whole = AutoModel.from_pretrained(directory, dequantize=dequantize)
    config = whole.config
    parts = [
        dense_weights(AutoModel.from_pretrained(directory, dequantize=dequantize, shard=shard))
        for shard in (TensorShard(rank, size) for rank in range(size))
    ]
    if checkpoint == "gguf" and not dequantize:
        assert isinstance(whole.layers[0].attention.wqkv.weight, ConcatenatedWeight)
    q_size, kv_size = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    kv_ranks = max(1, size // config.n_kv_heads)  # ranks sharing one KV head
    for name, tensor in dense_weights(whole).items():
        pieces = [part[name] for part in parts]
        if name.endswith(("wqkv.weight", "wqkv.bias")):
            q_rows, kv_rows = q_size // size, kv_size * kv_ranks // size
            q, k, v = zip(*(p.split([q_rows, kv_rows, kv_rows]) for p in pieces), strict=True)
            # ranks sharing a KV head hold the same one
            k, v = k[::kv_ranks], v[::kv_ranks]
            assert torch.equal(torch.cat([*q, *k, *v]), tensor), name
        elif name.endswith("w13.weight"):
            gates, ups = zip(*(p.chunk(2) for p in pieces), strict=True)
            assert torch.equal(torch.cat([*gates, *ups]), tensor), name
        elif name in ("tok_embeddings.weight", "output.weight"):
            assert torch.equal(torch.cat(pieces), tensor), name
        elif name.endswith(("wo.weight", "w2.weight")):
            assert torch.equal(torch.cat(pieces, dim=1), tensor), name
        else:
            assert all(torch.equal(p, tensor) for p in pieces), name


def test_a_rank_holds_half_of_the_weights(qwen2_dir):
    """Measured as bytes of parameters: each of 2 ranks holds half of every layer's weights,
    of the embedding and of the head, and the (replicated) norms."""
    whole = AutoModel.from_pretrained(qwen2_dir)
    norms = sum(p.nbytes for name, p in whole.named_parameters() if "norm" in name)
    for part in shards(qwen2_dir, 2):
        assert part.weight_bytes() == (whole.weight_bytes() - norms) / 2 + norms


def test_a_rank_reads_its_slices_only(qwen2_dir, monkeypatch):
    """No rank materialises a whole sharded tensor: every one is sliced before it is read."""
    from safetensors import safe_open

    whole_reads = []
    handle_type = type(safe_open(str(qwen2_dir / "model.safetensors"), framework="pt"))
    get_tensor = handle_type.get_tensor
    monkeypatch.setattr(
        handle_type,
        "get_tensor",
        lambda self, name: whole_reads.append(name) or get_tensor(self, name),
        raising=True,
    )
    AutoModel.from_pretrained(qwen2_dir, shard=TensorShard(1, 2))
    sharded = ("proj.weight", "proj.bias", "embed_tokens.weight", "lm_head.weight")
    assert whole_reads and not [name for name in whole_reads if name.endswith(sharded)]


@pytest.mark.parametrize(
    "overrides, size, problem",
    [
        ({"n_heads": 6, "n_kv_heads": 6}, 4, "n_heads=6"),
        ({"dim_ffn": 129}, 2, "dim_ffn=129"),
        ({"n_kv_heads": 2, "n_heads": 6}, 3, "n_kv_heads=2"),
        ({"vocab_size": 63}, 2, "vocab_size=63"),
        ({"moe": MoEConfig(n_experts=4, n_experts_per_token=2, dim_expert=33)}, 2, "dim_expert"),
    ],
)
def test_a_model_that_does_not_split_evenly_is_refused(overrides, size, problem):
    config = ModelConfig(
        vocab_size=64, dim=96, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=16, dim_ffn=128
    )
    with pytest.raises(ConfigError, match=problem):
        check_shardable(replace(config, **overrides), size)
