"""The model against transformers' own implementation, and its ragged-batch interface."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_switch import CountingKernels
from tiny_models import LLAMA3_ROPE, tiny_config, write_hf_model

from astrai.kernels import Linear, native
from astrai.model import AutoModel, Transformer

VARIANTS = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    # a copy: transformers adds rope_theta to the dict it is given
    "llama3-rope": ("llama", {"rope_scaling": dict(LLAMA3_ROPE)}),
    "linear-rope": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3": ("qwen3", {"head_dim": 32}),
    "mistral": ("mistral", {"num_key_value_heads": 1}),
}
PROMPT_LENGTHS = [5, 13, 1, 9]


@pytest.fixture(scope="module", params=list(VARIANTS))
def model_pair(request, tmp_path_factory):
    """(astrai model, transformers model) loaded from the same random-weight HF checkpoint."""
    import transformers

    arch, overrides = VARIANTS[request.param]
    directory = write_hf_model(tmp_path_factory.mktemp(request.param), arch, seed=1, **overrides)
    reference = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    return AutoModel.from_pretrained(directory), reference.eval()


def padded_batch(lengths: list[int], left: bool, vocab_size: int = 512, seed: int = 0):
    """Random prompts of the given lengths, padded to the longest; returns (ids, mask)."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        span = slice(width - length, width) if left else slice(0, length)
        ids[row, span] = torch.randint(0, vocab_size, (length,), generator=generator)
        mask[row, span] = 1
    return ids, mask


def reference_logits(reference, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        return reference(input_ids=ids, attention_mask=mask, position_ids=positions).logits


@pytest.mark.parametrize("left", [True, False], ids=["left-pad", "right-pad"])
def test_dense_logits_match_transformers(model_pair, left):
    model, reference = model_pair
    ids, mask = padded_batch(PROMPT_LENGTHS, left)
    with torch.no_grad():
        logits = model.forward_dense(ids, mask)
    expected = reference_logits(reference, ids, mask)
    assert logits.dtype == torch.float32
    assert logits.shape == (len(PROMPT_LENGTHS), max(PROMPT_LENGTHS), 512)
    real = mask.bool()
    assert (logits[real] - expected[real]).abs().max().item() < 1e-4
    assert torch.isfinite(logits).all(), "pad rows must stay finite so no NaN leaks through V"


def test_token_logprobs_match_transformers(model_pair):
    model, reference = model_pair
    ids, mask = padded_batch(PROMPT_LENGTHS, left=True)
    with torch.no_grad():
        logprobs = model.token_logprobs(ids, mask)
    expected = reference_logits(reference, ids, mask)[:, :-1].log_softmax(-1)
    expected = expected.gather(-1, ids[:, 1:, None])[..., 0]
    valid = mask[:, 1:].bool() & mask[:, :-1].bool()
    assert logprobs.shape == (len(PROMPT_LENGTHS), max(PROMPT_LENGTHS) - 1)
    assert (logprobs[valid] - expected[valid]).abs().max().item() < 1e-4
    assert (logprobs[~valid] == 0).all()


class RaggedAttention:
    """Causal attention per sequence of a flattened batch whose sequences lie back to back."""

    def __init__(self, lengths: list[int]):
        self.lengths = lengths

    def __call__(self, layer, q, k, v):
        outputs = []
        for q_seq, k_seq, v_seq in zip(
            q.split(self.lengths), k.split(self.lengths), v.split(self.lengths), strict=True
        ):
            # [len, heads, head_dim] -> [heads, len, head_dim]
            out = F.scaled_dot_product_attention(
                q_seq.transpose(0, 1),
                k_seq.transpose(0, 1),
                v_seq.transpose(0, 1),
                is_causal=True,
                enable_gqa=True,
            )
            outputs.append(out.transpose(0, 1))
        return torch.cat(outputs)


def test_ragged_forward_matches_dense(model_pair):
    model, _ = model_pair
    ids, mask = padded_batch(PROMPT_LENGTHS, left=False)
    flat_ids = torch.cat([ids[row, :n] for row, n in enumerate(PROMPT_LENGTHS)])
    positions = torch.cat([torch.arange(n) for n in PROMPT_LENGTHS])
    with torch.no_grad():
        dense = model.forward_dense(ids, mask)
        ragged = model.forward(flat_ids, positions, RaggedAttention(PROMPT_LENGTHS))
        last = torch.tensor(PROMPT_LENGTHS).cumsum(0) - 1
        last_logits = model.forward(flat_ids, positions, RaggedAttention(PROMPT_LENGTHS), last)
    expected = torch.cat([dense[row, :n] for row, n in enumerate(PROMPT_LENGTHS)])
    assert ragged.shape == (sum(PROMPT_LENGTHS), 512)
    assert (ragged - expected).abs().max().item() < 1e-5
    assert last_logits.shape == (len(PROMPT_LENGTHS), 512)
    assert torch.equal(last_logits, ragged[last])


class ContiguousCacheAttention:
    """One sequence with a growing per-layer K/V cache: the shape of a decode step."""

    def __init__(self, n_layers: int):
        self.keys = [None] * n_layers
        self.values = [None] * n_layers

    def __call__(self, layer, q, k, v):
        if self.keys[layer.index] is not None:
            k = torch.cat([self.keys[layer.index], k])
            v = torch.cat([self.values[layer.index], v])
        # q/k/v are valid for the call only (AttentionBackend): keep copies
        self.keys[layer.index], self.values[layer.index] = k.clone(), v.clone()
        n_new, n_all = q.shape[0], k.shape[0]
        # query i (absolute position n_all - n_new + i) sees keys at positions <= its own
        visible = torch.ones(n_new, n_all, dtype=torch.bool).tril(diagonal=n_all - n_new)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), visible, enable_gqa=True
        )
        return out.transpose(0, 1)


