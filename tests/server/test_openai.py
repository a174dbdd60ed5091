"""The OpenAI-compatible API through the official `openai` client against a real server."""

from __future__ import annotations

import asyncio

import openai
import pytest

from astrai.inference import GenerationParams, GenerationRequest

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world!"}]
FIXED_LENGTH = {"ignore_eos": True}  # vLLM's extension: outputs run to max_tokens


def engine_chat(engine, messages, **params) -> str:
    request = GenerationRequest(tuple(messages), GenerationParams(**params))
    return engine.generate(request)


def test_models_lists_the_served_model(openai_client, server):
    models = openai_client.models.list()
    assert [m.id for m in models.data] == [server.model_name]
    assert openai_client.models.retrieve(server.model_name).id == server.model_name


def test_chat_greedy_equals_the_engine(openai_client, server):
    reply = openai_client.chat.completions.create(
        model=server.model_name, messages=CHAT, max_tokens=12, temperature=0
    )
    expected = engine_chat(server.engine, CHAT, max_tokens=12, temperature=0)
    choice = reply.choices[0]
    assert reply.object == "chat.completion"
    assert choice.message.role == "assistant"
    assert choice.message.content == expected
    assert choice.finish_reason in ("stop", "length")
    prompt = server.engine.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)
    assert reply.usage.prompt_tokens == len(prompt)
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_completion_greedy_equals_the_engine(openai_client, server):
    reply = openai_client.completions.create(
        model=server.model_name, prompt="The quick brown fox", max_tokens=12, temperature=0
    )
    expected = server.engine.generate("The quick brown fox", max_tokens=12, temperature=0)
    assert reply.object == "text_completion"
    assert reply.choices[0].text == expected
    assert reply.usage.prompt_tokens == len(server.engine.tokenizer.encode("The quick brown fox"))


def test_chat_stream_adds_up_to_the_non_streamed_reply(openai_client, server):
    kwargs = dict(model=server.model_name, messages=CHAT, max_tokens=16, temperature=0)
    whole = openai_client.chat.completions.create(**kwargs).choices[0]
    chunks = list(openai_client.chat.completions.create(**kwargs, stream=True))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.message.content
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_completion_stream_adds_up_to_the_non_streamed_text(openai_client, server):
    kwargs = dict(model=server.model_name, prompt="Paged attention", max_tokens=16, temperature=0)
    whole = openai_client.completions.create(**kwargs).choices[0]
    chunks = list(openai_client.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_the_finish_reason_rides_on_the_last_text(openai_client, server, endpoint):
    # vLLM's streaming tests: the chunk that finishes carries text, and only one finishes. A
    # random model's last token may hold half a character, whose text waits: letters have none.
    kwargs = dict(model=server.model_name, max_tokens=10, temperature=0, stream=True)
    kwargs["extra_body"] = {"guided_regex": "[a-z ]+"}
    if endpoint == "chat":
        chunks = list(openai_client.chat.completions.create(messages=CHAT, **kwargs))
        last_text = chunks[-1].choices[0].delta.content
    else:
        chunks = list(openai_client.completions.create(prompt="Paged attention", **kwargs))
        last_text = chunks[-1].choices[0].text
    finishing = [c for c in chunks if c.choices[0].finish_reason is not None]
    assert finishing == [chunks[-1]] and chunks[-1].choices[0].finish_reason == "length"
    assert last_text


def test_n_samples_and_a_list_of_prompts(openai_client, server):
    chat = openai_client.chat.completions.create(
        model=server.model_name, messages=CHAT, max_tokens=6, n=3, seed=1, extra_body=FIXED_LENGTH
    )
    assert [c.index for c in chat.choices] == [0, 1, 2]
    assert chat.usage.completion_tokens == 18
    completions = openai_client.completions.create(
        model=server.model_name,
        prompt=["Hello", "The quick"],
        max_tokens=5,
        n=2,
        temperature=0,
        extra_body=FIXED_LENGTH,
    )
    assert [c.index for c in completions.choices] == [0, 1, 2, 3]
    expected = server.engine.generate(["Hello", "The quick"], max_tokens=5, temperature=0)
    expected = [e for e in expected for _ in range(2)]  # choice i is sample i % n of prompt i // n
    assert [c.text for c in completions.choices] == expected
    encode = server.engine.tokenizer.encode
    assert completions.usage.prompt_tokens == len(encode("Hello")) + len(encode("The quick"))
    assert completions.usage.completion_tokens == 20


def test_streamed_n_samples_each_finish(openai_client, server):
    chunks = list(
        openai_client.chat.completions.create(
            model=server.model_name, messages=CHAT, max_tokens=4, n=2, seed=3, stream=True
        )
    )
    finished = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(finished) == [0, 1]


@pytest.mark.parametrize("as_list", [False, True])
def test_stop_strings_end_the_text_before_them(openai_client, server, as_list):
    prompt = "Hello world"
    free = server.engine.generate(prompt, max_tokens=24, temperature=0, ignore_eos=True)
    stop = free[len(free) // 2 :][:3]
    assert stop.strip(), f"the greedy text {free!r} has no usable stop string"
    reply = openai_client.completions.create(
        model=server.model_name,
        prompt=prompt,
        max_tokens=24,
        temperature=0,
        stop=[stop, "\x00never"] if as_list else stop,
        extra_body=FIXED_LENGTH,
    )
    choice = reply.choices[0]
    assert choice.text == free[: free.index(stop)]
    assert choice.finish_reason == "stop"


def test_a_seed_reproduces_a_sample(openai_client, server):
    def sample(seed: int) -> str:
        reply = openai_client.chat.completions.create(
            model=server.model_name,
            messages=CHAT,
            max_tokens=12,
            temperature=1.5,
            top_p=0.95,
            seed=seed,
            extra_body={**FIXED_LENGTH, "top_k": -1, "min_p": 0.01},
        )
        return reply.choices[0].message.content

    first = sample(7)
    assert sample(7) == first
    assert {sample(s) for s in range(8, 12)} != {first}


def test_chat_logprobs_have_openai_shape(openai_client, server):
    reply = openai_client.chat.completions.create(
        model=server.model_name,
        messages=CHAT,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body=FIXED_LENGTH,
    )
    content = reply.choices[0].logprobs.content
    assert len(content) == 6
    tokenizer = server.engine.tokenizer
    for entry, token_id in zip(content, _greedy_ids(server, CHAT, 6), strict=True):
        assert entry.bytes == list(tokenizer.token_bytes(token_id))
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 3
        # Greedy picks the most likely token, so it heads the alternatives.
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)
        assert entry.top_logprobs[0].bytes == entry.bytes
    chunks = openai_client.chat.completions.create(
        model=server.model_name,
        messages=CHAT,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        stream=True,
        extra_body=FIXED_LENGTH,
    )
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in _content(c)]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert all(e.top_logprobs == [] for e in streamed)


