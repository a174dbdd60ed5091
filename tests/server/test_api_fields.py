"""Every request field is implemented, a no-op or refused, as docs/api.md says, on a real server.

The table in docs/api.md is checked against the request models and astrai.server.fields, and
its refused and no-op rows are sent to the server; the implemented fields that were once ignored
each have a test of their effect.
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import httpx
import openai
import pytest
from live_server import make_engine, serving
from pydantic import BaseModel

import astrai
from astrai.inference import STOP, GenerationParams
from astrai.server import protocol
from astrai.server.fields import RULES, NoOp, Refused

API_DOC = Path(__file__).parents[2] / "docs" / "api.md"
USER = [{"role": "user", "content": "Hello"}]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world!"}]
PROMPT = "The quick brown fox jumps over the lazy dog"
PROBE = {"astrai-test": "a value no field takes as a no-op"}


def request_models() -> list[type[BaseModel]]:
    """Every request model of the server, read from the protocol module."""
    return [
        cls
        for cls in vars(protocol).values()
        if isinstance(cls, type)
        and issubclass(cls, BaseModel)
        and cls.__module__ == protocol.__name__
        and not cls.__name__.startswith("_")
    ]


def doc_tables() -> dict[str, dict[str, tuple[str, str]]]:
    """docs/api.md's tables: model name -> field -> (status, notes)."""
    tables: dict[str, dict[str, tuple[str, str]]] = {}
    current = None
    for line in API_DOC.read_text().splitlines():
        heading = re.fullmatch(r"## .*`(\w+)`", line)
        if heading:
            current = tables.setdefault(heading.group(1), {})
            continue
        row = re.fullmatch(r"\| `(\w+)` \| ([\w-]+) \| (.*) \|", line)
        if row:
            assert current is not None, f"a table row before any model heading: {line}"
            assert row.group(1) not in current, f"{row.group(1)} is listed twice"
            current[row.group(1)] = (row.group(2), row.group(3))
    return tables


def code_status(model: type[BaseModel], name: str) -> str:
    rule = RULES.get(model, {}).get(name)
    if rule is None:
        return "implemented"
    return "no-op" if isinstance(rule, NoOp) else "refused"


def accepted_values(notes: str) -> list:
    """The values a refused row's notes list after "accepted:"."""
    if "accepted: " not in notes:
        return []
    return [json.loads(v) for v in re.findall(r"`([^`]+)`", notes.split("accepted: ", 1)[1])]


def rows(status: str) -> list[tuple[str, str, str]]:
    return [
        (model, name, notes)
        for model, table in doc_tables().items()
        for name, (row_status, notes) in table.items()
        if row_status == status
    ]


