"""The stop-string automaton against a direct search: the same first match and the same held-back tail, on
random texts read in random pieces, over small alphabets where stop strings overlap a lot."""

from __future__ import annotations

import random

import pytest

from gracelm.engine.detokenizer import ROOT, StopStrings


def _first_match(text: str, stops: list[str]) -> tuple[int, str] | None:
    """The stop string completed first (the longest if several end at the same character)."""
    found = [(text.find(s) + len(s), -len(s), text.find(s), s) for s in stops if s in text]
    return min(found)[2:] if found else None


def _held_back(text: str, stops: list[str]) -> int:
    """The longest end of the text that begins some stop string."""
    return max((k for s in stops for k in range(1, min(len(s) - 1, len(text)) + 1) if text.endswith(s[:k])),
               default=0)


@pytest.mark.parametrize("alphabet", ["ab", "abc", "ab ☃"])
def test_matches_and_tails_agree_with_a_direct_search(alphabet):
    rng = random.Random(alphabet)
    for _ in range(1500):
        stops = ["".join(rng.choices(alphabet, k=rng.randint(1, 6))) for _ in range(rng.randint(1, 5))]
        text = "".join(rng.choices(alphabet, k=rng.randint(0, 30)))
        automaton, state, read, match = StopStrings(stops), ROOT, 0, None
        while read < len(text) and match is None:
            end = min(len(text), read + rng.randint(1, 5))  # a token's worth of new text
            state, match = automaton.advance(state, text[:end], read)
            if match is None:
                assert automaton.depth(state) == _held_back(text[:end], stops), (stops, text[:end])
            read = end
        assert (None if match is None else (match.start, match.stop)) == _first_match(text, stops), \
            (stops, text)


def test_no_stop_strings_is_falsy_and_duplicates_count_once():
    assert not StopStrings([]) and not StopStrings([""])
    assert StopStrings(["ab", "ab", "c"]).stops == ["ab", "c"]
