"""kv_cache_dtype: an fp32 model over a bf16 or fp16 KV cache, on the C decode kernel and on
the SDPA path, against the same model over an fp32 cache."""

from __future__ import annotations

import logging
import random

import pytest
import torch
from kernel_switch import kernel_or_fallback
from tiny_models import greedy_with_logprobs, make_engine

from astrai.config import ConfigError, EngineConfig

# Logprobs of the chosen tokens may move this much when K/V are rounded (bf16 keeps 8 bits of
# mantissa, fp16 11); far below the greedy margins of the tiny model.
LOGPROB_TOLERANCE = {"bf16": 0.02, "fp16": 0.003}


@pytest.fixture(params=["c-kernel", "sdpa"])
def decode_attention(request, monkeypatch):
    return kernel_or_fallback(request, monkeypatch, "paged_attention")


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(0)
    # long enough that decodes read several pages, and one longer than a prefill chunk's budget
    return [[rng.randrange(4, 400) for _ in range(n)] for n in (3, 40, 90, 130)]


@pytest.fixture(scope="module")
def fp32_reference(model, tokenizer, prompts):
    with make_engine(model, tokenizer, max_num_batched_tokens=64) as engine:
        return greedy_with_logprobs(engine, prompts)


@pytest.mark.parametrize("kv_cache_dtype", ["bf16", "fp16"])
def test_a_half_width_cache_stays_close_to_fp32(
    model, tokenizer, prompts, fp32_reference, kv_cache_dtype, decode_attention
):
    expected_ids, expected_logprobs = fp32_reference
    with make_engine(
        model, tokenizer, max_num_batched_tokens=64, kv_cache_dtype=kv_cache_dtype
    ) as engine:
        stored = {"bf16": torch.bfloat16, "fp16": torch.float16}[kv_cache_dtype]
        assert engine.cache.kv.k_cache.dtype == stored
        ids, logprobs = greedy_with_logprobs(engine, prompts)
    assert ids == expected_ids
    difference = (logprobs - expected_logprobs).abs().max().item()
    assert 0 < difference < LOGPROB_TOLERANCE[kv_cache_dtype]  # rounded, and not by much


def test_auto_is_the_model_dtype(model, tokenizer):
    with make_engine(model, tokenizer) as engine:
        assert engine.cache.kv.k_cache.dtype == next(model.parameters()).dtype == torch.float32


def test_bf16_pool_holds_twice_the_tokens_in_the_same_memory(model, tokenizer, caplog):
    c = model.config
    fp32_page_bytes = 2 * c.n_layers * 16 * c.n_kv_heads * c.head_dim * 4
    pools, pool_bytes = {}, set()
    for kv_cache_dtype in ("fp32", "bf16"):
        caplog.clear()
        memory = 30 * fp32_page_bytes
        with (
            caplog.at_level(logging.INFO, logger="astrai.inference.engine"),
            make_engine(
                model, tokenizer, kv_cache_memory=memory, kv_cache_dtype=kv_cache_dtype
            ) as engine,
        ):
            pools[kv_cache_dtype] = engine.cache.n_pages * engine.cache.page_size
            pool_bytes.add(engine.cache.kv.nbytes)
        (start,) = [r.getMessage() for r in caplog.records if "KV cache" in r.getMessage()]
        dtype_name = {"fp32": "torch.float32", "bf16": "torch.bfloat16"}[kv_cache_dtype]
        assert f" MB {dtype_name} reserved" in start
        assert f": {pools[kv_cache_dtype]} tokens in " in start
    assert pools == {"fp32": 30 * 16, "bf16": 60 * 16}
    assert pool_bytes == {30 * fp32_page_bytes}


@pytest.mark.parametrize("value", ["int8", "float32", "BF16", None])
def test_other_kv_cache_dtypes_are_refused(value):
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype=value)
