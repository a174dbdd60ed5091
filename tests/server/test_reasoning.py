"""Reasoning models: think blocks answered apart from the text by the OpenAI, Anthropic and
Responses APIs, the parser detected from the chat template, enable_thinking reaching it, and a
thinking budget forced by the engine.

The demo model is made to write "<think>x</think>y" by a regex constraint; a tiny random model
with a DeepSeek-R1-style template (the prompt opens the think block) thinks until its budget
forces </think>.
"""

from __future__ import annotations

import json
import shutil
import threading

import anthropic
import openai
import pytest
from live_server import API_KEY, MODEL_NAME, RunningServer, make_engine, start_server, stop_server

from astrai.inference import STOP, GenerationParams, InferenceEngine, InvalidParamsError
from astrai.inference.constraints import Constraint
from astrai.inference.task import ThinkingBudget
from astrai.launch import DEMO_MODEL_DIR
from astrai.model import AutoModel
from astrai.server import create_app
from astrai.server.reasoning import ThinkParser, reasoning_parser_for
from astrai.server.responses_api import _StreamedItems
from astrai.server.tool_parsers import ToolUse
from astrai.tokenize import AutoTokenizer

USER = [{"role": "user", "content": "Why is the sky blue?"}]
FORCED = {"guided_regex": "<think>x</think>y"}

# DeepSeek-R1's way: the generation prompt opens the think block; Qwen3's enable_thinking
# false closes it at once. An assistant turn's reasoning_content is shown in its own block.
R1_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message.reasoning_content is defined and message.reasoning_content %}"
    "{{ '<think>' + message.reasoning_content + '</think>' }}{% endif %}"
    "{{ message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}"
    "{{ '<think>\n\n</think>\n\n' }}{% else %}{{ '<think>\n' }}{% endif %}{% endif %}"
)


def serve(engine, **options):
    running = start_server(create_app(engine, MODEL_NAME, api_key=API_KEY, **options))
    return running, RunningServer(f"http://127.0.0.1:{running.port}", engine)


@pytest.fixture(scope="module")
def demo():
    """The demo model, whose template shows no think blocks, with --reasoning-parser think."""
    model = AutoModel.from_pretrained(DEMO_MODEL_DIR, dtype="float32")
    engine = InferenceEngine(model, AutoTokenizer.from_pretrained(DEMO_MODEL_DIR))
    running, server = serve(engine, reasoning_parser="think")
    try:
        yield server
    finally:
        stop_server(running)
        engine.close()


@pytest.fixture(scope="module")
def thinker(llama_dir, tmp_path_factory):
    """The tiny model behind the R1-style template, its parser left to detection."""
    directory = tmp_path_factory.mktemp("thinker") / "model"
    shutil.copytree(llama_dir, directory)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "chat_template": R1_TEMPLATE}))
    engine = make_engine(directory, max_seq_len=512)
    running, server = serve(engine)
    try:
        yield server
    finally:
        stop_server(running)
        engine.close()


def openai_client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)


def anthropic_client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key=API_KEY, max_retries=0)


# The split, on the demo model forced to think


def test_openai_chat_gives_the_think_block_as_reasoning_content(demo):
    client = openai_client(demo)
    kwargs = dict(model=MODEL_NAME, messages=USER, max_tokens=30, extra_body=FORCED)
    message = client.chat.completions.create(**kwargs).choices[0].message
    assert (message.reasoning_content, message.content) == ("x", "y")
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    kinds = [
        "reasoning" if getattr(d, "reasoning_content", None) else "content"
        for d in deltas
        if getattr(d, "reasoning_content", None) or d.content
    ]
    assert kinds == sorted(kinds, reverse=True)  # all reasoning before any content
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "x"
    assert "".join(d.content or "" for d in deltas) == "y"


def test_without_a_think_block_there_is_no_reasoning(demo):
    reply = openai_client(demo).chat.completions.create(
        model=MODEL_NAME, messages=USER, max_tokens=10, extra_body={"guided_regex": "plain"}
    )
    assert reply.choices[0].message.content == "plain"
    assert reply.choices[0].message.reasoning_content is None


def test_responses_items_of_a_think_block():
    stream = _StreamedItems(ToolUse(), ThinkParser().stream(opened=False))
    events = []
    for piece in ["<thi", "nk>", "x</th", "ink>", "y"]:
        events += stream.feed(piece)
    events += stream.finish("completed")
    assert [kind for kind, _ in events] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    reasoning, message = stream.output
    assert reasoning["type"] == "reasoning" and reasoning["content"][0]["text"] == "x"
    assert message["type"] == "message" and message["content"][0]["text"] == "y"
    assert [data["output_index"] for _, data in events] == [0] * 6 + [1] * 6


