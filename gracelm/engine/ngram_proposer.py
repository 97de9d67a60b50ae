"""`NgramProposer`: draft tokens for speculative decoding by prompt lookup ("n-gram" speculation).

Text often repeats itself (code, quoted passages, lists, JSON keys), so the tokens that followed an
earlier occurrence of the sequence's last n tokens are a cheap guess at what comes next; the target model
then verifies the guess in one forward pass. This is the `"method": "ngram"` speculation of vLLM and the
lookup decoding of llama.cpp, with no draft model.

The rule: for n from `max_n` down to `min_n` (longest first, since a longer shared context predicts
better), find an earlier occurrence of the last n tokens and propose up to k tokens that followed it. An
earlier occurrence may overlap the suffix but may not be the suffix itself. Of several earlier
occurrences the most recent one (closest to the end) is taken: recent text is the likeliest to be
repeated next (the current line, the current list item), and keeping only the latest position per n-gram
lets the index overwrite in place instead of growing a list per n-gram. The continuation stops at the
end of the sequence, so fewer than k tokens may come back; none when nothing matches.

It runs every engine step for every decoding request, so each request has an index that is only
extended: a dict from n-gram (a tuple of token ids, its length telling the n apart) to the end of its
latest occurrence. When the sequence has length L the index holds the n-grams ending at 1..L-1 but not
the one ending at L, which is the suffix itself; a call adds the n-grams ending at the positions appended
since the previous call, one dict store per n for each new token, and looks up at most one key per n.
"""

from __future__ import annotations

from collections.abc import Sequence


class _RequestIndex:
    """One request's n-grams: `ends[ngram]` is the end (exclusive) of its latest indexed occurrence."""

    __slots__ = ("length", "ends")

    def __init__(self) -> None:
        self.length = 0  # the sequence length at the last call; n-grams ending before it are indexed
        self.ends: dict[tuple[int, ...], int] = {}


class NgramProposer:
    """Proposes draft tokens by prompt lookup, keeping an incremental index per request."""

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self._indexes: dict[str, _RequestIndex] = {}

    def __len__(self) -> int:
        return len(self._indexes)

    def forget(self, request_id: str) -> None:
        """Drops a finished request's index; an unknown id is not an error."""
        self._indexes.pop(request_id, None)

    def propose(self, request_id: str, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to k draft tokens to follow `token_ids`, the whole sequence (prompt + output) of that request.

        `token_ids` is read, never changed; it must be at least as long as at the request's previous call.
        """
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        index = self._indexes.get(request_id)
        if index is None:
            index = self._indexes[request_id] = _RequestIndex()
        self._extend(request_id, index, token_ids)
        if k == 0:
            return []
        return self._lookup(index, token_ids, k)

    def _extend(self, request_id: str, index: _RequestIndex, token_ids: Sequence[int]) -> None:
        """Indexes the n-grams ending from the previous call's length up to, not at, the new length."""
        length = len(token_ids)
        if length < index.length:
            raise ValueError(
                f"request {request_id!r}: token_ids has {length} tokens, fewer than the {index.length} "
                "already indexed (sequences only grow)"
            )
        # The n-gram ending at the new length is the suffix itself, so it waits for the next call.
        for end in range(max(index.length, self.min_n), length):
            self._add_ngrams_ending_at(index.ends, token_ids, end)
        index.length = length

    def _add_ngrams_ending_at(
        self, ends: dict[tuple[int, ...], int], token_ids: Sequence[int], end: int
    ) -> None:
        # One slice for the longest n-gram; the shorter ones are its tails. Ends only grow, so a plain
        # store keeps the latest occurrence.
        window = tuple(token_ids[max(0, end - self.max_n) : end])
        for n in range(self.min_n, min(self.max_n, end) + 1):
            ends[window[len(window) - n :]] = end

    def _lookup(self, index: _RequestIndex, token_ids: Sequence[int], k: int) -> list[int]:
        length = index.length
        suffix = tuple(token_ids[max(0, length - self.max_n) : length])
        for n in range(min(self.max_n, length), self.min_n - 1, -1):
            end = index.ends.get(suffix[len(suffix) - n :])
            if end is not None:
                return list(token_ids[end : end + k])
        return []
