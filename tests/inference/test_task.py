"""Task post-processing: stop tokens, stop strings held back and cut, max_tokens."""

from __future__ import annotations

import pytest

from astrai.inference.task import (
    GenerationParams,
    InvalidParamsError,
    QueueFullError,
    Task,
    TaskManager,
)


class CharDetokenizer:
    """Token id i decodes to the i-th character of a fixed alphabet."""

    alphabet = "abcdefghijklmnopqrstuvwxyz <>"

    def add(self, token_id: int) -> str:
        return self.alphabet[token_id]


def feed(text: str, **params) -> tuple[Task, list[str]]:
    task = Task([0], GenerationParams(**params), None, CharDetokenizer(), frozenset({99}))
    pieces = []
    for ch in text:
        pieces.append(task.append_token(CharDetokenizer.alphabet.index(ch), None).text)
        if task.is_finished:
            break
    return task, pieces


def test_max_tokens_finishes_with_length():
    task, pieces = feed("abcdef", max_tokens=3)
    assert task.result().finish_reason == "length"
    assert "".join(pieces) == "abc" == task.result().text


def test_stop_string_spanning_tokens_is_cut_and_never_emitted():
    task, pieces = feed("hello <end> more", stop=("<end>",), max_tokens=50)
    result = task.result()
    assert result.finish_reason == "stop" and result.stop_reason == "<end>"
    assert result.text == "hello " == "".join(pieces)
    assert all("<" not in p for p in pieces)


def test_text_that_only_looks_like_a_stop_string_is_released():
    task, pieces = feed("a <en b", stop=("<end>",), max_tokens=7)
    assert "".join(pieces) == "a <en b" == task.result().text
    assert pieces[3] == ""  # "<e" was held back while it could still become "<end>"


def test_earliest_of_several_stop_strings_wins():
    task, _ = feed("xx cd ab", stop=("ab", "cd"), max_tokens=50)
    assert task.result().text == "xx " and task.result().stop_reason == "cd"


def test_stop_token_is_counted_but_not_decoded():
    task = Task([0], GenerationParams(max_tokens=5), None, CharDetokenizer(), frozenset({3}))
    task.append_token(0, None)
    delta = task.append_token(3, None)
    result = task.result()
    assert (result.finish_reason, result.stop_reason, result.text) == ("stop", 3, "a")
    assert result.token_ids == [0, 3] and delta.text == ""


def test_ignore_eos_keeps_going_but_explicit_stop_ids_still_stop():
    task = Task(
        [0],
        GenerationParams(max_tokens=5, ignore_eos=True, stop_token_ids=(2,)),
        None,
        CharDetokenizer(),
        frozenset({3}),
    )
    task.append_token(3, None)
    assert not task.is_finished
    task.append_token(2, None)
    assert task.result().stop_reason == 2


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 2}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logprobs": 21}, "logprobs"),
        ({"n": 0}, "n"),
        ({"stop": ("",)}, "stop"),
        ({"max_tokens": "5"}, "max_tokens"),
    ],
)
def test_bad_params_name_the_parameter(kwargs, name):
    with pytest.raises(InvalidParamsError, match=name):
        GenerationParams(**kwargs)


def test_queue_is_bounded():
    manager = TaskManager(max_waiting=2)
    tasks = [Task([0], GenerationParams(), None, CharDetokenizer()) for _ in range(3)]
    manager.add_tasks(tasks[:2])
    with pytest.raises(QueueFullError, match="full"):
        manager.add_tasks(tasks[2:])