def test_incremental_decode_with_a_cache_matches_dense(model_pair):
    model, _ = model_pair
    ids, _ = padded_batch([12], left=False)
    ids = ids[0]
    cache = ContiguousCacheAttention(model.config.n_layers)
    with torch.no_grad():
        dense = model.forward_dense(ids[None])[0]
        steps = [model.forward(ids[:8], torch.arange(8), cache)]
        for position in range(8, 12):
            step_ids = ids[position : position + 1]
            steps.append(model.forward(step_ids, torch.tensor([position]), cache))
    assert (torch.cat(steps) - dense).abs().max().item() < 1e-5


def test_rope_frequencies_stay_fp32_when_the_model_is_cast():
    model = Transformer(tiny_config(rope_scaling=LLAMA3_ROPE))
    fp32_freqs = model.rope.inv_freq.clone()
    model.to(torch.bfloat16)
    assert model.tok_embeddings.weight.dtype == torch.bfloat16
    assert model.rope.inv_freq.dtype == torch.float32
    assert torch.equal(model.rope.inv_freq, fp32_freqs)
    logits = model.forward_dense(torch.tensor([[1, 2, 3]]))
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


def test_tied_model_has_no_separate_head():
    model = Transformer(tiny_config(tie_weight=True))
    assert model.output.weight.embedding is model.tok_embeddings
    assert not any(name.startswith("output") for name in model.state_dict())


def test_forward_captures_as_one_graph():
    """No data-dependent Python control flow: dynamo traces forward without a graph break."""
    torch._dynamo.reset()
    model = Transformer(tiny_config(use_qk_norm=True, attention_bias=True)).eval()
    ids = torch.tensor([3, 4, 5, 6, 7])
    positions = torch.tensor([0, 1, 2, 0, 1])
    attention = RaggedAttention([3, 2])
    compiled = torch.compile(model.forward, backend="eager", fullgraph=True)
    with torch.no_grad():
        expected = model.forward(ids, positions, attention, torch.tensor([2, 4]))
        # Close, not equal: eager runs the skinny-linear kernel, the traced graph F.linear.
        torch.testing.assert_close(
            compiled(ids, positions, attention, torch.tensor([2, 4])), expected
        )


@pytest.mark.skipif(native.fused_ops is None, reason="the C fused-ops kernels were not built")
def test_fp32_cpu_forward_takes_every_fused_kernel(monkeypatch):
    """RMSNorm (with and without the residual add), SwiGLU and rope reach their C kernels, and
    the embedding's and rope's table lookups the row gather."""
    calls: list[str] = []
    monkeypatch.setattr(native, "fused_ops", CountingKernels(native.fused_ops, calls))
    model = Transformer(tiny_config()).eval()
    with torch.no_grad():
        model.forward(torch.tensor([3, 4, 5]), torch.tensor([0, 1, 2]), RaggedAttention([3]))
    n_layers = model.config.n_layers
    # a norm before each of 2 sublayers per layer, plus the final one; one SwiGLU and rope each
    assert sorted(set(calls)) == ["gated_mul", "gather_rows", "rms_norm", "rope"]
    assert calls.count("rms_norm") == 2 * n_layers + 1
    assert calls.count("gated_mul") == calls.count("rope") == n_layers
    assert calls.count("gather_rows") == 3  # the embedding's rows, rope's cos and signed sin


def test_every_linear_runs_through_astrai_linear():
    """The skinny-linear kernel is reached through Linear; a plain nn.Linear would bypass it."""
    model = Transformer(tiny_config(tie_weight=False))
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert len(linears) == 4 * model.config.n_layers + 1  # wqkv, wo, w13, w2 and the head
