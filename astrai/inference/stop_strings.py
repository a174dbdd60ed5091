"""Stop strings matched all at once by one Aho-Corasick automaton, fed only new text."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence


class StopStringMatcher:
    """A request's stop strings as one automaton over characters (Aho-Corasick).

    A state stands for the longest suffix of the text fed so far that is a prefix of some stop
    string, so its depth is exactly how much text must be held back: anything before it can
    never be part of a stop string. Feeding text costs amortised O(1) per character (each
    failure step shortens that suffix, which grew by at most one per character), however many
    stop strings there are and however long the held-back text is. The matcher is immutable
    and shared; a reader keeps only its state, an int, starting at 0.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self._next: list[dict[str, int]] = [{}]  # trie edges: state -> char -> state
        self._depth = [0]
        ends: dict[int, str] = {}  # state -> the stop string it spells
        for stop in stops:
            state = 0
            for char in stop:
                child = self._next[state].get(char)
                if child is None:
                    child = len(self._next)
                    self._next[state][char] = child
                    self._next.append({})
                    self._depth.append(self._depth[state] + 1)
                state = child
            ends[state] = stop
        # fail: the state of the longest proper suffix that is also a prefix of a stop string.
        # longest: the longest stop string that is a suffix of the state's text, if any; it
        # starts earliest among those ending here.
        self._fail = [0] * len(self._next)
        self._longest: list[str | None] = [None] * len(self._next)
        queue = deque(self._next[0].values())
        for state in queue:
            self._longest[state] = ends.get(state)
        while queue:  # breadth first, so a suffix's state is complete before it is used
            state = queue.popleft()
            for char, child in self._next[state].items():
                fail = self._fail[state]
                while fail and char not in self._next[fail]:
                    fail = self._fail[fail]
                self._fail[child] = self._next[fail].get(char, 0)
                self._longest[child] = ends.get(child) or self._longest[self._fail[child]]
                queue.append(child)

    def feed(self, state: int, text: str) -> tuple[int, tuple[int, str] | None]:
        """Advance from state over text: the new state, and the stop string that ends in text
        and starts earliest (the shortest of those starting there), as (start, stop); start
        counts from the beginning of text and is negative for one that began in earlier text."""
        found = None
        for i, char in enumerate(text):
            while state and char not in self._next[state]:
                state = self._fail[state]
            state = self._next[state].get(char, 0)
            stop = self._longest[state]
            if stop is not None and (found is None or i + 1 - len(stop) < found[0]):
                found = (i + 1 - len(stop), stop)
        return state, found

    def held_back(self, state: int) -> int:
        """How many characters at the end of the text could still begin a stop string."""
        return self._depth[state]