def request_with(server, model: str, name: str, value) -> tuple[str, dict, str]:
    """A small valid request of the endpoint that takes model, with the field name set to value:
    its path, its body and the dotted name the server reports."""
    name_of = {"model": server.model_name}
    chat = {**name_of, "messages": USER, "max_tokens": 1}
    if model == "ChatMessage":
        message = {**USER[0], name: value}
        return "/v1/chat/completions", {**chat, "messages": [message]}, f"messages.0.{name}"
    if model == "StreamOptions":
        body = {**chat, "stream": True, "stream_options": {name: value}}
        return "/v1/chat/completions", body, f"stream_options.{name}"
    if model == "AnthropicTool":
        tool = {"name": "f", "input_schema": {"type": "object"}, name: value}
        body = {**chat, "tools": [tool], "tool_choice": {"type": "none"}}
        return "/v1/messages", body, f"tools.0.{name}"
    if model == "AnthropicMessage":
        message = {**USER[0], name: value}
        return "/v1/messages", {**chat, "messages": [message]}, f"messages.0.{name}"
    responses = {**name_of, "input": "Hi", "max_output_tokens": 1}
    items = {
        "ResponsesMessage": {"role": "user", "content": "Hi"},
        "ResponsesFunctionCall": {
            "type": "function_call",
            "call_id": "call_1",
            "name": "f",
            "arguments": "{}",
        },
        "ResponsesFunctionCallOutput": {
            "type": "function_call_output",
            "call_id": "call_1",
            "output": "1",
        },
        "ResponsesReasoning": {"type": "reasoning", "summary": []},
    }
    if model in items:
        # A reasoning item is the thinking of the assistant message after it.
        after = [{"role": "assistant", "content": "Hi"}] if model == "ResponsesReasoning" else []
        body = {**responses, "input": [{**items[model], name: value}, *after]}
        return "/v1/responses", body, f"input.0.{name}"
    if model == "ResponsesFunctionTool":
        tool = {"type": "function", "name": "f", name: value}
        body = {**responses, "tools": [tool], "tool_choice": "none"}
        return "/v1/responses", body, f"tools.0.{name}"
    if model == "ResponsesText":
        return "/v1/responses", {**responses, "text": {name: value}}, f"text.{name}"
    ollama = {**name_of, "stream": False, "options": {"num_predict": 1}}
    if model == "OllamaOptions":
        body = {**ollama, "prompt": "Hi", "options": {"num_predict": 1, name: value}}
        return "/api/generate", body, f"options.{name}"
    ollama_call = {"function": {"name": "f", "arguments": {}}}
    if model in ("OllamaMessage", "OllamaToolCall", "OllamaFunctionCall"):
        message = {"role": "assistant", "content": "Hi", "tool_calls": [ollama_call]}
        where = "messages.0"
        if model == "OllamaMessage":
            message[name] = value
        elif model == "OllamaToolCall":
            message["tool_calls"] = [{**ollama_call, name: value}]
            where = "messages.0.tool_calls.0"
        else:
            message["tool_calls"] = [{"function": {**ollama_call["function"], name: value}}]
            where = "messages.0.tool_calls.0.function"
        return "/api/chat", {**ollama, "messages": [message, *USER]}, f"{where}.{name}"
    path, body = {
        "OllamaChatRequest": ("/api/chat", {**ollama, "messages": USER}),
        "OllamaGenerateRequest": ("/api/generate", {**ollama, "prompt": "Hi"}),
        "OllamaShowRequest": ("/api/show", name_of),
        "ResponsesRequest": ("/v1/responses", responses),
        "ChatCompletionRequest": ("/v1/chat/completions", chat),
        "CompletionRequest": ("/v1/completions", {**name_of, "prompt": "Hi", "max_tokens": 1}),
        "MessagesRequest": ("/v1/messages", chat),
        "CountTokensRequest": ("/v1/messages/count_tokens", {**name_of, "messages": USER}),
        "TokenizeRequest": ("/tokenize", {**name_of, "prompt": "Hi"}),
        "DetokenizeRequest": ("/detokenize", {**name_of, "tokens": [1]}),
        "EmbeddingRequest": ("/v1/embeddings", {**name_of, "input": "Hi"}),
        "OllamaEmbedRequest": ("/api/embed", {**name_of, "input": "Hi"}),
        "OllamaEmbeddingsRequest": ("/api/embeddings", {**name_of, "prompt": "Hi"}),
    }[model]
    return path, {**body, name: value}, name


def post(server, path: str, body: dict, **kwargs) -> httpx.Response:
    headers = {"Authorization": f"Bearer {server.api_key}", **kwargs.pop("headers", {})}
    return httpx.post(f"{server.base_url}{path}", json=body, headers=headers, timeout=60, **kwargs)


def error_message(response: httpx.Response) -> str:
    """The message of an error in any API's shape (Ollama's is the bare string)."""
    error = response.json()["error"]
    return error if isinstance(error, str) else error["message"]


# The table against the code


def test_the_table_lists_every_field_of_every_request_model():
    tables = doc_tables()
    models = {model.__name__: model for model in request_models()}
    assert set(tables) == set(models), "docs/api.md needs a table for each request model"
    for name, model in models.items():
        assert set(tables[name]) == set(model.model_fields), f"the fields of {name}"