@pytest.mark.parametrize(
    ("text", "opened", "split"),
    [
        ("<think>x</think>y", False, ("x", "y")),
        (" <think>\n a \n</think>\n\nb ", False, ("a", "b ")),
        ("a <think>b</think>", False, (None, "a <think>b</think>")),
        ("a</think>b", True, ("a", "b")),
        ("cut off </thi", True, ("cut off </thi", "")),
        ("<thi", False, (None, "<thi")),
    ],
)
def test_a_stream_splits_as_the_whole_text_does(text, opened, split):
    parser = ThinkParser()
    assert parser.split(text, opened) == split
    for size in (1, 2, 3):
        stream, reasoning, content = parser.stream(opened), "", ""
        for at in range(0, len(text), size):
            more_reasoning, more_content = stream.feed(text[at : at + size])
            reasoning, content = reasoning + more_reasoning, content + more_content
        more_reasoning, more_content = stream.finish()
        assert (reasoning + more_reasoning or None, content + more_content) == split


# A model whose template opens the think block


def test_the_parser_is_found_from_the_template():
    assert isinstance(reasoning_parser_for(None, [R1_TEMPLATE]), ThinkParser)
    assert reasoning_parser_for(None, ["{{ messages }}"]) is None
    assert isinstance(reasoning_parser_for("deepseek_r1", ["{{ messages }}"]), ThinkParser)
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        reasoning_parser_for("nope", [])


def test_an_open_think_block_is_all_reasoning_until_enable_thinking_closes_it(thinker):
    client = openai_client(thinker)
    kwargs = dict(model=MODEL_NAME, messages=USER, max_tokens=8, temperature=0)
    thinking = client.chat.completions.create(**kwargs)
    message = thinking.choices[0].message
    assert message.reasoning_content and message.content == ""
    closed = client.chat.completions.create(
        **kwargs, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    assert closed.choices[0].message.reasoning_content is None
    assert closed.choices[0].message.content
    assert closed.usage.prompt_tokens > thinking.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            **kwargs, extra_body={"chat_template_kwargs": {"add_generation_prompt": False}}
        )
    assert caught.value.body["param"] == "chat_template_kwargs"


def test_anthropic_thinking_budget_forces_the_end_of_thinking(thinker):
    client = anthropic_client(thinker)
    kwargs = dict(model=MODEL_NAME, messages=USER, max_tokens=24, extra_body={"temperature": 0})
    unlimited = client.messages.create(**kwargs, thinking={"type": "adaptive"})
    [thought] = unlimited.content
    assert thought.type == "thinking" and unlimited.stop_reason == "max_tokens"
    budget = {"type": "enabled", "budget_tokens": 6}
    limited = client.messages.create(**kwargs, thinking=budget)
    thinking, text = limited.content
    assert thinking.type == "thinking" and text.type == "text" and text.text
    # Greedy thinking is the unlimited one's, cut after its first 6 tokens.
    assert thought.thinking.startswith(thinking.thinking) and thinking.thinking != thought.thinking
    tokenizer = thinker.engine.tokenizer
    assert len(tokenizer.encode(thinking.thinking, add_special_tokens=False)) <= 6
    with client.messages.stream(**kwargs, thinking=budget) as stream:
        streamed = stream.get_final_message()
    assert [block.model_dump() for block in streamed.content] == [
        block.model_dump() for block in limited.content
    ]
    disabled = client.messages.create(**kwargs, thinking={"type": "disabled"})
    assert [block.type for block in disabled.content] == ["text"]


def test_anthropic_thinking_needs_a_reasoning_model_and_room(thinker, server):
    for target, thinking, kwargs, named in [
        (server, {"type": "enabled", "budget_tokens": 4}, {}, "--reasoning-parser"),
        (thinker, {"type": "enabled", "budget_tokens": 10}, {}, "budget_tokens"),
        (thinker, {"type": "enabled"}, {}, "budget_tokens"),
        (
            thinker,
            {"type": "enabled", "budget_tokens": 4},
            {
                "tools": [{"name": "f", "input_schema": {"type": "object"}}],
                "tool_choice": {"type": "any"},
            },
            "tool_choice",
        ),
    ]:
        with pytest.raises(anthropic.BadRequestError) as caught:
            anthropic_client(target).messages.create(
                model=MODEL_NAME, messages=USER, max_tokens=10, thinking=thinking, **kwargs
            )
        assert named in caught.value.message


