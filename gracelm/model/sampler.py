"""Picks the next token of every sequence of a batch from its logits, vectorised over the batch.

Per step: token constraints (the rows' allowed-token masks, then their additive biases), then penalties
(repetition, then presence / frequency), then temperature, then the top-k, top-p and
min-p filters, then one draw per row. Greedy rows (temperature 0) take the argmax of the penalised logits.

Filters. Top-k keeps the k most probable tokens; top-p keeps, of those, the fewest most probable whose
mass reaches `top_p` of the mass top-k kept; min-p keeps the tokens at least `min_p` times as probable as
the most probable one (which no filter removes, so min-p's place in the order does not matter).

Cost. Rows are grouped by how they sample. A row with top-k or top-p only ever needs its most probable
tokens: it reads a sorted prefix of them (`topk`), widened only when the nucleus outgrows it, and draws from
that prefix; a peaked distribution never pays for a sort of the vocabulary. The other random rows draw from
the softmax over the whole vocabulary.

Draws. A row samples by inverting its cumulative distribution with one uniform number per step. A seeded
row draws it from its own `torch.Generator`, so its tokens depend only on its seed and its logits, whatever
else is in the batch; unseeded rows share one vectorised draw from the default generator. (The exponential
race, `argmax(probs / Exp(1))`, needs a vocabulary's worth of random numbers per row and step, which costs
several times a whole sampling step: bench/RESULTS.md, "Structured outputs and sampling".)

Device. The sampler runs where the logits are. The metadata is built on the CPU (from Python lists) and
copied to the logits' device once per step (`SamplingMetadata.to`); the uniform numbers are drawn on the CPU
from the CPU generators, so a seed gives the same draws on every device; the results come back to the CPU,
where the engine reads them.

Logprobs are those of the model's raw distribution: `log_softmax` of the logits before penalties,
temperature and filters, as vLLM returns by default.

Total: for every value `SamplingParams` accepts, every row gets a valid token id. A temperature below
`GREEDY_BELOW` is greedy (as in vLLM: dividing by it would overflow float32); a repetition penalty is
clamped to what float32 can divide by; NaN and infinite logits (a request's own extreme values, or a
model's) stay in their row: NaN counts as impossible, +inf as the largest float, a row with nothing
possible takes token 0, and no draw can land past the end of its row. But a row that its constraints (with
the stop tokens `min_tokens` holds) leave no token raises: it is its request's fault, and a token outside
its constraints would break them without a word. Logprobs stay finite (JSON has no
NaN or infinity).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

from gracelm.sampling_params import GREEDY_BELOW, SamplingParams

# A top-p row first reads this many of its most probable tokens; one whose nucleus is wider reads again a
# prefix this many times wider, up to the whole vocabulary.
_PREFIX = 64
_PREFIX_GROWTH = 8
# The smallest repetition penalty applied: logits (tens) divided by it, then by GREEDY_BELOW, stay finite.
_MIN_REPETITION_PENALTY = 1e-30
_FLOAT_MAX = torch.finfo(torch.float32).max
_Moved = TypeVar("_Moved")


def make_generator(seed: int) -> torch.Generator:
    """A CPU generator for one request's (or the engine's default) random draws."""
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed)
    return generator


@dataclass
class TokenConstraints:
    """The step's token constraints (`model/token_constraints.py` builds them): which tokens the masked
    rows may not sample, and additive biases as sparse `row * vocab_size + token` updates (-inf bans a
    token). Only constrained rows are listed, so an unconstrained batch pays nothing; the mask costs one
    pass over the masked rows' logits."""

    mask_rows: torch.Tensor | None  # int64 rows that have a mask; None: every row
    disallowed: torch.Tensor | None  # [len(mask_rows) or B, V] bool; None: no row has a mask
    bias_keys: torch.Tensor | None  # int64 flat keys; a key listed twice gets both biases
    bias_values: torch.Tensor | None  # float32, per key

    def apply(self, logits: torch.Tensor) -> None:
        """Constrains `logits` [B, V] in place."""
        if self.disallowed is not None:
            if self.mask_rows is None:
                logits.masked_fill_(self.disallowed, -torch.inf)
            else:
                masked = logits.index_select(0, self.mask_rows).masked_fill_(self.disallowed, -torch.inf)
                logits.index_copy_(0, self.mask_rows, masked)
        if self.bias_keys is not None:
            logits.view(-1).index_add_(0, self.bias_keys, self.bias_values)