def test_each_status_in_the_table_is_the_code_s():
    tables = doc_tables()
    for model in request_models():
        for name, (status, notes) in tables[model.__name__].items():
            assert status == code_status(model, name), f"{model.__name__}.{name}"
            rule = RULES.get(model, {}).get(name)
            noop = list(rule.noop) if isinstance(rule, Refused) else []
            assert accepted_values(notes) == noop, f"the accepted values of {model.__name__}.{name}"
            if rule is not None:  # the reason the server gives, up to what to do instead
                reason = rule.why.removeprefix("is ").split(";")[0]
                assert reason in notes, f"the reason of {model.__name__}.{name}"


def test_every_rule_names_a_field_of_its_model():
    for model, rules in RULES.items():
        assert set(rules) <= set(model.model_fields), model.__name__


# The table against the server


@pytest.mark.parametrize(
    ("model", "name"), [pytest.param(m, n, id=f"{m}.{n}") for m, n, _ in rows("refused")]
)
def test_a_refused_field_gets_400_naming_it(server, model, name):
    path, body, reported = request_with(server, model, name, PROBE)
    response = post(server, path, body)
    assert response.status_code == 400
    message = error_message(response)
    assert message.startswith(reported), message
    if not path.startswith(("/v1/messages", "/api/")):  # their errors name no param
        assert response.json()["error"]["param"] == reported


@pytest.mark.parametrize(
    ("model", "name", "value"),
    [
        pytest.param(m, n, v, id=f"{m}.{n}={json.dumps(v)}")
        for m, n, notes in rows("refused")
        for v in accepted_values(notes)
    ]
    + [pytest.param(m, n, PROBE, id=f"{m}.{n}") for m, n, _ in rows("no-op")],
)
def test_a_no_op_value_is_accepted(server, model, name, value):
    path, body, _ = request_with(server, model, name, value)
    response = post(server, path, body)
    assert response.status_code == 200, response.text


def test_an_unknown_field_gets_400_naming_it(openai_client, server):
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.chat.completions.create(
            model=server.model_name, messages=USER, max_tokens=1, extra_body={"frobnicate": 1}
        )
    assert "frobnicate" in caught.value.message
    for path, body in [
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 1, "frobnicate": 1}),
        ("/v1/messages", {"messages": USER, "max_tokens": 1, "frobnicate": 1}),
        ("/tokenize", {"prompt": "Hi", "frobnicate": 1}),
        ("/v1/chat/completions", {"messages": [{**USER[0], "frobnicate": 1}]}),
        (
            "/v1/chat/completions",
            {
                "messages": [
                    {"role": "user", "content": [{"type": "text", "text": "Hi", "frobnicate": 1}]}
                ]
            },
        ),
    ]:
        response = post(server, path, body)
        assert response.status_code == 400, path
        assert "frobnicate" in response.text, path


@pytest.mark.parametrize(
    ("request_fields", "named"),
    [
        ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
        ({"extra_body": {"guided_decoding_backend": "xgrammar"}}, "guided_decoding_backend"),
        ({"extra_body": {"bad_words": ["fox"]}}, "bad_words"),
        ({"extra_body": {"use_beam_search": True}}, "use_beam_search"),
    ],
)
def test_the_openai_client_sees_refusals(openai_client, server, request_fields, named):
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.chat.completions.create(
            model=server.model_name, messages=USER, max_tokens=2, **request_fields
        )
    assert caught.value.body["message"].startswith(named)
    assert "not supported" in caught.value.message


def test_the_openai_client_s_no_op_forms_are_served(openai_client, server):
    reply = openai_client.chat.completions.create(
        model=server.model_name,
        messages=USER,
        max_tokens=2,
        response_format={"type": "text"},
        tools=[],
        tool_choice="none",
        user="someone",
        metadata={"run": "1"},
        store=False,
        service_tier="auto",
    )
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_anthropic_cache_control_is_a_no_op_and_other_block_keys_are_refused(
    anthropic_client, server
):
    block = {"type": "text", "text": "Hello", "cache_control": {"type": "ephemeral"}}
    kwargs = dict(model=server.model_name, max_tokens=4, extra_body={"temperature": 0})
    cached = anthropic_client.messages.create(
        messages=[{"role": "user", "content": [block]}], **kwargs
    )
    plain = anthropic_client.messages.create(messages=USER, **kwargs)
    assert cached.content[0].text == plain.content[0].text
    cited = {**block, "citations": [{"type": "char_location"}]}
    response = post(
        server,
        "/v1/messages",
        {"messages": [{"role": "user", "content": [cited]}], "max_tokens": 4},
    )
    assert response.status_code == 400
    assert "citations" in response.json()["error"]["message"]


