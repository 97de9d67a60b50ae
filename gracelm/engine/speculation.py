"""Speculative decoding's scheduling side: which decoding sequences draft this step, how many tokens, and
what came of it.

The drafts: n-grams looked up in the sequence itself (`ngram_proposer.py`), or a draft model's tokens, which
the worker writes at the start of the step into the rows reserved here (`parallel/draft_model.py`).

A sequence that drafts is scheduled its last token and k draft tokens in one step; the forward pass scores
the k + 1 positions and the sampler takes them in order, keeping drafts while each equals the token the
target model samples there (`parallel/spec_verify.py`). So a step yields 1 to k + 1 tokens, distributed as
plain decoding would give them, and the rejected positions' KV entries are never counted as computed
(`Scheduler.update_from_output` frees their blocks).

When it pays. Verifying k drafts costs k more rows in the step's forward pass. At few sequences a step is
bound by reading the weights, which the rows share; in a larger batch the CPU is busy already and wasted rows
slow every sequence. A step of B sequences costs about what B + `_STEP_ROWS` rows would at the margin, so a
draft token kept saves a token's share of the step, (B + `_STEP_ROWS`) / B rows, and one rejected costs a
row: drafting pays while the share of its draft tokens a sequence keeps is above B / (B + `_STEP_ROWS`). So:
- no sequence drafts in a step while more than `max_batch` requests run;
- a sequence drafts only while the share of draft tokens it kept lately (halved in weight at each
  verification) is above that bound for the requests running now: above 0.2 alone, 0.67 beside 7 others;
- each sequence drafts as many tokens as its last verification suggests: twice the last draft after one
  kept whole, one more than the tokens kept after one kept in part (at most `num_tokens`, and half of it
  at first); the rows a sequence wastes follow how far its answer copies;
- a sequence whose draft was wholly rejected sits out its next drafts, twice as many after each such miss
  in a row (up to `_MAX_BACKOFF` steps), and drafts again at once after a draft with a token accepted: the
  answer stopped or started copying its input.

The statistics (`stats`) are cumulative, as vLLM reports them: drafts (one per sequence and step that
drafted), draft tokens, accepted tokens, and accepted tokens by draft position.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gracelm.arith import cdiv
from gracelm.engine.ngram_proposer import NgramProposer
from gracelm.engine.request import Request

# The most steps a sequence sits out after drafts wholly rejected in a row.
_MAX_BACKOFF = 16
# A step's cost beside its rows, in rows (see the module's docstring): set so that open-ended answers at 8
# sequences, which keep about 60 % of their drafts, do not draft (bench/RESULTS.md, "Speculative decoding").
_STEP_ROWS = 4
# What the scheduler reserves a draft model's draft rows with: the worker writes the drafts in their place.
DRAFT_PLACEHOLDER = 0


@dataclass
class SpeculationConfig:
    method: str  # "ngram" or "draft"
    num_tokens: int  # k: draft tokens per sequence and step at most
    lookup_min: int
    lookup_max: int
    max_batch: int  # no drafting while more requests than this run


@dataclass
class _History:
    """What a sequence's verifications so far say of its next draft."""

    length: int  # of its next draft, at most
    kept: float = 1.0  # the share of draft tokens it kept lately: each verification's share weighs half
    misses: int = 0  # drafts wholly rejected in a row
    skip: int = 0  # steps left to sit out


@dataclass
class Speculation:
    config: SpeculationConfig
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    _history: dict[str, _History] = field(default_factory=dict)
    _proposer: NgramProposer = field(init=False)

    def __post_init__(self) -> None:
        self._proposer = NgramProposer(self.config.lookup_min, self.config.lookup_max)
        self.accepted_per_position = [0] * self.config.num_tokens

    def applies(self, num_running: int) -> bool:
        """Whether sequences may draft in a step while `num_running` requests run."""
        return num_running <= self.config.max_batch

    def draft(self, request: Request, limit: int, num_running: int) -> list[int]:
        """The request's draft tokens for this step, at most `limit` (the step's and the request's room),
        while `num_running` requests run."""
        history = self._history_of(request.request_id)
        if history.skip > 0:
            history.skip -= 1
            return []
        if history.kept <= num_running / (num_running + _STEP_ROWS):
            return []
        k = min(history.length, limit)
        if k <= 0:
            return []
        if self.config.method == "draft":  # the draft model fills them in (`parallel/draft_model.py`)
            return [DRAFT_PLACEHOLDER] * k
        return self._proposer.propose(request.request_id, request.all_token_ids, k)

    def record(self, request_id: str, num_drafted: int, num_accepted: int) -> None:
        """What the verification of a draft of `num_drafted` tokens kept."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1
        history = self._history_of(request_id)
        history.kept = (history.kept + num_accepted / num_drafted) / 2
        if num_accepted == num_drafted:
            history.length = min(self.config.num_tokens, 2 * num_drafted)
        elif num_accepted:
            history.length = num_accepted + 1
        if num_accepted:
            history.misses = 0
            return
        history.misses += 1
        history.skip = min(2 ** (history.misses - 1), _MAX_BACKOFF)

    def forget(self, request_id: str) -> None:
        """A finished request's state goes."""
        self._proposer.forget(request_id)
        self._history.pop(request_id, None)

    def num_tracked(self) -> int:
        """Requests whose state is held (none once every request has finished)."""
        return len(self._proposer) + len(self._history)

    def _history_of(self, request_id: str) -> _History:
        history = self._history.get(request_id)
        if history is None:
            history = self._history[request_id] = _History(length=cdiv(self.config.num_tokens, 2))
        return history

    def stats(self) -> dict:
        return {"method": self.config.method, "num_drafts": self.num_drafts,
                "num_draft_tokens": self.num_draft_tokens, "num_accepted_tokens": self.num_accepted_tokens,
                "accepted_per_position": list(self.accepted_per_position)}


OFF_STATS = {"method": "off", "num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
             "accepted_per_position": []}
