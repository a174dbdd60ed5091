"""The CUDA path: Triton paged attention over the ragged batch, decode steps replayed from CUDA
graphs, the device's memory and inputs.

The first tests run the path's own code on the CPU (Triton's interpreter; no graphs there);
those marked cuda need a GPU (benchmarks/gpu_check.sh runs them on one) and skip without.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from tiny_models import greedy_with_logprobs, make_engine, run_ids, write_hf_model

from astrai.inference import GenerationParams
from astrai.inference.attention import DeviceCacheView, ragged_layout
from astrai.inference.executor import CudaSteps, HostToDevice
from astrai.inference.kv_cache import PagedCache
from astrai.inference.step_batch import StepBatch
from astrai.kernels import triton_attention
from astrai.model import AutoModel

pytestmark = pytest.mark.skipif(not triton_attention.available, reason="triton is not installed")
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(0)
    # decodes over several pages, a prompt longer than a prefill chunk
    return [[rng.randrange(4, 400) for _ in range(n)] for n in (3, 40, 90, 130)]


def device_steps(engine, graphs: bool) -> CudaSteps:
    """The engine's executor made to run the CUDA path's steps, whatever its device."""
    executor = engine.scheduler.executor
    executor.cuda_steps = CudaSteps(
        engine.model, engine.cache.kv, executor.max_batch_size, engine.max_seq_len, graphs
    )
    return executor.cuda_steps


def test_the_cuda_steps_on_the_cpu_generate_as_the_cpu_path(model, tokenizer, prompts):
    """Prefill chunks, prefix hits and decodes through the Triton kernels (interpreted) give
    the CPU path's greedy tokens, their logprobs within fp32 rounding."""
    with make_engine(model, tokenizer, max_num_batched_tokens=64) as engine:
        expected_ids, expected_logprobs = greedy_with_logprobs(engine, prompts)
    with make_engine(model, tokenizer, max_num_batched_tokens=64) as engine:
        device_steps(engine, graphs=False)
        for _ in range(2):  # the second time from the prefix cache
            ids, logprobs = greedy_with_logprobs(engine, prompts)
            assert ids == expected_ids
            torch.testing.assert_close(logprobs, expected_logprobs, atol=1e-4, rtol=1e-4)
        assert engine.cache.hit_tokens > 0


def batch_of(cache: PagedCache, seqs, tokens, spans, logit_rows) -> StepBatch:
    return StepBatch.build(seqs, tokens, cache.tasks.pages, cache.page_size, spans, logit_rows)


def prefilled(model, contexts: list[int], device: str) -> tuple[PagedCache, CudaSteps]:
    """A cache holding tasks 0.. with the given context lengths (random tokens, prefilled
    through the CUDA path's eager step) and room for one more token each."""
    config = model.config
    cache = PagedCache(
        config.n_layers, config.n_kv_heads, config.head_dim, n_pages=64, page_size=4,
        dtype=next(model.parameters()).dtype, device=device,
    )  # fmt: skip
    steps = CudaSteps(model, cache.kv, max_rows=8, max_seq_len=96, graphs=False)
    rng = np.random.default_rng(0)
    seqs, tokens = [], []
    for task_id, n in enumerate(contexts):
        assert cache.allocate(task_id, n + 1)
        seqs.append((task_id, 0, n))
        tokens += rng.integers(4, config.vocab_size, n).tolist()
    steps.forward(batch_of(cache, seqs, tokens, contexts, np.cumsum(contexts) - 1))
    return cache, steps


def test_a_padded_decode_step_computes_what_the_unpadded_one_does(model):
    """The step a CUDA graph records: rows padded to its bucket, page tables to their widest.
    Its real rows' logits are the eager step's, and its padding stores nothing."""
    cache, steps = prefilled(model, [5, 17, 9], "cpu")
    decodes, tokens = [(0, 5, 1), (1, 17, 1), (2, 9, 1)], [11, 12, 13]
    batch = batch_of(cache, decodes, tokens, [5, 17, 9], np.arange(3))
    eager, _ = steps.forward(batch)
    kv = cache.kv
    stored = kv.k_cache.clone(), kv.v_cache.clone()
    layout = ragged_layout(batch, block_q=1, pad_seqs=5, table_width=24)
    assert layout["slot_mapping"].tolist()[3:] == [-1] * 5
    view = DeviceCacheView(kv, HostToDevice(kv.k_cache.device)(layout), block_q=1)
    padded, _ = steps._run(view, None)
    assert padded.shape[0] == 8
    torch.testing.assert_close(padded[:3], eager, atol=0, rtol=0)
    assert torch.equal(kv.k_cache, stored[0]) and torch.equal(kv.v_cache, stored[1])


# -- on a GPU ---------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "mixtral"])
def family(request, tmp_path_factory):
    """(name, checkpoint): a family's tiny model; Mixtral's routing cannot be captured."""
    return request.param, write_hf_model(tmp_path_factory.mktemp(request.param), request.param)


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_cuda_fp32_generates_as_the_cpu_does(family, tokenizer, prompts, graphs):
    """fp32 on the GPU (attention in IEEE fp32, no TF32) gives the CPU's greedy tokens; a
    model whose decode step cannot be captured runs it eagerly."""
    name, family_dir = family
    cpu_model = AutoModel.from_pretrained(family_dir)
    with make_engine(cpu_model, tokenizer, max_num_batched_tokens=64) as engine:
        expected_ids, expected_logprobs = greedy_with_logprobs(engine, prompts)
    model = AutoModel.from_pretrained(family_dir, device="cuda")
    with make_engine(model, tokenizer, max_num_batched_tokens=64, cuda_graphs=graphs) as engine:
        ids, logprobs = greedy_with_logprobs(engine, prompts)
        captured = engine.scheduler.executor.cuda_steps.graphs
    assert ids == expected_ids
    torch.testing.assert_close(logprobs, expected_logprobs, atol=1e-3, rtol=1e-3)
    assert bool(captured) == (graphs and name != "mixtral")