# Implemented fields and their effect


def greedy_ids(engine, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """The engine's own greedy token ids for a prompt, run to max_tokens."""
    done, ids = threading.Event(), []

    def on_delta(task, delta) -> None:
        if delta is STOP:
            done.set()
        else:
            ids.extend(delta.token_ids)

    params = GenerationParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    engine.submit(prompt_ids, params, on_delta)
    assert done.wait(60)
    return ids


def test_echo_puts_the_prompt_before_each_choice(openai_client, server):
    kwargs = dict(model=server.model_name, prompt=PROMPT, max_tokens=6, temperature=0)
    plain = openai_client.completions.create(**kwargs).choices[0].text
    echoed = openai_client.completions.create(**kwargs, echo=True, n=2)
    assert [c.text for c in echoed.choices] == [PROMPT + plain] * 2
    chunks = openai_client.completions.create(**kwargs, echo=True, stream=True)
    assert "".join(c.choices[0].text for c in chunks) == PROMPT + plain


def test_echo_of_token_ids_is_their_text(openai_client, server):
    ids = server.engine.tokenizer.encode(PROMPT)
    reply = openai_client.completions.create(
        model=server.model_name, prompt=ids, max_tokens=1, echo=True
    )
    assert reply.choices[0].text.startswith(server.engine.tokenizer.decode(ids))


def test_stop_token_ids_end_the_output(openai_client, server):
    prompt_ids = server.engine.tokenizer.encode(PROMPT)
    ids = greedy_ids(server.engine, prompt_ids, 10)
    # The first token that did not come before it, so the output stops there and not sooner.
    at = next(i for i in range(1, len(ids)) if ids[i] not in ids[:i])
    reply = openai_client.completions.create(
        model=server.model_name,
        prompt=prompt_ids,
        max_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True, "stop_token_ids": [ids[at]]},
    )
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens == at + 1
    assert reply.choices[0].text == server.engine.tokenizer.decode(ids[:at])


def test_best_of_returns_the_most_likely_samples(openai_client, server):
    kwargs = dict(model=server.model_name, prompt=PROMPT, max_tokens=4)
    kwargs["extra_body"] = {"ignore_eos": True}

    def score(choice) -> float:
        return sum(choice.logprobs.token_logprobs)

    # A seed whose most likely sample is not the first, so keeping the first samples fails.
    for seed in range(20):
        samples = openai_client.completions.create(**kwargs, n=4, seed=seed, logprobs=0).choices
        if max(samples, key=score) is not samples[0]:
            break
    best = openai_client.completions.create(**kwargs, n=2, best_of=4, seed=seed)
    ranked = sorted(samples, key=score, reverse=True)
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]]
    assert [c.index for c in best.choices] == [0, 1]
    assert all(c.logprobs is None for c in best.choices)
    assert best.usage.completion_tokens == 16  # every sample drawn counts
    for refused in [dict(n=3, best_of=2), dict(best_of=2, stream=True)]:
        with pytest.raises(openai.BadRequestError) as caught:
            openai_client.completions.create(**kwargs, **refused)
        assert caught.value.body["message"].startswith("best_of")