@dataclass
class Penalties:
    """The batch's penalties as sparse updates of the logits, flattened to `row * vocab_size + token`.

    Only (row, token) pairs a penalty touches are listed, so the cost follows the tokens seen, not B x V.
    """

    repetition_keys: torch.Tensor | None  # tokens of prompt and output of rows with repetition != 1
    repetition_factors: torch.Tensor | None  # the row's repetition penalty, per key
    output_keys: torch.Tensor | None  # distinct output tokens of rows with a presence or frequency penalty
    output_offsets: torch.Tensor | None  # presence + frequency * count, per key

    @classmethod
    def build(cls, params: list[SamplingParams], prompt_token_ids: list[list[int]],
              output_token_ids: list[list[int]], vocab_size: int) -> Penalties | None:
        repeating = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
        counting = [i for i, p in enumerate(params) if p.presence_penalty or p.frequency_penalty]
        if not repeating and not counting:
            return None
        penalties = cls(None, None, None, None)
        if repeating:
            seen = [prompt_token_ids[i] + output_token_ids[i] for i in repeating]
            penalties.repetition_keys, rows = _flat_keys(repeating, seen, vocab_size)
            factors = torch.tensor([params[i].repetition_penalty for i in repeating], dtype=torch.float32)
            penalties.repetition_factors = factors.clamp(min=_MIN_REPETITION_PENALTY)[rows]
        if counting:
            keys, _ = _flat_keys(counting, [output_token_ids[i] for i in counting], vocab_size)
            penalties.output_keys, counts = torch.unique(keys, return_counts=True)
            presence = torch.tensor([p.presence_penalty for p in params], dtype=torch.float32)
            frequency = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32)
            rows = penalties.output_keys // vocab_size
            penalties.output_offsets = presence[rows] + frequency[rows] * counts.float()
        return penalties

    def apply(self, logits: torch.Tensor) -> None:
        """Penalises `logits` [B, V] in place."""
        flat = logits.view(-1)
        if self.repetition_keys is not None:
            # A token listed twice gets the same value written twice: the gather reads before any write.
            values = flat[self.repetition_keys]
            factors = self.repetition_factors
            flat[self.repetition_keys] = torch.where(values > 0, values / factors, values * factors)
        if self.output_keys is not None:
            flat[self.output_keys] -= self.output_offsets


