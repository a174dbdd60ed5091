"""Gemma 2, Gemma 3 (text) and Mistral with a short sliding window, against transformers.

Every checkpoint has a sliding window of WINDOW tokens, so most prompts here outrun it; the
engine runs them alone and in ragged batches, with chunked prefill and prefix-cache hits, on
the C decode kernel and on the PyTorch path.
"""

from __future__ import annotations

import queue
import random

import pytest
import torch
from tiny_models import TINY, hf_greedy, make_engine, write_gguf, write_tokenizer

from astrai.config import ConfigError
from astrai.inference import STOP, GenerationParams
from astrai.kernels import native
from astrai.model import AutoModel
from astrai.model.families import config_from_hf
from astrai.tokenize import AutoTokenizer

WINDOW = 8
FAMILIES = {
    # soft-caps small enough to bite on random weights; a query scale other than 1/sqrt(16)
    "gemma2": {
        "attn_logit_softcapping": 2.0,
        "final_logit_softcapping": 8.0,
        "query_pre_attn_scalar": 24,
    },
    # two sliding layers with their own rope base, then a global one with linear scaling
    "gemma3_text": {
        "num_hidden_layers": 3,
        "sliding_window_pattern": 3,
        "rope_local_base_freq": 1000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 4.0},
        "query_pre_attn_scalar": 24,
    },
    "mistral": {},
}


def write_checkpoint(directory, family: str, **overrides):
    """A random-weight checkpoint of the family with a WINDOW-token sliding window."""
    import transformers

    classes = {
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
        "gemma3_text": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }
    config_cls, model_cls = classes[family]
    settings = {**TINY, "head_dim": 16, "sliding_window": WINDOW, **FAMILIES[family], **overrides}
    torch.manual_seed(3)
    model = model_cls(config_cls(**settings)).eval()
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if "norm" in name and family != "mistral":
                weight.normal_(0, 0.5)  # (1 + w) norms start at w = 0: tell them apart
            if "q_proj" in name or "k_proj" in name:
                weight.mul_(4.0)  # logits of a few units, which the soft-cap and window change
        # Random init gives nearly flat logits; scale the head so greedy choices are clear-cut.
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(directory, safe_serialization=True)
    write_tokenizer(directory)
    return directory


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(name, astrai model, transformers model, tokenizer) of one family's checkpoint."""
    import transformers

    directory = write_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager"
    )
    model = AutoModel.from_pretrained(directory)
    return request.param, model, reference.eval(), AutoTokenizer.from_pretrained(directory)


def test_config_reads_what_the_family_changes(family):
    name, model, _, _ = family
    config = model.config
    windows = [config.layer_window(i) for i in range(config.n_layers)]
    expected = {
        "gemma2": [WINDOW, None],
        "gemma3_text": [WINDOW, WINDOW, None],
        "mistral": [WINDOW, WINDOW],
    }
    assert windows == expected[name]
    gemma = name != "mistral"
    assert (config.post_norms, config.scale_embeddings) == (gemma, gemma)
    assert config.hidden_act == ("gelu_tanh" if gemma else "silu")
    assert config.rope_local_theta == (1000.0 if name == "gemma3_text" else None)


def test_dense_logits_match_transformers_past_the_window(family):
    _, model, reference, _ = family
    assert_dense_logits_match(model, reference)


def assert_dense_logits_match(model, reference):
    """Logits of a padded batch of prompts three windows long equal transformers'."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (3, 3 * WINDOW), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding
    mask[2, -7:] = 0  # right padding
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        logits = model.forward_dense(ids, mask)
    real = mask.bool()
    assert (logits[real] - expected[real]).abs().max().item() < 1e-4


def workload(seed: int = 0):
    """Prompts from shorter than the window to several windows long, some sharing a
    prefix of two pages of 16 tokens, with 1 to 12 tokens to generate."""
    rng = random.Random(seed)
    shared = [rng.randrange(4, 512) for _ in range(32)]
    prompts = [[rng.randrange(4, 512) for _ in range(n)] for n in (1, 5, 9, 17, 30, 61)]
    prompts += [shared + [rng.randrange(4, 512) for _ in range(n)] for n in (3, 11, 20)]
    return prompts, [rng.randint(1, 12) for _ in prompts]


@pytest.fixture(scope="module")
def reference_outputs(family):
    """The workload, transformers' greedy outputs, and its logprob of each output token."""
    _, _, reference, tokenizer = family
    prompts, max_tokens = workload()
    outputs, logprobs = [], []
    for prompt, n in zip(prompts, max_tokens, strict=True):
        output = hf_greedy(reference, prompt, n, tokenizer.stop_token_ids)
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1]
        chosen = logits.log_softmax(-1).gather(-1, torch.tensor(output)[:, None])[:, 0]
        outputs.append(output)
        logprobs.append(chosen.tolist())
    return prompts, max_tokens, outputs, logprobs