def test_min_tokens_hold_back_the_stop(openai_client, server):
    prompt_ids = server.engine.tokenizer.encode(PROMPT)
    ids = greedy_ids(server.engine, prompt_ids, 12)
    at = next(i for i in range(1, len(ids)) if ids[i] not in ids[:i])
    kwargs = dict(model=server.model_name, prompt=prompt_ids, max_tokens=12, temperature=0)
    stop = {"ignore_eos": True, "stop_token_ids": [ids[at]]}
    plain = openai_client.completions.create(**kwargs, extra_body=stop)
    assert plain.usage.completion_tokens == at + 1
    # The stop token cannot be sampled before min_tokens, so greedy takes another there.
    held = openai_client.completions.create(**kwargs, extra_body={**stop, "min_tokens": at + 3})
    assert held.usage.completion_tokens >= at + 3


def test_logit_bias_forces_and_bans_tokens(openai_client, server):
    prompt_ids = server.engine.tokenizer.encode(PROMPT)
    first = greedy_ids(server.engine, prompt_ids, 1)[0]
    forced = next(t for t in range(10, 100) if t != first)
    kwargs = dict(model=server.model_name, prompt=prompt_ids, temperature=0)
    kwargs["extra_body"] = {"ignore_eos": True}
    reply = openai_client.completions.create(**kwargs, max_tokens=4, logit_bias={str(forced): 100})
    assert reply.choices[0].text == server.engine.tokenizer.decode([forced] * 4)
    # Tokens compared by their bytes: the text of two partial characters is the same U+FFFD.
    banned = openai_client.completions.create(
        **kwargs, max_tokens=1, logprobs=0, logit_bias={str(first): -100}
    )
    first_bytes = server.engine.tokenizer.token_bytes(first)
    assert banned.choices[0].logprobs.tokens[0] != first_bytes.decode("utf-8", "backslashreplace")


def test_allowed_token_ids_limit_the_output(openai_client, server):
    prompt_ids = server.engine.tokenizer.encode(PROMPT)
    first = greedy_ids(server.engine, prompt_ids, 1)[0]
    only = next(t for t in range(10, 100) if t != first)
    reply = openai_client.completions.create(
        model=server.model_name,
        prompt=prompt_ids,
        max_tokens=5,
        extra_body={"ignore_eos": True, "allowed_token_ids": [only]},
    )
    assert reply.choices[0].text == server.engine.tokenizer.decode([only] * 5)


@pytest.mark.parametrize(
    ("field", "as_sent"),
    [
        ("stop_token_ids", lambda ids: ids),
        ("allowed_token_ids", lambda ids: ids),
        ("logit_bias", lambda ids: {str(t): 1 for t in ids}),
    ],
)
def test_token_ids_outside_the_vocabulary_are_refused(openai_client, server, field, as_sent):
    vocab = server.engine.model.config.vocab_size
    for bad in ([vocab], [-1], [0, vocab + 7]):
        with pytest.raises(openai.BadRequestError) as caught:
            openai_client.completions.create(
                model=server.model_name,
                prompt="Hi",
                max_tokens=1,
                extra_body={field: as_sent(bad)},
            )
        assert field in caught.value.body["message"], caught.value.message
    reply = openai_client.completions.create(
        model=server.model_name, prompt="Hi", max_tokens=1, extra_body={field: as_sent([vocab - 1])}
    )
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_truncate_prompt_tokens_keeps_the_last_tokens(openai_client, server):
    prompt_ids = server.engine.tokenizer.encode(PROMPT)
    assert len(prompt_ids) > 4
    kwargs = dict(model=server.model_name, max_tokens=5, temperature=0)
    cut = openai_client.completions.create(
        **kwargs, prompt=PROMPT, extra_body={"truncate_prompt_tokens": 4, "ignore_eos": True}
    )
    assert cut.usage.prompt_tokens == 4
    tail = openai_client.completions.create(
        **kwargs, prompt=prompt_ids[-4:], extra_body={"ignore_eos": True}
    )
    assert cut.choices[0].text == tail.choices[0].text
    chat = openai_client.chat.completions.create(
        **kwargs, messages=CHAT, extra_body={"truncate_prompt_tokens": 3}
    )
    assert chat.usage.prompt_tokens == 3
    whole = openai_client.completions.create(
        **kwargs, prompt=PROMPT, extra_body={"truncate_prompt_tokens": -1}
    )
    assert whole.usage.prompt_tokens == len(prompt_ids)