def _flat_keys(rows: list[int], tokens: list[list[int]],
               vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`row * vocab_size + token` for every token of every listed row, and the index in `rows` of each."""
    lengths = torch.tensor([len(t) for t in tokens], dtype=torch.int64)
    # np.fromiter reads Python ints several times faster than torch.tensor on a list.
    flat = torch.from_numpy(np.fromiter(itertools.chain.from_iterable(tokens), dtype=np.int64,
                                        count=int(lengths.sum())))
    index = torch.repeat_interleave(torch.arange(len(rows)), lengths)
    return torch.tensor(rows, dtype=torch.int64)[index] * vocab_size + flat, index


@dataclass
class SamplingGroup:
    """Random rows of a batch that sample the same way: from a sorted prefix (top-k or top-p) or from the
    whole vocabulary. Per-row tensors follow `rows`."""

    rows: torch.Tensor | None  # int64 rows of the batch; None: every row, in order
    temperature: torch.Tensor  # [n, 1]
    top_k: torch.Tensor | None  # [n] int64, vocab_size where off
    top_p: torch.Tensor | None  # [n], 1.0 where off
    min_p: torch.Tensor | None  # [n, 1], 0.0 where off
    seeded: list[tuple[int, torch.Generator]]  # (row of the group, its own generator)
    unseeded: list[int] | None  # rows of the group drawing from the default generator; None: all

    @classmethod
    def build(cls, rows: list[int], params: list[SamplingParams], generators: list[torch.Generator | None],
              num_rows: int, vocab_size: int) -> SamplingGroup:
        seeded = [(i, g) for i, g in enumerate(generators) if g is not None]
        top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        return cls(
            rows=None if len(rows) == num_rows else torch.tensor(rows, dtype=torch.int64),
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32).unsqueeze(1),
            top_k=_column(top_k, min(top_k) < vocab_size, torch.int64),
            top_p=_column([p.top_p for p in params], any(p.top_p < 1.0 for p in params)),
            min_p=_column([[p.min_p] for p in params], any(p.min_p > 0.0 for p in params)),
            seeded=seeded,
            unseeded=[i for i, g in enumerate(generators) if g is None] if seeded else None,
        )

    def candidates(self, logits: torch.Tensor) -> list[Candidates]:
        """What the group's rows draw from, given their penalised `logits` [n, V] (divided in place by the
        temperature): one entry per prefix width its rows needed."""
        _finite(logits.div_(self.temperature))
        if self.top_k is None and self.top_p is None:
            return [_whole_vocabulary(logits, self.min_p)]
        return _prefixes(logits, self.top_k, self.top_p, self.min_p)

    def sample(self, logits: torch.Tensor, default_generator: torch.Generator | None) -> torch.Tensor:
        """[n] token ids for the group's rows."""
        uniform = self._uniform(logits.shape[0], default_generator).to(logits.device)
        tokens = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
        for c in self.candidates(logits):
            drawn = _invert_cdf(c.probs, uniform if c.rows is None else uniform[c.rows])
            if c.token_ids is not None:
                drawn = c.token_ids.gather(1, drawn.unsqueeze(1)).squeeze(1)
            if c.rows is None:
                tokens = drawn
            else:
                tokens[c.rows] = drawn
        return tokens

    def _uniform(self, n: int, default_generator: torch.Generator | None) -> torch.Tensor:
        """[n] draws on the CPU, where the generators are."""
        uniform = torch.empty(n)
        if self.unseeded is None:
            uniform.uniform_(generator=default_generator)
        elif self.unseeded:
            uniform[self.unseeded] = torch.rand(len(self.unseeded), generator=default_generator)
        for row, generator in self.seeded:
            uniform[row] = torch.rand(1, generator=generator)
        return uniform


