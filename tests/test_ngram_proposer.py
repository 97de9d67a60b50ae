"""`NgramProposer`: prompt-lookup drafts, checked case by case and against a brute-force scan."""

from __future__ import annotations

import random

import pytest

from gracelm.engine.ngram_proposer import NgramProposer


def reference(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The rule spelled out: longest n first, then the latest earlier occurrence, scanning the whole list."""
    length = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n > length:
            continue
        suffix = tokens[length - n :]
        for start in range(length - n - 1, -1, -1):  # length - n would be the suffix itself
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def propose_once(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    return NgramProposer(min_n, max_n).propose("r", tokens, k)


def test_longest_n_is_preferred_over_shorter():
    # The 1-gram [3] last occurred at index 5 (then 8); the 2-gram [2, 3] only at index 1 (then 4).
    tokens = [1, 2, 3, 4, 9, 3, 8, 2, 3]
    assert propose_once(tokens, 1, 2, 1) == [4]
    assert propose_once(tokens, 1, 1, 1) == [8]


def test_most_recent_occurrence_is_chosen():
    tokens = [5, 6, 1, 7, 7, 5, 6, 2, 7, 5, 6]
    assert propose_once(tokens, 2, 2, 2) == [2, 7]


def test_suffix_itself_is_not_a_match():
    assert propose_once([1, 2, 3], 1, 3, 3) == []
    assert propose_once([4], 1, 1, 2) == []


def test_overlapping_earlier_occurrence_counts():
    assert propose_once([7, 7, 7], 2, 2, 3) == [7]


def test_continuation_is_clipped_at_the_end():
    tokens = [1, 2, 3, 4, 1, 2]
    assert propose_once(tokens, 2, 2, 5) == [3, 4, 1, 2]


def test_k_zero_gives_nothing_but_still_indexes():
    proposer = NgramProposer(1, 2)
    tokens = [1, 2, 1]
    assert proposer.propose("r", tokens, 0) == []
    with pytest.raises(ValueError, match="'r'"):  # the k == 0 call took in all three tokens
        proposer.propose("r", tokens[:2], 0)
    tokens.append(2)
    assert proposer.propose("r", tokens, 2) == [1, 2]


def test_no_match_gives_empty_list():
    assert propose_once([1, 2, 3, 4, 5], 1, 3, 4) == []
    assert propose_once([], 1, 3, 4) == []


def test_negative_k_raises():
    with pytest.raises(ValueError, match="k"):
        propose_once([1, 1], 1, 1, -1)


def test_incremental_use_matches_brute_force():
    rng = random.Random(1234)
    for case in range(200):
        min_n = rng.randint(1, 3)
        max_n = rng.randint(min_n, 4)
        alphabet = rng.randint(2, 5)
        proposer = NgramProposer(min_n, max_n)
        tokens: list[int] = []
        for _ in range(rng.randint(0, 60)):
            tokens.append(rng.randrange(alphabet))
            k = rng.randint(0, 5)
            expected = reference(tokens, min_n, max_n, k)
            assert proposer.propose("r", tokens, k) == expected, (case, tokens, min_n, max_n, k)
        assert proposer.propose("r", tokens, 3) == propose_once(tokens, min_n, max_n, 3)


def test_several_tokens_appended_between_calls():
    rng = random.Random(99)
    for _ in range(50):
        proposer = NgramProposer(1, 3)
        tokens: list[int] = []
        for _ in range(10):
            tokens.extend(rng.randrange(3) for _ in range(rng.randint(0, 6)))
            assert proposer.propose("r", tokens, 4) == reference(tokens, 1, 3, 4)


def test_requests_are_indexed_separately():
    proposer = NgramProposer(1, 1)
    a = [1, 2, 1]
    b = [1, 3, 1]
    assert proposer.propose("a", a, 1) == [2]
    assert proposer.propose("b", b, 1) == [3]
    assert len(proposer) == 2


def test_token_ids_are_not_mutated():
    tokens = [1, 2, 1, 2]
    NgramProposer(1, 2).propose("r", tokens, 3)
    assert tokens == [1, 2, 1, 2]


def test_forget_frees_the_index():
    proposer = NgramProposer(1, 2)
    proposer.propose("a", [1, 2, 1], 1)
    proposer.propose("b", [3, 3], 1)
    assert len(proposer) == 2
    proposer.forget("a")
    assert len(proposer) == 1
    proposer.forget("a")  # unknown now: no error
    proposer.forget("never-seen")
    proposer.forget("b")
    assert len(proposer) == 0
    # A forgotten id starts afresh, so a shorter sequence is fine.
    assert proposer.propose("a", [4, 4], 1) == [4]


@pytest.mark.parametrize(("min_n", "max_n"), [(0, 2), (3, 2), (-1, 1), (0, 0)])
def test_bad_n_bounds_raise(min_n: int, max_n: int):
    with pytest.raises(ValueError, match=rf"min_n={min_n}, max_n={max_n}"):
        NgramProposer(min_n, max_n)


def test_shorter_token_ids_raises_naming_the_request():
    proposer = NgramProposer(1, 2)
    proposer.propose("req-7", [1, 2, 3], 1)
    proposer.propose("req-7", [1, 2, 3], 1)  # the same length again is fine
    with pytest.raises(ValueError, match="req-7"):
        proposer.propose("req-7", [1, 2], 1)