@pytest.mark.cuda
@requires_cuda
def test_cuda_graph_replay_equals_eager_in_bf16(llama_dir, tokenizer, prompts):
    """The replayed decode step runs the eager step's kernels: the same bf16 tokens and
    logprobs, bit for bit; and bf16 stays near the CPU's fp32 answer."""
    model = AutoModel.from_pretrained(llama_dir, dtype=torch.bfloat16, device="cuda")
    results = {}
    for graphs in (False, True):
        with make_engine(model, tokenizer, cuda_graphs=graphs) as engine:
            results[graphs] = greedy_with_logprobs(engine, prompts)
    assert results[True][0] == results[False][0]
    assert torch.equal(results[True][1], results[False][1])
    with make_engine(AutoModel.from_pretrained(llama_dir), tokenizer) as engine:
        fp32_ids, _ = greedy_with_logprobs(engine, prompts)
    first_tokens = [ids[0] for ids in results[True][0]]
    assert first_tokens == [ids[0] for ids in fp32_ids]


@pytest.mark.cuda
@requires_cuda
def test_a_graph_replayed_step_does_not_wait_for_the_gpu(llama_dir):
    """Neither an eager nor a replayed step synchronizes with the device: the host only waits
    where it reads the sampled tokens."""
    model = AutoModel.from_pretrained(llama_dir, dtype=torch.bfloat16, device="cuda")
    cache, _ = prefilled(model, [5, 17, 9], "cuda")
    steps = CudaSteps(model, cache.kv, max_rows=8, max_seq_len=96, graphs=True)
    assert sorted(steps.graphs) == [1, 2, 4, 8]
    decodes, tokens = [(0, 5, 1), (1, 17, 1), (2, 9, 1)], [11, 12, 13]
    batch = batch_of(cache, decodes, tokens, [5, 17, 9], np.arange(3))
    steps.forward(batch)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        replayed = steps.forward(batch)[0].clone()
        steps.graphs.clear()
        eager, _ = steps.forward(batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(replayed, eager, atol=0, rtol=0)


@pytest.mark.cuda
@requires_cuda
def test_cuda_speculation_and_seeded_sampling_match_their_cpu_meaning(llama_dir, tokenizer):
    """n-gram speculation on the GPU leaves greedy output unchanged, and a seeded sampled
    request repeats itself."""
    model = AutoModel.from_pretrained(llama_dir, device="cuda")
    prompt = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]]
    greedy = GenerationParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    seeded = GenerationParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=24, ignore_eos=True)
    with make_engine(model, tokenizer) as engine:
        plain = run_ids(engine, prompt, [greedy])[0][0].token_ids
        sampled = [run_ids(engine, prompt, [seeded])[0][0].token_ids for _ in range(2)]
    with make_engine(model, tokenizer, speculative="ngram") as engine:
        assert run_ids(engine, prompt, [greedy])[0][0].token_ids == plain
    assert sampled[0] == sampled[1]


@pytest.mark.cuda
@requires_cuda
def test_weights_and_kv_pool_live_on_the_gpu(llama_dir, tokenizer):
    """Every weight is loaded onto the GPU, and a fractional KV budget is a fraction of the
    GPU's free memory."""
    model = AutoModel.from_pretrained(llama_dir, dtype=torch.bfloat16, device="cuda")
    assert all(p.device.type == "cuda" for p in model.parameters())
    free = torch.cuda.mem_get_info()[0]
    # a batch of 16384 full-length sequences could use far more than 1 % of the GPU
    with make_engine(model, tokenizer, kv_cache_memory=0.01, max_batch_size=16384) as engine:
        pool_bytes = engine.cache.kv.nbytes
    assert 0.009 * free <= pool_bytes <= 0.0101 * free


def test_the_cuda_steps_on_the_cpu_turn_qwen2_vl_images_by_mrope(qwen2_vl_dir):
    """An image prompt's chunks through the Triton kernels (interpreted) rotate by its M-RoPE
    positions, and its decodes by them shifted by rope_deltas: the CPU path's tokens and
    logprobs (which equal transformers', tests/inference/test_images_qwen2_vl.py)."""
    from tiny_models import noise_image

    from astrai.tokenize import AutoTokenizer

    model, tokenizer = (
        AutoModel.from_pretrained(qwen2_vl_dir),
        AutoTokenizer.from_pretrained(qwen2_vl_dir),
    )
    text = "Hello<|vision_start|><|image_pad|><|vision_end|> What is this?"
    outputs = []
    for on_device_steps in (False, True):
        with make_engine(model, tokenizer, max_num_batched_tokens=8) as engine:
            if on_device_steps:
                device_steps(engine, graphs=False)
            prompt = engine.image_prompt(tokenizer.encode(text), [noise_image(1)])
            outputs.append(greedy_with_logprobs(engine, [prompt, [5, 6, 7]], max_tokens=6))
    (expected_ids, expected_logprobs), (ids, logprobs) = outputs
    assert ids == expected_ids
    torch.testing.assert_close(logprobs, expected_logprobs, atol=1e-4, rtol=1e-4)
