"""A request's stop strings as one Aho–Corasick automaton, read incrementally as a completion's text grows.

Why an automaton: the frontend checks every completion after every token, in the server's event loop. Finding
the stop strings one by one, and the longest end of the text that begins one of them (the part a stream
holds back), costs about the stop strings' total length per token — squared, for that held-back tail — and
a request may have many long stop strings and `n` completions. The automaton reads each new character once,
whatever the number and length of the stop strings: its state is the longest end of the text read so far
that begins some stop string, and reaching a state that ends one is a match.

Semantics: the first stop string to be completed, reading the text left to right; of several completed at
the same character, the longest (the one that begins first). The automaton is built once per request and
shared by its `n` completions; each completion keeps only its state (an int).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

ROOT = 0


@dataclass(frozen=True)
class StopMatch:
    start: int  # where the stop string begins in the text
    stop: str


class StopStrings:
    """The automaton of a list of non-empty stop strings; `advance` reads text from a state."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = list(dict.fromkeys(s for s in stops if s))
        self._goto: list[dict[str, int]] = [{}]
        self._depth = [0]
        self._ends: list[int] = [-1]  # index of the longest stop string ending at this state, or -1
        for index, stop in enumerate(self.stops):
            self._insert(index, stop)
        self._fail = [ROOT] * len(self._goto)
        self._link_failures()

    def __bool__(self) -> bool:
        return bool(self.stops)

    def depth(self, state: int) -> int:
        """How many characters of the text's end begin some stop string, in `state`."""
        return self._depth[state]

    def advance(self, state: int, text: str, start: int) -> tuple[int, StopMatch | None]:
        """Reads `text[start:]` from `state`; returns the state after it, or, at the first stop string
        completed, that state and the match (the rest of the text is not read)."""
        goto, fail, ends = self._goto, self._fail, self._ends
        for position in range(start, len(text)):
            char = text[position]
            while state and char not in goto[state]:
                state = fail[state]
            state = goto[state].get(char, ROOT)
            if ends[state] >= 0:
                stop = self.stops[ends[state]]
                return state, StopMatch(position + 1 - len(stop), stop)
        return state, None

    def _insert(self, index: int, stop: str) -> None:
        state = ROOT
        for char in stop:
            following = self._goto[state].get(char)
            if following is None:
                following = self._goto[state][char] = len(self._goto)
                self._goto.append({})
                self._depth.append(self._depth[state] + 1)
                self._ends.append(-1)
            state = following
        self._ends[state] = index  # the deepest state of its path: no longer stop string ends here

    def _link_failures(self) -> None:
        """Breadth first: each state's failure is the longest proper end of its text that is a state; a state
        that ends no stop string itself ends the longest one its failure ends."""
        queue = deque(self._goto[ROOT].values())
        while queue:
            state = queue.popleft()
            for char, following in self._goto[state].items():
                fallback = self._fail[state]
                while fallback and char not in self._goto[fallback]:
                    fallback = self._fail[fallback]
                self._fail[following] = self._goto[fallback].get(char, ROOT)
                if self._ends[following] < 0:
                    self._ends[following] = self._ends[self._fail[following]]
                queue.append(following)
