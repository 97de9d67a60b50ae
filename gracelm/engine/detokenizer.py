"""Incremental detokenization of one completion: text grows token by token, stop strings cut it.

Decoding token by token is wrong for byte-level tokenizers (a multi-byte character may be split across
tokens) and for tokenizers whose pieces depend on their neighbours (leading spaces). So each step decodes a
short window of recent tokens twice — without and with the new tokens — and takes the difference; while
the window ends in an incomplete character (U+FFFD) nothing is emitted and the tokens wait for the next.

Stop strings are found by one Aho–Corasick automaton per request (`StopStrings`). The frontend checks
every completion after every token, in the server's event loop. Finding the stop strings one by one, and the
longest end of the text that begins one of them (the part a stream holds back), costs about the stop
strings' total length per token — squared, for that held-back tail — and a request may have many long stop
strings and `n` completions. The automaton reads each new character once, whatever the number and length of
the stop strings: its state is the longest end of the text read so far that begins some stop string, and
reaching a state that ends one is a match.

Semantics: the first stop string to be completed, reading the text left to right; of several completed at
the same character, the longest (the one that begins first). The automaton is built once per request and
shared by its `n` completions; each completion keeps only its state (an int).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from gracelm.model.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
# Prompt tokens kept as left context, so that the first generated token decodes as it would mid-text.
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """Text of one completion, decoded with the model's `Tokenizer`.

    `stop` strings end the completion at the first one completed (even when it spans tokens) and are not
    part of the text unless `include_stop`; none is looked for in the text of the first `min_tokens`
    tokens. The `n` completions of a request share one `StopStrings`. Special tokens (`special_ids`) are
    left out with `skip_special_tokens`; kept, `spaces_between_special_tokens` sets each apart with spaces.
    `stream_delta()` never hands out text that could still turn out to begin a stop string, so a streamed
    reply never shows a stop string, nor a part of one.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int],
                 stop: StopStrings | list[str] | None = None, skip_special_tokens: bool = True, *,
                 spaces_between_special_tokens: bool = False, special_ids: frozenset[int] = frozenset(),
                 min_tokens: int = 0, include_stop: bool = False) -> None:
        self._tok = tokenizer
        self._skip_special = skip_special_tokens
        self._spaced = spaces_between_special_tokens and not skip_special_tokens and bool(special_ids)
        self._special_ids = special_ids
        self._min_tokens = min_tokens
        self._include_stop = include_stop
        self._num_tokens = 0
        self._stops_from = 0  # where the stop-string search starts: after the first `min_tokens` tokens' text
        self._ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stops = stop if isinstance(stop, StopStrings) else StopStrings(stop or [])
        self._stop_state = ROOT
        self._text = ""
        self._streamed = 0
        self.stop_string: str | None = None
        self.finished = False

    @property
    def text(self) -> str:
        return self._text

    def add_token(self, token_id: int, hidden: bool = False) -> str | None:
        """Appends one token; returns the stop string it completed, if any (the text is then final).

        A `hidden` token (the EOS or stop token that ended the request) counts but adds no text.
        """
        if self.finished:
            raise RuntimeError("add_token after the completion finished")
        if hidden:
            self.finish()
            return None
        self._ids.append(token_id)
        self._num_tokens += 1
        return self._append(self._decode_window(final=False))

    def finish(self) -> None:
        """Ends the completion: any bytes still waiting to complete a character are emitted as they are."""
        if self.finished:
            return
        if self._read_offset < len(self._ids):
            self._append(self._decode_window(final=True))
        self.finished = True

    def stream_delta(self) -> str:
        """The text produced since the last call that can no longer change."""
        end = len(self._text) if self.finished else len(self._text) - self._stops.depth(self._stop_state)
        if end <= self._streamed:
            return ""
        delta = self._text[self._streamed:end]
        self._streamed = end
        return delta

    def _decode_window(self, final: bool) -> str:
        before = self._decode(self._ids[self._prefix_offset:self._read_offset])
        after = self._decode(self._ids[self._prefix_offset:])
        if len(after) <= len(before) or (after.endswith(_REPLACEMENT) and not final):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return after[len(before):]

    def _decode(self, ids: list[int]) -> str:
        if not self._spaced:
            return self._tok.decode(ids, skip_special_tokens=self._skip_special)
        # Runs of ordinary tokens decoded together, each special token alone, joined by spaces.
        parts: list[str] = []
        run: list[int] = []
        for token_id in ids:
            if token_id in self._special_ids:
                if run:
                    parts.append(self._tok.decode(run, skip_special_tokens=False))
                    run = []
                parts.append(self._tok.decode([token_id], skip_special_tokens=False))
            else:
                run.append(token_id)
        if run:
            parts.append(self._tok.decode(run, skip_special_tokens=False))
        return " ".join(parts)

    def _append(self, new_text: str) -> str | None:
        if not new_text:
            return None
        start = len(self._text)
        self._text += new_text
        if self._num_tokens <= self._min_tokens:  # held off: the search starts after this text
            self._stops_from = len(self._text)
            return None
        if not self._stops:
            return None
        start = max(start, self._stops_from)
        self._stop_state, match = self._stops.advance(self._stop_state, self._text, start)
        if match is None:
            return None
        self._text = self._text[:match.start + (len(match.stop) if self._include_stop else 0)]
        self.stop_string = match.stop
        self.finished = True
        return match.stop


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