def test_stream_options_without_stream_are_refused(openai_client, server):
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.chat.completions.create(
            model=server.model_name,
            messages=USER,
            max_tokens=1,
            stream_options={"include_usage": True},
        )
    assert caught.value.body["message"].startswith("stream_options")


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_continuous_usage_stats_put_the_usage_on_every_chunk(openai_client, server, endpoint):
    kwargs = dict(
        model=server.model_name,
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        # Greedy: sampled, the grammar's end (EOS, allowed once a letter is out) now and then
        # ends the answer before max_tokens.
        temperature=0,
        # Letters: no token's text waits for the rest of a character.
        extra_body={"ignore_eos": True, "guided_regex": "[a-z ]+"},
    )
    if endpoint == "chat":
        chunks = list(openai_client.chat.completions.create(messages=CHAT, **kwargs))
    else:
        chunks = list(openai_client.completions.create(prompt=PROMPT, **kwargs))
    assert all(c.usage is not None for c in chunks)
    final = chunks[-1].usage
    assert final.completion_tokens == 6
    assert {c.usage.prompt_tokens for c in chunks} == {final.prompt_tokens}
    counts = [c.usage.completion_tokens for c in chunks]
    # Counts so far: they grow with every chunk of text (vLLM's test: no chunk repeats the count
    # before it), from none before the first token (chat's opening chunk), and the usage chunk
    # after the last text repeats it.
    assert counts[-1] == counts[-2] == 6 and not chunks[-1].choices
    texts = counts[1:-1] if endpoint == "chat" else counts[:-1]
    assert texts == sorted(set(texts))
    if endpoint == "chat":
        assert counts[0] == 0
    assert all(
        c.usage.total_tokens == final.prompt_tokens + c.usage.completion_tokens for c in chunks
    )


def test_continuous_usage_stats_without_include_usage_add_no_usage(openai_client, server):
    # vLLM's reading: continuous_usage_stats spreads the usage include_usage adds.
    chunks = openai_client.completions.create(
        model=server.model_name,
        prompt="Hi",
        max_tokens=3,
        stream=True,
        stream_options={"include_usage": False, "continuous_usage_stats": True},
    )
    assert all(chunk.usage is None for chunk in chunks)


def test_add_special_tokens_false_leaves_out_the_bos(openai_client, server):
    tokenizer = server.engine.tokenizer
    with_bos = tokenizer.encode(PROMPT)
    without = tokenizer.encode(PROMPT, add_special_tokens=False)
    assert len(with_bos) == len(without) + 1
    reply = openai_client.completions.create(
        model=server.model_name,
        prompt=PROMPT,
        max_tokens=1,
        extra_body={"add_special_tokens": False},
    )
    assert reply.usage.prompt_tokens == len(without)


def stop_within(text: str) -> str:
    """Two ASCII letters or digits after the start of text: a stop string that ends it early."""
    pieces = [text[i : i + 2] for i in range(1, len(text) - 1)]
    return next(p for p in pieces if p.isascii() and p.isalnum())


@pytest.mark.parametrize("stream", [False, True])
def test_include_stop_str_in_output_keeps_the_stop_string(openai_client, server, stream):
    kwargs = dict(model=server.model_name, max_tokens=12, temperature=0, stream=stream)
    full = openai_client.completions.create(
        model=server.model_name, prompt=PROMPT, max_tokens=12, temperature=0
    )
    text = full.choices[0].text
    stop = stop_within(text)

    def reply_text(**extra) -> str:
        reply = openai_client.completions.create(**kwargs, prompt=PROMPT, stop=[stop], **extra)
        return "".join(c.choices[0].text for c in reply) if stream else reply.choices[0].text

    assert reply_text() == text[: text.index(stop)]
    kept = reply_text(extra_body={"include_stop_str_in_output": True})
    assert kept == text[: text.index(stop)] + stop
    chat = openai_client.chat.completions.create(**{**kwargs, "stream": False}, messages=CHAT)
    answer = chat.choices[0].message.content
    chat_stop = stop_within(answer)
    chat_kwargs = dict(**kwargs, messages=CHAT, stop=[chat_stop])
    chat_kwargs["extra_body"] = {"include_stop_str_in_output": True}
    reply = openai_client.chat.completions.create(**chat_kwargs)
    if stream:
        content = "".join(c.choices[0].delta.content or "" for c in reply if c.choices)
    else:
        content = reply.choices[0].message.content
    assert content == answer[: answer.index(chat_stop)] + chat_stop