def test_anthropic_thinking_blocks_sent_back_reach_the_template(thinker):
    client = anthropic_client(thinker)
    answer = [{"type": "text", "text": "Light scatters."}]
    thought = {"type": "thinking", "thinking": "Rayleigh.", "signature": ""}

    def count(content) -> int:
        messages = [*USER, {"role": "assistant", "content": content}, *USER]
        return client.messages.count_tokens(model=MODEL_NAME, messages=messages).input_tokens

    tokenizer = thinker.engine.tokenizer
    shown = len(tokenizer.encode("<think>Rayleigh.</think>", add_special_tokens=False))
    assert count([thought, *answer]) - count(answer) == shown


def test_responses_reasoning_items_and_tokens(thinker):
    client = openai_client(thinker)
    kwargs = dict(model=MODEL_NAME, input="Why?", max_output_tokens=8, temperature=0)
    response = client.responses.create(**kwargs)
    [reasoning] = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text
    assert response.status == "incomplete" and reasoning.status == "incomplete"
    assert response.usage.output_tokens_details.reasoning_tokens == 8
    events = list(client.responses.create(stream=True, **kwargs))
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == reasoning.content[0].text
    assert events[-1].response.output[0].content == reasoning.content
    chat = openai_client(thinker).chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Why?"}],
        max_tokens=8,
        temperature=0,
    )
    assert chat.choices[0].message.reasoning_content == reasoning.content[0].text


def test_include_encrypted_content_carries_the_reasoning_back(thinker):
    client = openai_client(thinker)
    kwargs = dict(model=MODEL_NAME, max_output_tokens=6, temperature=0)
    response = client.responses.create(
        input="Why?", include=["reasoning.encrypted_content"], store=False, **kwargs
    )
    [reasoning] = response.output
    assert reasoning.encrypted_content == reasoning.content[0].text
    later = [{"role": "user", "content": "Why?"}, {"role": "assistant", "content": "Blue."}]
    later += [{"role": "user", "content": "And?"}]

    def input_tokens(item: dict) -> int:
        conversation = [*later[:1], item, *later[1:]]
        return client.responses.create(input=conversation, **kwargs).usage.input_tokens

    opaque = {"type": "reasoning", "summary": [], "encrypted_content": reasoning.encrypted_content}
    plain = reasoning.model_dump(include={"type", "summary", "content"})
    alone = client.responses.create(input=later, **kwargs).usage.input_tokens
    assert input_tokens(opaque) == input_tokens(plain) > alone
    # A reasoning item is the thinking of the item right after it, when that is the assistant's.
    misplaced = client.responses.create(input=[opaque, *later], **kwargs)
    assert misplaced.usage.input_tokens == alone


# The engine's part: forcing the end of thinking


def greedy(engine, prompt_ids, **settings) -> list[int]:
    done, ids = threading.Event(), []

    def on_delta(task, delta) -> None:
        if delta is STOP:
            done.set()
        else:
            ids.extend(delta.token_ids)

    params = GenerationParams(max_tokens=10, temperature=0, ignore_eos=True, **settings)
    engine.submit(prompt_ids, params, on_delta)
    assert done.wait(60)
    return ids


def test_a_spent_budget_forces_the_end_ids_once(thinker):
    engine = thinker.engine
    prompt = engine.tokenizer.encode("The quick brown fox")
    plain = greedy(engine, prompt)
    ends = next((a, b) for a in range(10, 60) for b in range(10, 60) if (a, b) != tuple(plain[3:5]))
    forced = greedy(engine, prompt, thinking_budget=ThinkingBudget(3, ends))
    assert forced[:5] == plain[:3] + list(ends)
    assert forced[5:] == greedy(engine, prompt + forced[:5])[:5]
    # Thinking that ended on its own within the budget is left alone.
    natural = greedy(engine, prompt, thinking_budget=ThinkingBudget(4, tuple(plain[1:3])))
    assert natural == plain


def test_thinking_budget_params_are_checked():
    assert ThinkingBudget.parse("512:7,8") == ThinkingBudget(512, (7, 8))
    for text in ("512", "x:1", "5:"):
        with pytest.raises(InvalidParamsError, match="N:ID"):
            ThinkingBudget.parse(text)
    with pytest.raises(InvalidParamsError, match="end_ids"):
        ThinkingBudget(3, ())
    with pytest.raises(InvalidParamsError, match="constraint"):
        GenerationParams(thinking_budget=ThinkingBudget(3, (1,)), constraint=Constraint.regex("a"))