def _content(chunk):
    return chunk.choices[0].logprobs.content or []


def _greedy_ids(server, messages, max_tokens: int) -> list[int]:
    request = GenerationRequest(
        tuple(messages), GenerationParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    )
    return server.engine.generate_results(request).token_ids


def test_completion_logprobs_have_openai_shape(openai_client, server):
    reply = openai_client.completions.create(
        model=server.model_name,
        prompt="Hello",
        max_tokens=5,
        temperature=0,
        logprobs=2,
        extra_body=FIXED_LENGTH,
    )
    logprobs = reply.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 5
    assert len(logprobs.top_logprobs) == len(logprobs.text_offset) == 5
    assert logprobs.text_offset[0] == 0
    assert logprobs.text_offset == sorted(logprobs.text_offset)
    for token, logprob, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        assert top[token] == pytest.approx(logprob)
        assert 2 <= len(top) <= 3


def test_include_usage_adds_a_last_usage_chunk(openai_client, server):
    kwargs = dict(model=server.model_name, messages=CHAT, max_tokens=5, temperature=0)
    whole = openai_client.chat.completions.create(**kwargs)
    chunks = list(
        openai_client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == []
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    completion_chunks = list(
        openai_client.completions.create(
            model=server.model_name,
            prompt="Hello",
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=FIXED_LENGTH,
        )
    )
    assert completion_chunks[-1].choices == []
    assert completion_chunks[-1].usage.completion_tokens == 3


def test_usage_reports_prefix_cache_hits(openai_client, server):
    long_system = {"role": "system", "content": "Paged attention stores keys and values. " * 6}
    messages = [long_system, {"role": "user", "content": "Hi"}]
    kwargs = dict(model=server.model_name, messages=messages, max_tokens=2)
    openai_client.chat.completions.create(**kwargs)
    again = openai_client.chat.completions.create(**kwargs)
    page_size = server.engine.config.page_size
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached >= page_size
    assert cached % page_size == 0
    assert cached < again.usage.prompt_tokens


def test_max_completion_tokens_limits_the_reply(openai_client, server):
    reply = openai_client.chat.completions.create(
        model=server.model_name,
        messages=CHAT,
        max_completion_tokens=3,
        extra_body=FIXED_LENGTH,
    )
    assert reply.usage.completion_tokens == 3
    assert reply.choices[0].finish_reason == "length"


def test_64_concurrent_streams_complete_with_correct_usage(server):
    prompt_tokens = len(server.engine.tokenizer.apply_chat_template(CHAT))

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[int, int, str | None]:
        stream = await client.chat.completions.create(
            model=server.model_name,
            messages=CHAT,
            max_tokens=4 + i % 5,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=FIXED_LENGTH,
        )
        finish, usage = None, None
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
            usage = chunk.usage or usage
        return usage.prompt_tokens, usage.completion_tokens, finish

    async def run_all():
        client = openai.AsyncOpenAI(
            base_url=f"{server.base_url}/v1", api_key=server.api_key, max_retries=0
        )
        async with client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    results = asyncio.run(run_all())
    assert results == [(prompt_tokens, 4 + i % 5, "length") for i in range(64)]
