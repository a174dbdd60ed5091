"""Ollama's API on a real server: the ollama client's list, show, ps, chat (streamed and not),
generate, a tool call and a JSON schema format; raw NDJSON streams and their final record;
options against the OpenAI API's sampling; refusals in Ollama's error shape."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator

import httpx
import jsonschema
import ollama
import openai
import pytest
from live_server import API_KEY, MODEL_NAME, RunningServer, make_engine, serving
from test_reasoning import R1_TEMPLATE

from astrai.server.ollama_api import OLLAMA_VERSION

USER = [{"role": "user", "content": "Hello world!"}]
GREEDY = {"temperature": 0, "num_predict": 8}
METRICS = (
    "total_duration",
    "load_duration",
    "prompt_eval_count",
    "prompt_eval_duration",
    "eval_count",
    "eval_duration",
)


def ollama_client(server: RunningServer) -> ollama.Client:
    return ollama.Client(host=server.base_url, headers={"Authorization": f"Bearer {API_KEY}"})


def openai_client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def client(server) -> ollama.Client:
    return ollama_client(server)


def post(server: RunningServer, path: str, body: dict) -> httpx.Response:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    return httpx.post(f"{server.base_url}{path}", json=body, headers=headers, timeout=60)


def ndjson(response: httpx.Response) -> list[dict]:
    assert response.headers["content-type"] == "application/x-ndjson"
    return [json.loads(line) for line in response.text.splitlines()]


# The model's facts


def test_list_show_ps_and_version(client, server):
    [listed] = client.list().models
    assert listed.model == MODEL_NAME and listed.size > 0 and listed.modified_at is not None
    shown = client.show(MODEL_NAME)
    assert shown.template == server.engine.tokenizer.chat_templates["default"]
    info = shown.modelinfo
    assert info[f"{info['general.architecture']}.context_length"] == server.engine.max_seq_len
    assert shown.capabilities == ["completion", "tools"]  # Hermes' calls: the template drops tools
    [running] = client.ps().models
    assert (running.model, running.context_length) == (MODEL_NAME, server.engine.max_seq_len)
    assert client.show(f"{MODEL_NAME}:latest").template == shown.template
    response = httpx.get(f"{server.base_url}/api/version", headers={"x-api-key": API_KEY})
    assert response.json() == {"version": OLLAMA_VERSION}


# chat and generate


def test_chat_is_the_openai_answer_streamed_or_not(client, server):
    reply = client.chat(MODEL_NAME, messages=USER, options=GREEDY)
    expected = openai_client(server).chat.completions.create(
        model=MODEL_NAME, messages=USER, temperature=0, max_tokens=8
    )
    assert reply.message.content == expected.choices[0].message.content
    assert (reply.done, reply.done_reason, reply.eval_count) == (True, "length", 8)
    assert reply.prompt_eval_count == expected.usage.prompt_tokens
    parts = list(client.chat(MODEL_NAME, messages=USER, options=GREEDY, stream=True))
    assert "".join(part.message.content for part in parts) == reply.message.content
    assert [part.done for part in parts] == [False] * (len(parts) - 1) + [True]
    assert parts[-1].done_reason == "length" and parts[-1].eval_count == 8


def test_a_stream_is_ndjson_ending_in_ollama_s_final_record(server):
    # Ollama streams unless told not to.
    body = {"model": MODEL_NAME, "messages": USER, "options": GREEDY}
    records = ndjson(post(server, "/api/chat", body))
    *pieces, final = records
    for piece in pieces:
        assert set(piece) == {"model", "created_at", "message", "done"} and not piece["done"]
        assert piece["message"]["role"] == "assistant"
    assert final["done"] is True and final["done_reason"] in ("stop", "length")
    assert final["message"] == {"role": "assistant", "content": ""}
    for name in METRICS:
        assert isinstance(final[name], int) and final[name] >= 0, name
    assert final["total_duration"] >= final["prompt_eval_duration"] + final["eval_duration"]
    assert final["eval_count"] > 0 and final["eval_duration"] > 0
    body = {"model": MODEL_NAME, "prompt": "Hi", "options": GREEDY}
    generated = ndjson(post(server, "/api/generate", body))
    assert all("response" in record for record in generated)
    assert generated[-1]["done"] and all(name in generated[-1] for name in METRICS)
    whole = post(server, "/api/generate", {**body, "stream": False})
    assert whole.headers["content-type"] == "application/json"
    assert whole.json()["response"] == "".join(r["response"] for r in generated)


def test_generate_applies_the_template_with_the_system_text_unless_raw(client, server):
    system = "Be brief."
    generated = client.generate(MODEL_NAME, "Hello world!", system=system, options=GREEDY)
    chatted = client.chat(
        MODEL_NAME, messages=[{"role": "system", "content": system}, *USER], options=GREEDY
    )
    assert generated.response == chatted.message.content
    raw = client.generate(MODEL_NAME, "The quick brown fox", raw=True, options=GREEDY)
    completion = openai_client(server).completions.create(
        model=MODEL_NAME, prompt="The quick brown fox", temperature=0, max_tokens=8
    )
    assert raw.response == completion.choices[0].text
    assert raw.prompt_eval_count == completion.usage.prompt_tokens


def test_options_sample_as_the_openai_fields_do(client, server):
    options = {
        "temperature": 1.3,
        "top_k": 20,
        "top_p": 0.9,
        "min_p": 0.02,
        "repeat_penalty": 1.4,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.3,
        "seed": 11,
        "num_predict": 16,
    }
    reply = client.chat(MODEL_NAME, messages=USER, options=options)
    expected = openai_client(server).chat.completions.create(
        model=MODEL_NAME,
        messages=USER,
        temperature=1.3,
        top_p=0.9,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        seed=11,
        max_tokens=16,
        extra_body={"top_k": 20, "min_p": 0.02, "repetition_penalty": 1.4},
    )
    assert reply.message.content == expected.choices[0].message.content
    # A sampling option that changes the draw changes the answer: the options are not ignored.
    for changed in ({"seed": 12}, {"top_k": 1}, {"repeat_penalty": 1.0}):
        other = client.chat(MODEL_NAME, messages=USER, options={**options, **changed})
        assert other.message.content != reply.message.content, changed


def test_stop_and_num_predict(client):
    whole = client.generate(MODEL_NAME, "Hi", options=GREEDY).response
    stop = whole[3:5]
    cut = client.generate(MODEL_NAME, "Hi", options={**GREEDY, "stop": [stop]})
    assert cut.response == whole[: whole.index(stop)] and cut.done_reason == "stop"
    unbounded = client.generate(MODEL_NAME, "Hi", options={"temperature": 0, "num_predict": -1})
    assert unbounded.response.startswith(whole)


def test_num_ctx_bounds_the_request_within_the_server_s_context(client, server):
    prompt_tokens = client.generate(MODEL_NAME, "Hi", options=GREEDY).prompt_eval_count
    options = {"temperature": 0, "num_ctx": prompt_tokens + 3}
    reply = client.generate(MODEL_NAME, "Hi", options=options)
    assert (reply.eval_count, reply.done_reason) == (3, "length")
    for refused in (
        {"num_ctx": prompt_tokens + 3, "num_predict": 4},
        {"num_ctx": prompt_tokens},
        {"num_ctx": server.engine.max_seq_len + 1},
    ):
        with pytest.raises(ollama.ResponseError) as caught:
            client.generate(MODEL_NAME, "Hi", options=refused)
        assert caught.value.status_code == 400 and "num_ctx" in caught.value.error


def test_format_holds_the_answer_to_json_or_a_schema(client):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "people": {"type": "integer"}},
        "required": ["city", "people"],
    }
    options = {"temperature": 1.0, "seed": 3, "num_predict": 60}
    reply = client.chat(MODEL_NAME, messages=USER, format=schema, options=options)
    jsonschema.validate(json.loads(reply.message.content), schema)
    streamed = client.chat(MODEL_NAME, messages=USER, format=schema, options=options, stream=True)
    assert "".join(part.message.content for part in streamed) == reply.message.content
    generated = client.generate(MODEL_NAME, "Hi", format="json", options=options)
    assert isinstance(json.loads(generated.response), dict)
    with pytest.raises(ollama.ResponseError) as caught:
        client.generate(MODEL_NAME, "Hi", format={"type": "no such type"})
    assert caught.value.status_code == 400 and caught.value.error.startswith("format")


def test_logprobs_are_the_openai_api_s(client, server):
    reply = client.chat(MODEL_NAME, messages=USER, options=GREEDY, logprobs=True, top_logprobs=2)
    expected = openai_client(server).chat.completions.create(
        model=MODEL_NAME, messages=USER, temperature=0, max_tokens=8, logprobs=True, top_logprobs=2
    )
    wanted = [entry.model_dump(exclude={"bytes"}) for entry in expected.choices[0].logprobs.content]
    for entry in wanted:
        entry["top_logprobs"] = [
            {"token": t["token"], "logprob": t["logprob"]} for t in entry["top_logprobs"]
        ]
    assert [entry.model_dump() for entry in reply.logprobs] == wanted
    streamed = client.chat(
        MODEL_NAME, messages=USER, options=GREEDY, logprobs=True, top_logprobs=2, stream=True
    )
    assert [e for part in streamed for e in part.logprobs or ()] == list(reply.logprobs)
    generated = client.generate(MODEL_NAME, "Hi", options=GREEDY, logprobs=True)
    assert len(generated.logprobs) == generated.eval_count
    assert all(entry.top_logprobs == [] for entry in generated.logprobs)


# Tools: a random-weight model writes no call by itself, so a format schema makes it write a
# Llama 3 JSON call, which the llama3_json parser reads.


def get_time(zone: str) -> str:
    """The time in a zone.

    Args:
      zone: the time zone, such as UTC
    """
    return "12:00"


CALL_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"const": "get_time"},
        "parameters": {
            "type": "object",
            "properties": {"zone": {"const": "UTC"}},
            "required": ["zone"],
        },
    },
    "required": ["name", "parameters"],
}


@pytest.fixture(scope="module")
def llama3_server(llama_dir) -> Iterator[RunningServer]:
    with serving(make_engine(llama_dir), tool_call_parser="llama3_json") as server:
        yield server


def test_a_tool_call_comes_in_ollama_s_shape_and_its_result_goes_back(llama3_server):
    client = ollama_client(llama3_server)
    kwargs = dict(tools=[get_time], format=CALL_SCHEMA, options={"temperature": 0})
    reply = client.chat(MODEL_NAME, messages=USER, **kwargs)
    [call] = reply.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_time", {"zone": "UTC"})
    assert reply.message.content == ""
    streamed = [p.message for p in client.chat(MODEL_NAME, messages=USER, stream=True, **kwargs)]
    assert [m.tool_calls for m in streamed if m.tool_calls] == [[call]]
    assert "".join(m.content for m in streamed) == ""
    result = {"role": "tool", "content": get_time("UTC"), "tool_name": "get_time"}
    answer = client.chat(
        MODEL_NAME,
        messages=[*USER, reply.message, result],
        tools=[get_time],
        options={"temperature": 0, "num_predict": 4},
    )
    assert answer.done


# Thinking: the tiny model behind DeepSeek-R1's template, whose prompt opens the think block.


@pytest.fixture(scope="module")
def thinker(llama_dir, tmp_path_factory) -> Iterator[RunningServer]:
    directory = tmp_path_factory.mktemp("thinker") / "model"
    shutil.copytree(llama_dir, directory)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "chat_template": R1_TEMPLATE}))
    with serving(make_engine(directory, max_seq_len=512)) as server:
        yield server


@pytest.mark.parametrize("think", [True, False])
def test_think_is_the_template_s_switch_and_thinking_comes_apart(thinker, think):
    client = ollama_client(thinker)
    reply = client.chat(MODEL_NAME, messages=USER, think=think, options=GREEDY)
    expected = openai_client(thinker).chat.completions.create(
        model=MODEL_NAME,
        messages=USER,
        temperature=0,
        max_tokens=8,
        extra_body={"chat_template_kwargs": {"enable_thinking": think}},
    )
    message = expected.choices[0].message
    assert reply.message.thinking == message.reasoning_content
    assert reply.message.content == message.content
    assert (reply.message.thinking is not None) == think  # the open block thinks to the end
    streamed = list(
        client.chat(MODEL_NAME, messages=USER, think=think, options=GREEDY, stream=True)
    )
    assert "".join(p.message.thinking or "" for p in streamed) == (reply.message.thinking or "")
    assert "".join(p.message.content for p in streamed) == reply.message.content
    generated = client.generate(MODEL_NAME, "Hello world!", think=think, options=GREEDY)
    assert (generated.thinking, generated.response) == (
        reply.message.thinking,
        reply.message.content,
    )


# What is refused, in Ollama's error shape


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"options": {"frobnicate": 1}}, "options.frobnicate"),
        ({"options": {"mirostat": 2}}, "options.mirostat"),
        ({"options": {"num_gpu": 1}}, "options.num_gpu"),
        ({"options": {"num_predict": 0}}, "options.num_predict"),
        ({"keep_alive": "5m"}, "keep_alive"),
        ({"keep_alive": 0}, "keep_alive"),
        ({"think": True}, "think"),
        ({"think": "high"}, "think"),
        ({"messages": [{**USER[0], "images": ["aGk="]}]}, "reads text only"),
        ({"top_logprobs": 2}, "top_logprobs"),
    ],
)
def test_what_astrai_cannot_honour_is_a_400_naming_it(server, fields, named):
    response = post(server, "/api/chat", {"model": MODEL_NAME, "messages": USER, **fields})
    assert response.status_code == 400
    assert set(response.json()) == {"error"}
    assert named in response.json()["error"]


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"images": ["aGk="]}, "reads text only"),
        ({"images": ["aGk="], "raw": True}, "images"),
        ({"template": "{{ .Prompt }}"}, "template"),
        ({"context": [1, 2]}, "context"),
        ({"suffix": "end"}, "suffix"),
        ({"raw": True, "system": "Be brief."}, "system"),
    ],
)
def test_generate_refuses_what_it_cannot_honour(server, fields, named):
    response = post(server, "/api/generate", {"model": MODEL_NAME, "prompt": "Hi", **fields})
    assert response.status_code == 400 and named in response.json()["error"]


def test_keep_alive_for_ever_and_loading_are_served(server):
    loaded = post(server, "/api/chat", {"model": MODEL_NAME, "messages": [], "keep_alive": -1})
    assert loaded.status_code == 200
    assert loaded.json()["done_reason"] == "load" and loaded.json()["done"] is True
    for keep_alive in (-1, "-1m", "-1"):
        body = {"model": MODEL_NAME, "prompt": "Hi", "stream": False, "keep_alive": keep_alive}
        body["options"] = GREEDY
        assert post(server, "/api/generate", body).status_code == 200, keep_alive


def test_unknown_model_key_and_body_errors_are_ollama_s_shape(client, server):
    with pytest.raises(ollama.ResponseError) as caught:
        client.chat("llama3.2", messages=USER)
    assert caught.value.status_code == 404 and MODEL_NAME in caught.value.error
    keyless = ollama.Client(host=server.base_url)
    with pytest.raises(ollama.ResponseError) as caught:
        keyless.list()
    assert caught.value.status_code == 401 and "API key" in caught.value.error
    response = post(server, "/api/show", {})
    assert response.status_code == 400 and "model" in response.json()["error"]


def test_a_body_is_json_whatever_its_content_type(server):
    # Ollama's curl examples send no Content-Type, so curl sends its form default.
    body = {"model": MODEL_NAME, "prompt": "Hi", "stream": False, "options": GREEDY}
    headers = {
        "Authorization": f"Bearer {API_KEY}",
        "Content-Type": "application/x-www-form-urlencoded",
    }
    response = httpx.post(
        f"{server.base_url}/api/generate", content=json.dumps(body), headers=headers
    )
    assert response.status_code == 200 and response.json()["done"] is True
