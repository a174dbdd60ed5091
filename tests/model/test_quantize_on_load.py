"""On-load quantization of dense checkpoints (AutoModel.from_pretrained(..., quantization=)):
the blocks against the gguf package's own quantize -> dequantize, the logits against a dense
model holding those round-tripped weights, and generation through the engine."""

from __future__ import annotations

import logging

import gguf
import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import write_hf_model

from astrai.config import ConfigError
from astrai.inference import InferenceEngine
from astrai.kernels import Linear, TiedTable
from astrai.kernels.quant_ops import QuantizedWeight
from astrai.model import AutoModel

QUANTIZATIONS = {
    "q8_0": gguf.GGMLQuantizationType.Q8_0,
    "q4_0": gguf.GGMLQuantizationType.Q4_0,
    "q4_1": gguf.GGMLQuantizationType.Q4_1,
    "q5_0": gguf.GGMLQuantizationType.Q5_0,
}
IDS = torch.tensor([[3, 17, 42, 99, 7, 250, 11, 64]])


@pytest.fixture(scope="module", params=["llama", "qwen2-tied"])
def checkpoint(request, tmp_path_factory):
    """A tiny HF model: llama with its own head, or qwen2 (q/k/v biases) with a tied head."""
    directory = tmp_path_factory.mktemp(request.param)
    if request.param == "llama":
        return write_hf_model(directory, "llama", seed=3)
    write_hf_model(directory, "qwen2", seed=4, tie_word_embeddings=True)
    tensors = load_file(directory / "model.safetensors")
    for name in tensors:
        if name.endswith("bias"):  # random, not the zeros of a fresh init
            tensors[name] = torch.randn(tensors[name].shape)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


def round_trip(weight: torch.Tensor, qtype) -> torch.Tensor:
    """What the gguf package's quantizer keeps of weight, dequantized."""
    array = gguf.quants.quantize(weight.float().numpy(), qtype)
    return torch.from_numpy(gguf.quants.dequantize(array, qtype))


def linears(model) -> dict[str, torch.nn.Module]:
    """Every layer that streams a weight, by name: the layers' linears and the LM head."""
    found = {
        name: module
        for name, module in model.named_modules()
        if name.startswith("layers.") and isinstance(module, Linear)
    }
    return {**found, "output": model.output}


def dense_weights(dense) -> dict[str, torch.Tensor]:
    """The dense model's weight of every layer linears() names (the tied head's: the table)."""
    weights = {name: module.weight for name, module in linears(dense).items() if module}
    tied = dense.config.tie_weight
    return {**weights, "output": dense.tok_embeddings.weight} if tied else weights


@pytest.mark.parametrize("quantization", sorted(QUANTIZATIONS))
def test_every_linear_holds_the_gguf_quantizers_blocks(checkpoint, quantization):
    qtype = QUANTIZATIONS[quantization]
    dense = AutoModel.from_pretrained(checkpoint)
    model = AutoModel.from_pretrained(checkpoint, quantization=quantization)
    layers = linears(model)
    assert len(layers) == 4 * model.config.n_layers + 1
    for name, weight in dense_weights(dense).items():
        assert isinstance(layers[name].weight, QuantizedWeight), name
        assert layers[name].weight.qtype == qtype
        assert torch.equal(layers[name].weight.dequantize(), round_trip(weight, qtype)), name
    # The table is looked up, not streamed: it stays dense even where the head is its copy.
    assert torch.equal(model.tok_embeddings.weight, dense.tok_embeddings.weight)
    if model.config.attention_bias:
        bias = model.layers[0].attention.wqkv.bias
        assert torch.equal(bias, dense.layers[0].attention.wqkv.bias)


@pytest.mark.parametrize("quantization", sorted(QUANTIZATIONS))
def test_logits_equal_the_dense_model_of_the_round_tripped_weights(
    checkpoint, quantization, monkeypatch
):
    qtype = QUANTIZATIONS[quantization]
    model = AutoModel.from_pretrained(checkpoint, quantization=quantization)
    reference = AutoModel.from_pretrained(checkpoint)
    for name, weight in dense_weights(reference).items():
        if name == "output" and reference.config.tie_weight:  # the tied head, as its own linear
            reference.output = Linear(*reversed(weight.shape), bias=False).requires_grad_(False)
        linears(reference)[name].weight.data = round_trip(weight, qtype)
    # Along the GEMM path the blocks are dequantized exactly, so both models compute the same.
    monkeypatch.setenv("ASTRAI_LINEAR_PATH", "gemm")
    with torch.no_grad():
        expected = reference.forward_dense(IDS)
        torch.testing.assert_close(model.forward_dense(IDS), expected, atol=1e-5, rtol=1e-5)
        # and the round trip moved the logits: the model above is not the dense one
        assert not torch.allclose(
            AutoModel.from_pretrained(checkpoint).forward_dense(IDS), expected
        )