def test_chat_add_generation_prompt_and_add_special_tokens(openai_client, server):
    tokenizer = server.engine.tokenizer
    kwargs = dict(model=server.model_name, messages=CHAT, max_tokens=1)
    open_turn = openai_client.chat.completions.create(
        **kwargs, extra_body={"add_generation_prompt": False}
    )
    expected = tokenizer.apply_chat_template(CHAT, add_generation_prompt=False)
    assert open_turn.usage.prompt_tokens == len(expected)
    with_bos = openai_client.chat.completions.create(
        **kwargs, extra_body={"add_special_tokens": True}
    )
    assert with_bos.usage.prompt_tokens == len(tokenizer.apply_chat_template(CHAT)) + 1


def test_the_developer_role_is_the_system_role(openai_client, server):
    kwargs = dict(model=server.model_name, max_tokens=6, temperature=0)
    as_system = openai_client.chat.completions.create(messages=CHAT, **kwargs)
    developer = [{**CHAT[0], "role": "developer"}, CHAT[1]]
    as_developer = openai_client.chat.completions.create(messages=developer, **kwargs)
    assert as_developer.choices[0].message.content == as_system.choices[0].message.content
    assert as_developer.usage.prompt_tokens == as_system.usage.prompt_tokens


# /tokenize, /detokenize, /version


def test_tokenize_a_prompt_gives_the_engine_s_ids(server):
    tokenizer = server.engine.tokenizer
    reply = post(server, "/tokenize", {"model": server.model_name, "prompt": PROMPT}).json()
    assert reply["tokens"] == tokenizer.encode(PROMPT)
    assert reply["count"] == len(reply["tokens"])
    assert reply["max_model_len"] == server.engine.max_seq_len
    assert "token_strs" not in reply
    bare = post(server, "/tokenize", {"prompt": PROMPT, "add_special_tokens": False}).json()
    assert bare["tokens"] == tokenizer.encode(PROMPT, add_special_tokens=False)
    named = post(server, "/tokenize", {"prompt": PROMPT, "return_token_strs": True}).json()
    assert named["token_strs"] == [tokenizer.id_to_token(t) for t in named["tokens"]]


def test_tokenize_messages_gives_the_chat_prompt(openai_client, server):
    tokenizer = server.engine.tokenizer
    reply = post(server, "/tokenize", {"messages": CHAT}).json()
    assert reply["tokens"] == tokenizer.apply_chat_template(CHAT)
    chat = openai_client.chat.completions.create(
        model=server.model_name, messages=CHAT, max_tokens=1
    )
    assert chat.usage.prompt_tokens == reply["count"]
    open_turn = post(server, "/tokenize", {"messages": CHAT, "add_generation_prompt": False})
    assert open_turn.json()["tokens"] == tokenizer.apply_chat_template(
        CHAT, add_generation_prompt=False
    )
    assert open_turn.json()["tokens"] != reply["tokens"]


def test_detokenize_inverts_tokenize(server):
    tokens = post(server, "/tokenize", {"prompt": PROMPT}).json()["tokens"]
    reply = post(server, "/detokenize", {"model": server.model_name, "tokens": tokens})
    assert reply.json() == {"prompt": server.engine.tokenizer.decode(tokens)}
    assert reply.json()["prompt"] == PROMPT


