"""Stop strings: one automaton for all of them, against a naive reference, at bounded cost."""

from __future__ import annotations

import sys
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from astrai.inference import stop_strings, task
from astrai.inference.stop_strings import StopStringMatcher
from astrai.inference.task import (
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    GenerationParams,
    InvalidParamsError,
    Task,
)


class PieceDetokenizer:
    """Token id i decodes to pieces[i]."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def add(self, token_id: int) -> str:
        return self.pieces[token_id]


def stream(pieces: list[str], stops: tuple[str, ...]) -> tuple[list[str], str, str | None]:
    """Feed a task one token per piece: what it released per token, its text, its stop."""
    params = GenerationParams(max_tokens=len(pieces), stop=stops)
    task = Task([0], params, None, PieceDetokenizer(pieces))
    released = []
    for token_id in range(len(pieces)):
        released.append(task.append_token(token_id, None).text)
        if task.is_finished:
            break
    return released, task.result().text, task.result().stop_reason


def reference(pieces: list[str], stops: tuple[str, ...]) -> tuple[list[str], str, str | None]:
    """The semantics, naively: after each piece, the earliest stop string in the unreleased
    text (the shortest of those starting there) ends the text before it; otherwise all is
    released but the longest suffix that begins some stop string, and all of it at the end."""
    text, emitted, released = "", 0, []
    for i, piece in enumerate(pieces):
        text += piece
        tail = text[emitted:]
        hits = [(tail.find(s), s) for s in stops if s in tail]
        if hits:
            index, stop = min(hits)
            text = text[: emitted + index]
            released.append(text[emitted:])
            return released, text, stop
        last = i == len(pieces) - 1
        prefixes = (k for s in stops for k in range(1, len(s)) if text.endswith(s[:k]))
        held = 0 if last else max(prefixes, default=0)
        released.append(text[emitted : len(text) - held])
        emitted = len(text) - held
    return released, text, None


@settings(max_examples=400, deadline=None)
@given(
    pieces=st.lists(st.text("abc", max_size=4), min_size=1, max_size=24),
    stops=st.lists(st.text("abc", min_size=1, max_size=5), min_size=1, max_size=5),
)
def test_stop_strings_match_the_naive_reference(pieces, stops):
    assert stream(pieces, tuple(stops)) == reference(pieces, tuple(stops))


def test_the_longest_partial_match_is_held_back_whichever_stop_it_begins():
    # "ab" begins the longer stop string, but "xab" begins the other one: "x" must wait.
    released, text, stop = stream(["x", "a", "b", "q", "z"], ("abcde", "xabq"))
    assert (released, text, stop) == (["", "", "", ""], "", "xabq")


def test_the_first_token_to_complete_a_stop_string_ends_at_its_earliest_one():
    assert stream(["abc", "d"], ("c", "abcd"))[1:] == ("ab", "c")
    assert stream(["ab", "cd"], ("c", "abcd"))[1:] == ("", "abcd")


def test_stop_strings_are_bounded():
    GenerationParams(stop=("x",) * MAX_STOP_STRINGS)
    GenerationParams(stop=("x" * MAX_STOP_CHARS,))
    with pytest.raises(InvalidParamsError, match=f"at most {MAX_STOP_STRINGS} are allowed"):
        GenerationParams(stop=("x",) * (MAX_STOP_STRINGS + 1))
    with pytest.raises(InvalidParamsError, match=f"at most {MAX_STOP_CHARS} are allowed"):
        GenerationParams(stop=("x" * (MAX_STOP_CHARS // 2), "y" * (MAX_STOP_CHARS // 2 + 1)))


def test_the_matcher_is_built_once_per_request():
    params = GenerationParams(stop=("end",), seed=1)
    first = Task([0], params, None, PieceDetokenizer([]))
    again = Task([0], params, None, PieceDetokenizer([]))
    sibling = Task([0], replace(params, seed=2), None, PieceDetokenizer([]), parent=first)
    assert again._stop_matcher is first._stop_matcher is sibling._stop_matcher


def lines_run(fn) -> int:
    """Lines of the stop checking code (task.py, stop_strings.py) that fn runs: its work,
    counted rather than timed."""
    files = {task.__file__, stop_strings.__file__}
    lines = 0

    def count(frame, event, arg):
        nonlocal lines
        lines += event == "line"
        return count

    sys.settrace(lambda frame, event, arg: count if frame.f_code.co_filename in files else None)
    try:
        fn()
    finally:
        sys.settrace(None)
    return lines


def crafted(count: int) -> tuple[str, ...]:
    """The worst case for matching each stop string alone against a stream of "a"s: every
    one is a partial match all along, and the longest is held back."""
    return tuple("a" * k + "b" for k in range(count))


def test_stop_checking_work_per_token_does_not_grow_with_the_stop_strings():
    def per_token(stops: tuple[str, ...]) -> int:
        tokens = 2000
        params = GenerationParams(max_tokens=tokens, stop=stops)
        task = Task([0], params, None, PieceDetokenizer(["a"]))
        return lines_run(lambda: [task.append_token(0, None) for _ in range(tokens)])

    most = 89  # 89 crafted strings hold 4005 characters
    assert sum(map(len, crafted(most))) <= MAX_STOP_CHARS
    assert per_token(crafted(most)) <= per_token(("ab",))


def test_a_thousand_crafted_stop_strings_cost_a_few_steps_per_character():
    matcher = StopStringMatcher(crafted(1000))
    text = "a" * 5000 + "c" + "a" * 3000 + "b"
    state, found = 0, None

    def feed():
        nonlocal state, found
        for char in text:
            state, found = matcher.feed(state, char)
            if found:
                return

    assert lines_run(feed) <= 10 * len(text)
    assert found == (-999, "a" * 999 + "b")  # the earliest start, 999 "a"s before the "b"