def _column(values: list, used: bool, dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
    """A per-row tensor, or None when no row of the group uses that setting."""
    return torch.tensor(values, dtype=dtype) if used else None


@dataclass
class Candidates:
    """Tokens some rows of a group may draw, with their unnormalised probabilities (0: filtered out)."""

    rows: torch.Tensor | None  # rows of the group; None: all of them
    probs: torch.Tensor  # [m, W]
    token_ids: torch.Tensor | None  # [m, W] the token of each column; None: the column is the token


def _whole_vocabulary(logits: torch.Tensor, min_p: torch.Tensor | None) -> Candidates:
    probs = torch.softmax(logits, dim=-1)
    if min_p is not None:
        probs = torch.where(probs >= min_p * probs.amax(dim=-1, keepdim=True), probs, 0.0)
    return Candidates(None, probs, None)


def _prefixes(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
              min_p: torch.Tensor | None) -> list[Candidates]:
    """Each row's most probable tokens, sorted, filtered by top-k, top-p and min-p.

    A row with top-k is done with its first prefix (`_PREFIX` wide, or k). A row with top-p only is done once
    its prefix holds `top_p` of the mass, measured against the whole vocabulary's. A row's prefix widths are
    its own, never its batch mates': the normalising sum and the order of tied logits follow the width.
    """
    num_rows, vocab_size = logits.shape
    device = logits.device
    k = top_k if top_k is not None else torch.full((num_rows,), vocab_size, dtype=torch.int64, device=device)
    p = top_p if top_p is not None else torch.ones(num_rows, device=device)
    has_k = k < vocab_size
    log_total = None if bool(has_k.all()) else torch.logsumexp(logits, dim=-1, keepdim=True)
    widths = torch.where(has_k, k.clamp(min=_PREFIX), _PREFIX).clamp(max=vocab_size)
    found = []
    for width in widths.unique().tolist():
        rows = None if bool((widths == width).all()) else torch.nonzero(widths == width).squeeze(1)
        found += _prefixes_from(logits, k, p, min_p, log_total, rows, width)
    return found


def _prefixes_from(logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor, min_p: torch.Tensor | None,
                   log_total: torch.Tensor | None, rows: torch.Tensor | None, width: int) -> list[Candidates]:
    """The candidates of `rows` (None: all), reading prefixes from `width` on, widened until each is done."""
    vocab_size = logits.shape[1]
    pending = rows  # rows still to resolve; None: all
    found = []
    while True:
        selected = [_select(t, pending) for t in (logits, k, p, min_p, log_total)]
        probs, token_ids, done = _prefix(*selected, width=width, vocab_size=vocab_size)
        if bool(done.all()):
            found.append(Candidates(pending, probs, token_ids))
            return found
        local = torch.nonzero(done).squeeze(1)
        if local.numel():
            found.append(Candidates(local if pending is None else pending[local], probs[local],
                                    token_ids[local]))
        pending = torch.nonzero(~done).squeeze(1) if pending is None else pending[~done]
        width = min(vocab_size, width * _PREFIX_GROWTH)


def _select(t: torch.Tensor | None, rows: torch.Tensor | None) -> torch.Tensor | None:
    return t if t is None or rows is None else t[rows]


def _prefix(logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor, min_p: torch.Tensor | None,
            log_total: torch.Tensor | None, width: int,
            vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The filtered probabilities of each row's `width` most probable tokens, their ids, and which rows
    that prefix resolves."""
    values, token_ids = logits.topk(width, dim=-1)
    column = torch.arange(width, device=logits.device)
    has_k = k < vocab_size
    values = torch.where(column < k.unsqueeze(1), values, -torch.inf)
    log_kept = torch.logsumexp(values, dim=-1, keepdim=True)
    if log_total is not None:
        log_kept = torch.where(has_k.unsqueeze(1), log_kept, log_total)
    probs = torch.exp(values - log_kept)  # normalised over what top-k kept
    mass = probs.cumsum(dim=-1)
    nucleus = ((mass - probs) < p.unsqueeze(1)).sum(dim=-1)  # tokens whose predecessors' mass falls short
    keep = torch.where(p < 1.0, nucleus, width)
    probs = torch.where(column < keep.unsqueeze(1), probs, 0.0)
    if min_p is not None:
        probs = torch.where(probs >= min_p * probs[:, :1], probs, 0.0)
    done = has_k | (mass[:, -1] >= p) | (width == vocab_size)
    return probs, token_ids, done


def _invert_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """[m] column of each row of `probs` [m, W] (unnormalised) where its cumulative mass reaches the draw."""
    cdf = probs.nan_to_num(0.0).cumsum(dim=-1)  # NaN mass (a row with nothing possible) counts as none
    # 1 - u lies in (0, 1]: the target is above 0 and at most the total, so the search lands on a column of
    # non-zero mass (the first whose cumulative mass reaches it); the clamp covers a row of no mass at all.
    target = (1.0 - uniform).unsqueeze(1) * cdf[:, -1:]
    return torch.searchsorted(cdf, target).squeeze(1).clamp_(max=probs.shape[-1] - 1)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first largest logit (`argmax`), found in two passes where the vocabulary splits into chunks
    of a few hundred to a few thousand: the largest of each chunk (`amax`, vectorised), then the argmax inside
    the first chunk that holds the row's largest. Same result as `argmax` (ties go to the lowest id; no NaN
    is left by then); on the CPU torch's `argmax` reduces a row one value at a time, several times slower
    than this."""
    chunk = _argmax_chunk(logits.shape[-1])
    if chunk is None or logits.device.type != "cpu":
        return logits.argmax(dim=-1)
    chunks = logits.unflatten(-1, (-1, chunk))
    best = chunks.amax(dim=-1).argmax(dim=-1)
    inner = chunks[torch.arange(logits.shape[0], device=logits.device), best].argmax(dim=-1)
    return best * chunk + inner


@functools.cache
def _argmax_chunk(width: int) -> int | None:
    """A divisor of `width` between 256 and 4,096, nearest 1,024 first (49,152 = 48 x 1,024; 32,000 = 32
    x 1,000; 151,936 = 128 x 1,187); None if there is none."""
    return next((c for c in sorted(range(256, 4097), key=lambda c: abs(c - 1024)) if width % c == 0), None)


def _finite(logits: torch.Tensor) -> torch.Tensor:
    """In place: NaN becomes impossible (-inf) and +inf the largest float, row by row."""
    return logits.nan_to_num_(nan=-torch.inf, posinf=_FLOAT_MAX)


@dataclass
class SamplingMetadata:
    """Per-row sampling state of one step's batch, as tensors; `None` where no row needs the feature."""

    num_rows: int
    vocab_size: int
    all_greedy: bool
    greedy_rows: torch.Tensor | None  # int64 rows with temperature 0, when some rows are not
    groups: list[SamplingGroup]  # the random rows, by how they sample
    penalties: Penalties | None
    constraints: TokenConstraints | None  # masks and biases of the constrained rows
    num_logprobs: list[int] | None  # per row, the top-n asked (0: none, or no logprobs); None: no row asks
    default_generator: torch.Generator | None  # None: torch's global generator

    @classmethod
    def build(cls, params: list[SamplingParams], generators: list[torch.Generator | None],
              prompt_token_ids: list[list[int]], output_token_ids: list[list[int]], vocab_size: int,
              default_generator: torch.Generator | None = None,
              constraints: TokenConstraints | None = None) -> SamplingMetadata:
        """Row i samples with `params[i]`, drawing from `generators[i]` (None: the default generator);
        the token ids feed the penalties; `constraints` are the rows' masks and biases."""
        if not len(params) == len(generators) == len(prompt_token_ids) == len(output_token_ids):
            raise ValueError("SamplingMetadata.build: one entry per row is needed in every list")
        greedy = [i for i, p in enumerate(params) if p.temperature < GREEDY_BELOW]
        asked = any(p.logprobs is not None for p in params)
        return cls(
            num_rows=len(params), vocab_size=vocab_size, all_greedy=len(greedy) == len(params),
            greedy_rows=torch.tensor(greedy, dtype=torch.int64) if 0 < len(greedy) < len(params) else None,
            groups=_groups(params, generators, vocab_size),
            penalties=Penalties.build(params, prompt_token_ids, output_token_ids, vocab_size),
            constraints=constraints,
            num_logprobs=[p.logprobs or 0 for p in params] if asked else None,
            default_generator=default_generator,
        )

    def to(self, device: torch.device) -> SamplingMetadata:
        """The metadata with its tensors on `device` (itself on the CPU)."""
        return self if device.type == "cpu" else _moved(self, device)


def _moved(value: _Moved, device: torch.device) -> _Moved:
    """A copy of a sampler dataclass whose tensors, and those of the dataclasses it holds (alone or in a
    list), are on `device`; the generators stay on the CPU, where the draws are made."""
    changes = {}
    for field in dataclasses.fields(value):
        item = getattr(value, field.name)
        if isinstance(item, torch.Tensor):
            changes[field.name] = item.to(device)
        elif dataclasses.is_dataclass(item):
            changes[field.name] = _moved(item, device)
        elif isinstance(item, list) and item and dataclasses.is_dataclass(item[0]):
            changes[field.name] = [_moved(entry, device) for entry in item]
    return dataclasses.replace(value, **changes)


def _groups(params: list[SamplingParams], generators: list[torch.Generator | None],
            vocab_size: int) -> list[SamplingGroup]:
    by_prefix: dict[bool, list[int]] = {True: [], False: []}
    for i, p in enumerate(params):
        if p.temperature >= GREEDY_BELOW:
            by_prefix[0 < p.top_k < vocab_size or p.top_p < 1.0].append(i)
    return [SamplingGroup.build(rows, [params[i] for i in rows], [generators[i] for i in rows], len(params),
                                vocab_size) for rows in by_prefix.values() if rows]


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B] float32, raw logprob of the sampled token; None: no row asked
    # [B, N] int64, most likely first, N the largest top-n asked; a row's first top-n columns are its own
    top_logprob_ids: torch.Tensor | None
    top_logprobs: torch.Tensor | None  # [B, N] float32; None where N is 0 or no row asked


@torch.inference_mode()
def sample(logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
    """Samples one token per row of `logits` [B, V]; float32 contiguous logits are overwritten in place.

    Logprobs are computed for every row as soon as one row asks. Runs on the logits' device; the output is
    on the CPU.
    """
    if logits.shape != (meta.num_rows, meta.vocab_size):
        raise ValueError(f"sample: logits of shape {tuple(logits.shape)} for a batch of "
                         f"{meta.num_rows} rows over {meta.vocab_size} tokens")
    logits = logits.float().contiguous()
    meta = meta.to(logits.device)
    raw_logprobs = None
    if meta.num_logprobs is not None:
        raw_logprobs = torch.log_softmax(logits, dim=-1).nan_to_num_(nan=-_FLOAT_MAX, neginf=-_FLOAT_MAX)
    if meta.constraints is not None:
        meta.constraints.apply(logits)
        if torch.isneginf(logits).all(dim=1).any():
            raise ValueError("a request's constraints (and the stop tokens min_tokens holds) leave no token "
                             "possible")
    if meta.penalties is not None:
        meta.penalties.apply(logits)
    _finite(logits)
    if meta.all_greedy:
        token_ids = greedy(logits)
    else:
        token_ids = torch.empty(meta.num_rows, dtype=torch.int64, device=logits.device)
        if meta.greedy_rows is not None:
            token_ids[meta.greedy_rows] = greedy(logits[meta.greedy_rows])
        for group in meta.groups:
            if group.rows is None:
                token_ids = group.sample(logits, meta.default_generator)
            else:
                token_ids[group.rows] = group.sample(logits[group.rows], meta.default_generator)
    return _with_logprobs(token_ids, raw_logprobs, meta.num_logprobs)


def _with_logprobs(token_ids: torch.Tensor, raw_logprobs: torch.Tensor | None,
                   num_logprobs: list[int] | None) -> SamplerOutput:
    """The output, on the CPU."""
    if raw_logprobs is None or num_logprobs is None:
        return SamplerOutput(token_ids.cpu(), None, None, None)
    sampled = raw_logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    if not max(num_logprobs):
        return SamplerOutput(token_ids.cpu(), sampled.cpu(), None, None)
    ids, values = top_per_row(raw_logprobs, num_logprobs)
    return SamplerOutput(token_ids.cpu(), sampled.cpu(), ids.cpu(), values.cpu())


def top_per_row(logprobs: torch.Tensor, counts: list[int],
                width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The ids and values of each row's `counts[row]` largest logprobs, most likely first, as [R, width]
    tensors (default width: the largest count; a row's columns past its count are filler). Rows asking the
    same count share one `topk` of that count: ties are ordered as that count's `topk` orders them, so a row's
    answer is the same in any batch."""
    width = max(counts) if width is None else width
    if all(count == width for count in counts):
        top = logprobs.topk(width, dim=-1)
        return top.indices, top.values
    ids = torch.zeros(len(counts), width, dtype=torch.int64, device=logprobs.device)
    values = torch.full((len(counts), width), -_FLOAT_MAX, device=logprobs.device)
    for count in set(counts) - {0}:
        rows = torch.tensor([row for row, c in enumerate(counts) if c == count], device=logprobs.device)
        top = logprobs.index_select(0, rows).topk(count, dim=-1)
        ids[rows, :count], values[rows, :count] = top.indices, top.values
    return ids, values