@pytest.mark.parametrize(
    ("path", "body", "named"),
    [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "Hi", "messages": USER}, "prompt"),
        ("/tokenize", {"prompt": "Hi", "model": "other"}, "other"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
        ("/detokenize", {"tokens": "Hi"}, "tokens"),
    ],
)
def test_bad_tokenizer_requests_get_400_or_404(server, path, body, named):
    response = post(server, path, body)
    assert response.status_code in (400, 404)
    assert named in error_message(response)


def test_version(server):
    response = httpx.get(
        f"{server.base_url}/version", headers={"Authorization": f"Bearer {server.api_key}"}
    )
    assert response.json() == {"version": astrai.__version__}


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize", "/version"])
def test_the_new_endpoints_need_the_key(server, path):
    method = "GET" if path == "/version" else "POST"
    response = httpx.request(method, f"{server.base_url}{path}", json={"prompt": "Hi"})
    assert response.status_code == 401


# Custom roles and message keys astrai does not know reach the chat template, which must show
# them; the tests' template shows any role, this one only its own and a `mood` it reads.
PICKY_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] in ['system', 'user', 'assistant'] %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] }}"
    "{% if message.mood is defined %}{{ ' (' + message.mood + ')' }}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% elif message['role'] == 'narrator' %}{{ raise_exception('no narrators here') }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def picky_server(tmp_path_factory, llama_dir):
    model_dir = tmp_path_factory.mktemp("picky")
    for file in llama_dir.iterdir():
        (model_dir / file.name).symlink_to(file)
    (model_dir / "chat_template.jinja").write_text(PICKY_TEMPLATE)
    with serving(make_engine(model_dir)) as server:
        yield server


def tokenized(server, messages: list[dict]) -> httpx.Response:
    return post(server, "/tokenize", {"messages": messages, "add_generation_prompt": False})


def test_a_custom_role_reaches_a_template_that_shows_it(openai_client, server):
    custom = [{"role": "my-custom-role", "content": "what is 1+1?"}]
    rendered = "<s><|im_start|>my-custom-role\nwhat is 1+1?<|im_end|>\n"
    expected = server.engine.tokenizer.encode(rendered, add_special_tokens=False)
    assert tokenized(server, custom).json()["tokens"] == expected
    # vLLM's test: text parts and a string are the same message.
    parts = [{**custom[0], "content": [{"type": "text", "text": "what is 1+1?"}]}]
    kwargs = dict(model=server.model_name, max_tokens=6, temperature=0)
    replies = [openai_client.chat.completions.create(messages=m, **kwargs) for m in (custom, parts)]
    assert replies[0].choices[0].message.content == replies[1].choices[0].message.content


def test_a_custom_role_the_template_drops_or_refuses_is_a_400(picky_server):
    for role, said in (
        ("my-custom-role", "leaves out messages of role 'my-custom-role'"),
        ("narrator", "no narrators here"),
    ):
        response = tokenized(picky_server, [{"role": role, "content": "Hi"}, *USER])
        assert response.status_code == 400 and said in error_message(response)
        chat = post(
            picky_server, "/v1/chat/completions", {"messages": [{"role": role, "content": "Hi"}]}
        )
        assert chat.status_code == 400 and said in error_message(chat)


def test_a_message_key_reaches_a_template_that_reads_it(picky_server):
    message = {**USER[0], "mood": "cheerful"}
    rendered = "<s><|im_start|>user\nHello (cheerful)<|im_end|>\n"
    expected = picky_server.engine.tokenizer.encode(rendered, add_special_tokens=False)
    assert tokenized(picky_server, [message]).json()["tokens"] == expected
    chat = post(picky_server, "/v1/chat/completions", {"messages": [message], "max_tokens": 1})
    assert chat.status_code == 200
    for path in ("/tokenize", "/v1/chat/completions"):
        body = {"messages": [{**USER[0], "extra_field": "0"}], "max_tokens": 1}
        if path == "/tokenize":
            body = {"messages": body["messages"]}
        response = post(picky_server, path, body)
        assert response.status_code == 400, path
        assert error_message(response).startswith("messages.0.extra_field"), path