@pytest.mark.parametrize("quantization", sorted(QUANTIZATIONS))
def test_engine_generates_greedily_with_quantized_linears(checkpoint, quantization, monkeypatch):
    from astrai.tokenize import AutoTokenizer

    monkeypatch.setenv("ASTRAI_LINEAR_PATH", "gemm")  # one path for the engine and the loop
    model = AutoModel.from_pretrained(checkpoint, quantization=quantization)
    assert isinstance(model.layers[0].feed_forward.w13.weight, QuantizedWeight)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    with InferenceEngine(model, tokenizer, max_seq_len=128, kv_cache_memory=8 << 20) as engine:
        prompt = engine.encode("Hello world")
        result = engine.generate_results("Hello world", max_tokens=8, temperature=0)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(8):
            ids = torch.cat([ids, model.forward_dense(ids)[:, -1].argmax(-1, keepdim=True)], 1)
    assert result.token_ids == ids[0, len(prompt) :].tolist()


@pytest.mark.parametrize("quantization", sorted(QUANTIZATIONS))
def test_weight_bytes_are_the_blocks_bytes(checkpoint, quantization):
    weights_per_block, block_bytes = gguf.GGML_QUANT_SIZES[QUANTIZATIONS[quantization]]
    dense = AutoModel.from_pretrained(checkpoint)
    model = AutoModel.from_pretrained(checkpoint, quantization=quantization)
    streamed = {n: w.numel() for n, w in dense_weights(dense).items()}
    # fp32 weights give way to blocks; a tied head is a copy of the table, added
    tied = streamed["output"] if dense.config.tie_weight else 0
    fp32 = sum(streamed.values()) - tied
    blocks = sum(streamed.values()) // weights_per_block * block_bytes
    assert model.weight_bytes() == dense.weight_bytes() - 4 * fp32 + blocks


def test_linears_of_partial_blocks_stay_dense_and_say_so(tmp_path, caplog):
    # 48 inputs to q/k/v, gate/up, o and the tied head: not whole 32-blocks; down has 128
    checkpoint = write_hf_model(tmp_path, "llama", hidden_size=48, tie_word_embeddings=True)
    with caplog.at_level(logging.INFO, logger="astrai.model.weights.quantize"):
        model = AutoModel.from_pretrained(checkpoint, quantization="q8_0")
    layer = model.layers[0]
    assert isinstance(layer.feed_forward.w2.weight, QuantizedWeight)
    for module in (layer.attention.wqkv, layer.attention.wo, layer.feed_forward.w13):
        assert isinstance(module.weight, torch.Tensor)
    assert isinstance(model.output.weight, TiedTable)
    assert "layers.0.attention.wqkv stays dense: its 48 input features" in caplog.text
    assert "the tied head stays dense" in caplog.text
    assert "layers.0.feed_forward.w2 stays dense" not in caplog.text


@pytest.mark.parametrize(
    ("quantization", "message"),
    [
        ("q4_k", r"'q4_k' \(astrai runs its blocks, but the gguf package has no quantizer.*"),
        ("Q6_K", r"'Q6_K' \(astrai runs.*GGUF file of that type"),
        ("int8", r"unsupported quantization 'int8'"),
    ],
)
def test_unknown_quantization_names_the_choices(llama_dir, quantization, message):
    with pytest.raises(ConfigError, match=message + ".*; choose one of q8_0, q4_0, q4_1, q5_0$"):
        AutoModel.from_pretrained(llama_dir, quantization=quantization)


def test_quantization_names_are_case_insensitive(llama_dir):
    model = AutoModel.from_pretrained(llama_dir, quantization="Q4_1")
    assert model.layers[0].feed_forward.w13.weight.qtype == gguf.GGMLQuantizationType.Q4_1


def test_contradictory_combinations_are_refused(llama_dir, tmp_path):
    gguf_file = tmp_path / "model.gguf"  # refused before it is read
    gguf_file.write_bytes(b"GGUF")
    with pytest.raises(ConfigError, match="dense checkpoints only; a GGUF file's linears keep"):
        AutoModel.from_pretrained(gguf_file, quantization="q8_0")
    with pytest.raises(ConfigError, match="quantization='q8_0' and dequantize=True ask for"):
        AutoModel.from_pretrained(llama_dir, quantization="q8_0", dequantize=True)
    with pytest.raises(ConfigError, match="needs device cpu, where the quantized kernels run"):
        AutoModel.from_pretrained(llama_dir, quantization="q8_0", device="cuda")
