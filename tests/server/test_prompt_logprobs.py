"""The prompt's logprobs on real servers: OpenAI's echo with logprobs (max_tokens 0 too) in the
legacy completions shape, vLLM's prompt_logprobs, and lm-eval's local-completions model
scoring a local loglikelihood task against `astrai serve`, offline."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from live_server import make_engine, serving
from serve_process import astrai_serve
from tiny_models import real_gguf

PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def hf_model(llama_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(llama_dir).eval()


def hf_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax of each position's logits, [len(ids), vocab]."""
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].log_softmax(-1)


def text_of(tokenizer, token_id: int) -> str:
    """A token's text, as the server shows it; empty past the tokenizer's vocabulary (the
    tiny model's embedding is wider than its tokenizer's)."""
    if token_id >= tokenizer.vocab_size:
        return ""
    return tokenizer.token_bytes(token_id).decode("utf-8", errors="backslashreplace")


def post(server, path: str, body: dict) -> dict:
    headers = {"Authorization": f"Bearer {server.api_key}"}
    response = httpx.post(f"{server.base_url}{path}", json=body, headers=headers, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_echo_with_logprobs_is_openai_s_legacy_shape(server, openai_client, hf_model):
    """max_tokens 0: the prompt alone, its first token's logprob and alternatives null, each
    other token's top alternatives holding itself, offsets into the text."""
    tokenizer = server.engine.tokenizer
    ids = tokenizer.encode(PROMPT)
    reply = openai_client.completions.create(
        model=server.model_name, prompt=PROMPT, max_tokens=0, echo=True, logprobs=2
    )
    [choice] = reply.choices
    assert choice.text == PROMPT and choice.finish_reason == "length"
    lp = choice.logprobs
    tokens = [text_of(tokenizer, t) for t in ids]
    assert lp.tokens == tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset == [sum(map(len, tokens[:i])) for i in range(len(tokens))]
    expected = hf_logprobs(hf_model, ids)
    for i in range(1, len(ids)):
        assert lp.token_logprobs[i] == pytest.approx(expected[i - 1, ids[i]].item(), abs=1e-4)
        top = expected[i - 1].topk(2)
        pairs = zip(top.indices.tolist(), top.values.tolist(), strict=True)
        alternatives = {text_of(tokenizer, t): v for t, v in pairs}
        alternatives.setdefault(tokens[i], expected[i - 1, ids[i]])
        assert lp.top_logprobs[i] == pytest.approx(
            {k: float(v) for k, v in alternatives.items()}, abs=1e-4
        )
    assert reply.usage.prompt_tokens == len(ids) and reply.usage.completion_tokens == 0


def test_echo_with_generated_tokens_goes_on_where_the_prompt_ends(server, openai_client):
    kwargs = dict(model=server.model_name, prompt=PROMPT, echo=True, logprobs=1, temperature=0)
    prompt_only = openai_client.completions.create(**kwargs, max_tokens=0).choices[0]
    plain = openai_client.completions.create(
        model=server.model_name, prompt=PROMPT, logprobs=1, temperature=0, max_tokens=5
    ).choices[0]
    [echoed] = openai_client.completions.create(**kwargs, max_tokens=5).choices
    n = len(prompt_only.logprobs.tokens)
    assert echoed.text == PROMPT + plain.text
    assert echoed.logprobs.tokens == prompt_only.logprobs.tokens + plain.logprobs.tokens
    assert echoed.logprobs.token_logprobs[:n] == prompt_only.logprobs.token_logprobs
    assert echoed.logprobs.token_logprobs[n:] == pytest.approx(plain.logprobs.token_logprobs)
    end = sum(map(len, prompt_only.logprobs.tokens))
    assert echoed.logprobs.text_offset[n:] == [end + o for o in plain.logprobs.text_offset]
    chunks = list(openai_client.completions.create(**kwargs, max_tokens=5, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == echoed.text
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert sum((s.token_logprobs for s in streamed), []) == echoed.logprobs.token_logprobs
    assert sum((s.text_offset for s in streamed), []) == echoed.logprobs.text_offset
    only = list(openai_client.completions.create(**kwargs, max_tokens=0, stream=True))
    assert "".join(c.choices[0].text for c in only if c.choices) == PROMPT


def loglikelihood_request(server, context: str, continuation: str) -> tuple[list[int], int, dict]:
    """What lm-eval's local-completions sends for one loglikelihood request: the ids of
    context + continuation, echo, logprobs 1, max_tokens 1; (ids, context length, reply)."""
    tokenizer = server.engine.tokenizer
    context_ids = tokenizer.encode(context, False)
    ids = tokenizer.encode(context + continuation, False)
    body = {"prompt": [ids], "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}
    return ids, len(context_ids), post(server, "/v1/completions", body)


@pytest.mark.parametrize("budget", [None, 5], ids=["one-pass", "chunked-prefill"])
def test_loglikelihood_requests_equal_transformers(llama_dir, hf_model, budget):
    """An lm-eval loglikelihood: the sum of the continuation's logprobs, from a fresh prompt,
    from one whose prefix the prefix cache holds, and chunk by chunk."""
    settings = {} if budget is None else {"max_num_batched_tokens": budget}
    with serving(make_engine(llama_dir, **settings)) as server:
        short, continuation = "Hello world! How are you today? I am", " fine, thank you."
        post(server, "/v1/completions", {"prompt": short * 4, "max_tokens": 1})  # cached
        for context in (short, short * 4):
            ids, n, reply = loglikelihood_request(server, context, continuation)
            logprobs = reply["choices"][0]["logprobs"]["token_logprobs"]
            assert len(logprobs) == len(ids) + 1
            expected = hf_logprobs(hf_model, ids)
            total = sum(expected[i - 1, ids[i]].item() for i in range(n, len(ids)))
            assert sum(logprobs[n:-1]) == pytest.approx(total, abs=1e-4)


def test_vllm_prompt_logprobs_on_completions_and_chat(server, hf_model):
    tokenizer = server.engine.tokenizer
    ids = tokenizer.encode(PROMPT)
    reply = post(
        server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 3}
    )
    entries = reply["choices"][0]["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    expected = hf_logprobs(hf_model, ids)
    for i, entry in enumerate(entries[1:], 1):
        row = expected[i - 1]
        top = row.topk(3).indices.tolist()
        assert set(entry) == {str(t) for t in [ids[i], *top]}
        own = entry[str(ids[i])]
        assert own["logprob"] == pytest.approx(row[ids[i]].item(), abs=1e-4)
        assert own["rank"] == int((row > row[ids[i]]).sum()) + 1
        assert own["decoded_token"] == tokenizer.token_bytes(ids[i]).decode()
        assert [entry[str(t)]["rank"] for t in top if t != ids[i]] == [
            r for r, t in enumerate(top, 1) if t != ids[i]
        ]
    assert (
        "prompt_logprobs"
        not in post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1})["choices"][0]
    )

    messages = [{"role": "user", "content": PROMPT}]
    chat = post(
        server,
        "/v1/chat/completions",
        {"messages": messages, "max_tokens": 1, "prompt_logprobs": 0},
    )
    chat_ids = tokenizer.encode(
        tokenizer.apply_chat_template(messages, True, tokenize=False), False
    )
    expected = hf_logprobs(hf_model, chat_ids)
    got = [next(iter(e.values()))["logprob"] for e in chat["prompt_logprobs"][1:]]
    assert chat["prompt_logprobs"][0] is None and all(
        len(e) == 1 for e in chat["prompt_logprobs"][1:]
    )
    assert got == pytest.approx(
        [expected[i - 1, chat_ids[i]].item() for i in range(1, len(chat_ids))], abs=1e-4
    )


def test_best_of_choices_share_their_prompt_s_logprobs(server):
    body = {"prompt": [PROMPT, "Hello"], "max_tokens": 2, "n": 2, "best_of": 3, "seed": 1}
    reply = post(server, "/v1/completions", {**body, "echo": True, "logprobs": 0})
    choices = reply["choices"]
    assert len(choices) == 4
    for i, choice in enumerate(choices):
        first = choices[i // 2 * 2]["logprobs"]
        n = len(server.engine.tokenizer.encode([PROMPT, "Hello"][i // 2]))
        assert choice["logprobs"]["token_logprobs"][:n] == first["token_logprobs"][:n]
        assert choice["logprobs"]["token_logprobs"][0] is None


# lm-eval

TASK = """\
task: astrai_tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""

DOCS = [
    {
        "question": "The quick brown fox jumps over the",
        "choices": ["lazy dog", "moon"],
        "answer": 0,
    },
    {"question": "Hello world! How are", "choices": ["you today?", "pages"], "answer": 0},
    {"question": "def add(a, b): return a +", "choices": ["b", "cache"], "answer": 0},
]


def run_lm_eval(tmp_path, base_url: str, model: str, tokenizer_dir) -> dict:
    """lm-eval's local-completions model on a task file and a JSON-lines data set written
    here, offline: its results with the samples it logged."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "astrai_tiny_choice.yaml").write_text(TASK.format(data=data))
    model_args = {
        "model": model,
        "base_url": f"{base_url}/v1/completions",
        "tokenizer_backend": "huggingface",
        "tokenizer": str(tokenizer_dir),
        "num_concurrent": 1,
        "max_retries": 1,
    }
    return lm_eval.simple_evaluate(
        model="local-completions",
        model_args=model_args,
        tasks=["astrai_tiny_choice"],
        task_manager=TaskManager(include_path=str(tasks)),
        log_samples=True,
    )


@pytest.fixture
def offline(monkeypatch):
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")


def test_lm_eval_scores_a_local_task_as_transformers_does(tmp_path, llama_dir, hf_model, offline):
    """Every choice's loglikelihood that lm-eval reads from astrai serve is transformers'."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    with astrai_serve(llama_dir, "--max-seq-len", "256") as (process, base_url):
        results = run_lm_eval(tmp_path, base_url, llama_dir.name, llama_dir)
        process.terminate()
        process.wait(timeout=60)
    samples = results["samples"]["astrai_tiny_choice"]
    assert len(samples) == len(DOCS)
    for sample in samples:
        for (context, continuation), [(loglikelihood, _)] in zip(
            sample["arguments"], sample["resps"], strict=True
        ):
            context_ids = tokenizer(context, add_special_tokens=False).input_ids
            ids = tokenizer(context + continuation, add_special_tokens=False).input_ids
            expected = hf_logprobs(hf_model, ids)
            total = sum(expected[i - 1, ids[i]].item() for i in range(len(context_ids), len(ids)))
            assert float(loglikelihood) == pytest.approx(total, abs=1e-4)
    assert "acc,none" in results["results"]["astrai_tiny_choice"]


@pytest.mark.slow
def test_lm_eval_and_embeddings_on_the_real_model(tmp_path, offline):
    """astrai serve on the SmolLM2 GGUF with default flags: lm-eval's loglikelihoods pick the
    sensible continuations, and the openai client's embeddings put like sentences closer."""
    import openai
    import torch.nn.functional as F
    from transformers import AutoTokenizer

    gguf = real_gguf()
    tokenizer_dir = tmp_path / "tokenizer"  # lm-eval's tokenizer: transformers', from the GGUF
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tokenizer_dir)
    with astrai_serve(gguf) as (process, base_url):
        results = run_lm_eval(tmp_path, base_url, gguf.name, tokenizer_dir)
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
        reply = client.embeddings.create(
            model=gguf.name,
            input=["A cat sits on the mat.", "A kitten is sitting on a rug.", "Stock prices fell."],
        )
        process.terminate()
        process.wait(timeout=60)
    assert results["results"]["astrai_tiny_choice"]["acc,none"] == 1.0
    cat, kitten, stocks = (torch.tensor(d.embedding) for d in reply.data)
    assert F.cosine_similarity(cat, kitten, dim=0) > F.cosine_similarity(cat, stocks, dim=0)
