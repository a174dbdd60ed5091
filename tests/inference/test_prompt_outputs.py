"""What a prompt's prefill hands back besides the next token: prompt logprobs and embeddings,
against transformers on tiny fp32 checkpoints, chunked or not, with and without prefix-cache
hits."""

from __future__ import annotations

import queue
import random

import pytest
import torch
import torch.nn.functional as F
from tiny_models import make_engine, write_hf_model

from astrai.inference import STOP, GenerationParams
from astrai.inference import scheduler as scheduler_module
from astrai.inference.engine import EMBEDDING_PARAMS
from astrai.inference.task import PromptTooLongError, RequestError
from astrai.model import AutoModel
from astrai.tokenize import AutoTokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "The quick brown fox jumps",
    "Hello world! How are you today? I am fine, thank you very much. " * 3,
    "Paged attention stores keys and values in fixed-size pages of the KV cache.",
]


@pytest.fixture(scope="module")
def hf_model(llama_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(llama_dir).eval()


def hf_prompt_logprobs(hf_model, ids: list[int]) -> list[float]:
    """transformers' log p(ids[i] | ids[:i]) for i >= 1."""
    with torch.no_grad():
        logprobs = hf_model(torch.tensor([ids])).logits[0].log_softmax(-1)
    return [logprobs[i - 1, ids[i]].item() for i in range(1, len(ids))]


def hf_embedding(hf_model, ids: list[int], pooling: str) -> torch.Tensor:
    """transformers' last_hidden_state (after the final norm) pooled and L2-normalized."""
    with torch.no_grad():
        hidden = hf_model.model(torch.tensor([ids])).last_hidden_state[0]
    return F.normalize(hidden[-1] if pooling == "last" else hidden.mean(0), dim=-1)


def run(engine, prompts, params, pooling=None):
    """Submit the prompts at once; return one TaskResult per prompt (n = 1)."""
    events = queue.SimpleQueue()
    groups = engine.submit_all(
        prompts, params, lambda task, event: events.put(event), pooling=pooling
    )
    remaining = len(groups)
    while remaining:
        remaining -= events.get(timeout=120) is STOP
    return [group[0].result() for group in groups]


def loglikelihood(results, continuation_lengths) -> list[float]:
    """lm-eval's loglikelihood: each request's summed logprob of its continuation tokens."""
    return [
        sum(entry.logprob for entry in result.prompt_logprobs[-n:])
        for result, n in zip(results, continuation_lengths, strict=True)
    ]


@pytest.mark.parametrize("budget", [2048, 7], ids=["one-pass", "chunked"])
def test_loglikelihood_equals_transformers(model, tokenizer, hf_model, budget):
    """An lm-eval loglikelihood request (context + continuation, summed over the
    continuation) from the prefill's prompt logprobs, chunked prefill or not."""
    pairs = [
        ("The quick brown fox", " jumps over the lazy dog."),
        ("Hello world! How are", " you today?"),
        ("def add(a, b):\n", "    return a + b"),
    ]
    prompts, lengths = [], []
    for context, continuation in pairs:
        context_ids = tokenizer.encode(context)
        prompts.append(context_ids + tokenizer.encode(continuation, False))
        lengths.append(len(prompts[-1]) - len(context_ids))
    params = GenerationParams(max_tokens=0, prompt_logprobs=0)
    with make_engine(model, tokenizer, max_num_batched_tokens=budget) as engine:
        results = run(engine, prompts, params)
    expected = [
        sum(hf_prompt_logprobs(hf_model, ids)[-n:]) for ids, n in zip(prompts, lengths, strict=True)
    ]
    assert loglikelihood(results, lengths) == pytest.approx(expected, abs=1e-4)
    for result, ids in zip(results, prompts, strict=True):
        assert result.prompt_logprobs[0] is None
        assert [e.token_id for e in result.prompt_logprobs[1:]] == ids[1:]
        assert result.finish_reason == "length" and result.token_ids == []
        each = [e.logprob for e in result.prompt_logprobs[1:]]
        assert each == pytest.approx(hf_prompt_logprobs(hf_model, ids), abs=1e-4)


def test_prompt_logprobs_carry_rank_and_top_k(model, tokenizer, hf_model):
    ids = tokenizer.encode(TEXTS[2])
    with make_engine(model, tokenizer) as engine:
        [result] = run(engine, [ids], GenerationParams(max_tokens=3, prompt_logprobs=3))
    assert len(result.token_ids) == 3  # generation goes on after the prompt
    with torch.no_grad():
        logprobs = hf_model(torch.tensor([ids])).logits[0].log_softmax(-1)
    for i, entry in enumerate(result.prompt_logprobs[1:], 1):
        row = logprobs[i - 1]
        top = row.topk(3)
        assert [t for t, _ in entry.top] == top.indices.tolist()
        assert [lp for _, lp in entry.top] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert entry.rank == int((row > row[ids[i]]).sum()) + 1


def test_a_prefix_cache_hit_does_not_change_prompt_logprobs(model, tokenizer, hf_model):
    """Cached pages hold no logits: a request with prompt_logprobs computes its whole prompt
    (and leaves its pages cached for others)."""
    prefix = tokenizer.encode(TEXTS[1])
    ids = prefix + tokenizer.encode(" and the quick brown fox", False)
    params = GenerationParams(max_tokens=0, prompt_logprobs=1)
    with make_engine(model, tokenizer) as engine:
        [warm] = run(engine, [prefix], GenerationParams(max_tokens=1))
        [scored] = run(engine, [ids], params)
        [plain] = run(engine, [ids], GenerationParams(max_tokens=1))
    assert warm.cached_tokens == 0
    assert scored.cached_tokens == 0
    assert plain.cached_tokens >= len(prefix) // 16 * 16 > 0
    each = [e.logprob for e in scored.prompt_logprobs[1:]]
    assert each == pytest.approx(hf_prompt_logprobs(hf_model, ids), abs=1e-4)


def test_prompt_logprobs_survive_preemption(model, tokenizer, hf_model, monkeypatch):
    """Decoding tasks that outgrow the pool preempt the newest, a prompt part way through its
    logprobs; it recomputes them from the start and reports each once."""
    victims = []
    preempt = scheduler_module._preempt_newest

    def recording(plan, cache):
        victims.append((plan.running[-1], plan.running[-1].num_computed))
        preempt(plan, cache)

    monkeypatch.setattr(scheduler_module, "_preempt_newest", recording)
    rng = random.Random(0)
    decoding = [[rng.randrange(4, 512) for _ in range(20)] for _ in range(2)]
    scored = [[rng.randrange(4, 512) for _ in range(90)] for _ in range(2)]
    params = [GenerationParams(max_tokens=200, ignore_eos=True)] * 2
    params += [GenerationParams(max_tokens=0, prompt_logprobs=0)] * 2
    # 16 pages of 16 tokens; 4 tokens a step, so a 90-token prompt takes many steps
    memory = (
        16 * 16 * model.config.n_layers * 2 * model.config.n_kv_heads * model.config.head_dim * 4
    )
    with make_engine(
        model, tokenizer, kv_cache_memory=memory, max_num_batched_tokens=4, page_size=16
    ) as engine:
        assert engine.cache.n_pages == 16
        events = queue.SimpleQueue()
        tasks = [
            engine.submit(ids, p, lambda task, event: events.put(event))[0]
            for ids, p in zip(decoding + scored, params, strict=True)
        ]
        remaining = len(tasks)
        while remaining:
            remaining -= events.get(timeout=120) is STOP
    assert any(t in tasks[2:] and 0 < computed < 90 for t, computed in victims)
    for task, ids in zip(tasks[2:], scored, strict=True):
        result = task.result()
        assert len(result.prompt_logprobs) == len(ids)
        each = [e.logprob for e in result.prompt_logprobs[1:]]
        assert each == pytest.approx(hf_prompt_logprobs(hf_model, ids), abs=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2"])
@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_equal_transformers_pooled_hidden_states(tmp_path, arch, pooling):
    directory = write_hf_model(tmp_path, arch, random_norms=True)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    with make_engine(AutoModel.from_pretrained(directory), tokenizer) as engine:
        vectors = engine.embed(TEXTS, pooling=pooling)
        one = engine.embed(TEXTS[0], pooling=pooling)
    assert vectors.shape == (len(TEXTS), hf_model.config.hidden_size)
    for text, vector in zip(TEXTS, vectors, strict=True):
        expected = hf_embedding(hf_model, tokenizer.encode(text), pooling)
        torch.testing.assert_close(vector, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(one, vectors[0])


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_are_batched_chunked_and_cached_alike(model, tokenizer, hf_model, pooling):
    """Many inputs at once, prompts split over steps, and (for last) cached prefix pages give
    the vectors one input alone gives; mean pooling reads no cached page, which holds no
    hidden states."""
    rng = random.Random(1)
    prompts = [[rng.randrange(4, 512) for _ in range(rng.randint(1, 120))] for _ in range(40)]
    prompts += [prompts[5] + [7, 8, 9]]  # shares prompts[5]'s pages once those are cached
    with make_engine(model, tokenizer, max_num_batched_tokens=64, max_batch_size=8) as engine:
        results = run(engine, prompts, EMBEDDING_PARAMS, pooling=pooling)
        [again] = run(engine, [prompts[-1]], EMBEDDING_PARAMS, pooling=pooling)
        assert engine.get_stats().generation_tokens == 0
    for result, ids in zip(results, prompts, strict=True):
        vector = F.normalize(result.embedding, dim=-1)
        torch.testing.assert_close(vector, hf_embedding(hf_model, ids, pooling), atol=1e-5, rtol=0)
    assert (again.cached_tokens > 0) == (pooling == "last")
    torch.testing.assert_close(again.embedding, results[-1].embedding, atol=1e-5, rtol=0)


def test_embeddings_of_token_ids_equal_those_of_their_text(model, tokenizer):
    with make_engine(model, tokenizer) as engine:
        by_text = engine.embed(TEXTS[:2])
        by_ids = engine.embed([tokenizer.encode(t) for t in TEXTS[:2]])
        one = engine.embed(tokenizer.encode(TEXTS[0]))
    torch.testing.assert_close(by_text, by_ids)
    torch.testing.assert_close(one, by_ids[0])
    assert torch.linalg.vector_norm(by_text, dim=-1).tolist() == pytest.approx([1.0, 1.0])


def test_embedding_errors_say_what_to_do(model, tokenizer):
    with make_engine(model, tokenizer, max_seq_len=64) as engine:
        with pytest.raises(PromptTooLongError, match="maximum sequence length is 64 tokens"):
            engine.embed([[5] * 65])
        with pytest.raises(RequestError, match="at least one input"):
            engine.embed([])
        with pytest.raises(RequestError, match="the prompt is empty"):
            engine.embed([[5], []])
        with pytest.raises(RequestError, match="pooling must be one of last, mean"):
            engine.embed("Hi", pooling="cls")
        assert engine.get_stats().pages_owned == 0


def test_an_embedding_engine_refuses_generation(model, tokenizer):
    with make_engine(model, tokenizer, task="embed", pooling="mean") as engine:
        with pytest.raises(RequestError, match="serves embeddings only"):
            engine.generate("Hi", max_tokens=2)
        vector = engine.embed("Hi")
    with make_engine(model, tokenizer) as engine:
        torch.testing.assert_close(vector, engine.embed("Hi", pooling="mean"))