def run_with_logprobs(engine, prompts, params):
    """Each prompt's result and the logprobs of its tokens as the engine streamed them."""
    events = queue.SimpleQueue()
    tasks = [
        engine.submit(ids, p, lambda *event: events.put(event))[0]
        for ids, p in zip(prompts, params, strict=True)
    ]
    logprobs = {task: [] for task in tasks}
    for _ in tasks:
        while (event := events.get(timeout=120))[1] is not STOP:
            logprobs[event[0]] += [item.logprob for item in event[1].logprobs]
    return [task.result() for task in tasks], [logprobs[task] for task in tasks]


@pytest.fixture(params=["c-kernel", "sdpa"])
def decode_path(request, monkeypatch):
    if request.param == "c-kernel" and native.paged_attention is None:
        pytest.skip("the C extension paged_attention was not built")
    if request.param == "sdpa":
        monkeypatch.setattr(native, "paged_attention", None)
    return request.param


@pytest.mark.parametrize(
    "config",
    [{}, {"max_num_batched_tokens": 24, "page_size": 4}],
    ids=["whole-prompts", "chunked-small-pages"],
)
def test_greedy_batch_with_prefix_hits_equals_transformers(
    family, reference_outputs, config, decode_path
):
    _, model, _, tokenizer = family
    prompts, max_tokens, expected, expected_logprobs = reference_outputs
    params = [GenerationParams(max_tokens=m, temperature=0.0, logprobs=0) for m in max_tokens]
    with make_engine(model, tokenizer, **config) as engine:
        # alone first, which leaves the shared prefix in the cache for the batch
        alone, _ = run_with_logprobs(engine, prompts[-1:], params[-1:])
        batch, logprobs = run_with_logprobs(engine, prompts, params)
        assert engine.get_stats().pages_owned == 0
    assert alone[0].token_ids == expected[-1]
    assert [result.token_ids for result in batch] == expected
    assert all(result.cached_tokens >= 32 for result in batch[-3:])
    for got, want in zip(logprobs, expected_logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"hidden_activation": "gelu"}, "hidden_activation 'gelu'"),
        ({"use_bidirectional_attention": True}, "bidirectional"),
    ],
)
def test_gemma_settings_it_cannot_honour_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        config_from_hf({"model_type": "gemma2", **TINY, "head_dim": 16, **overrides})


# What llama.cpp's Gemma files leave to the reader: queries scaled by head_dim (here unlike
# dim / n_heads, which the 27B models take), Gemma 3's sliding layers in 5 of every 6 with rope
# base 10000. Everything else is in the metadata.
GGUF_FILES = {
    "gemma2": (
        {"query_pre_attn_scalar": 32, "head_dim": 32},
        {"attn_logit_softcapping": 2.0, "final_logit_softcapping": 8.0},
    ),
    "gemma3": (
        {
            "query_pre_attn_scalar": 32,
            "head_dim": 32,
            "num_hidden_layers": 6,
            "sliding_window_pattern": 6,
            "rope_local_base_freq": 10000.0,
        },
        {"rope.freq_base": 1e6, "rope.scaling.type": "linear", "rope.scaling.factor": 4.0},
    ),
}


@pytest.mark.parametrize("arch", list(GGUF_FILES))
def test_gguf_file_matches_transformers(tmp_path, arch):
    import transformers

    family = {"gemma2": "gemma2", "gemma3": "gemma3_text"}[arch]
    overrides, metadata = GGUF_FILES[arch]
    directory = write_checkpoint(tmp_path / "hf", family, **overrides)
    metadata["attention.sliding_window"] = WINDOW
    model = AutoModel.from_pretrained(write_gguf(tmp_path / "m.gguf", directory, arch, **metadata))
    assert model.config.rope_local_theta == (10000.0 if arch == "gemma3" else None)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager"
    )
    assert_dense_logits_match(model, reference.eval())


def test_q8_0_on_load_quantizes_every_linear_and_the_tied_head(tmp_path):
    from astrai.kernels.quant_ops import QuantizedWeight

    directory = write_checkpoint(tmp_path, "gemma2")
    dense = AutoModel.from_pretrained(directory)
    model = AutoModel.from_pretrained(directory, quantization="q8_0")
    assert isinstance(model.output.weight, QuantizedWeight)  # Gemma ties its head to the table
    assert all(
        isinstance(module.weight, QuantizedWeight)
        for layer in model.layers
        for module in (layer.attention.wo, layer.feed_forward.w13, layer.feed_forward.w2)
    )
    ids = torch.randint(0, 512, (1, 3 * WINDOW), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, quantized = dense.forward_dense(ids), model.forward_dense(ids)
    assert (quantized - expected).abs().max() < 0.05 * expected.abs().max()


def test_gemma3_sliding_layers_keep_their_rope_where_the_window_covers_the_context():
    layer_types = ["sliding_attention", "full_attention"]
    hf = {"model_type": "gemma3_text", **TINY, "sliding_window": 4096, "layer_types": layer_types}
    config = config_from_hf(hf)
    assert config.sliding_window is None  # 4096 >= max_position_embeddings: never bites
    assert [config.uses_local_rope(i) for i in range(2)] == [True, False]
