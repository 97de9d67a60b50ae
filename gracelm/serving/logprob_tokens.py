"""How tokens are named in answers' logprobs, and vLLM's `prompt_logprobs`: the request fields that ask for
them and the shape they are answered in.

`return_tokens_as_token_ids` (vLLM's) names each token of the logprobs "token_id:N", so that a client can
tell tokens apart whose text is the same or not valid UTF-8 on its own. `prompt_logprobs: N` returns, for
each prompt token after the first, its logprob and rank and the N most likely tokens at its place; it is
refused on a stream, as vLLM refuses it. Prompt logprobs are computed in prefill, which then skips the prefix
cache (cached blocks have no logits).
"""

from __future__ import annotations

import msgspec

from gracelm.engine.outputs import Logprob
from gracelm.model.tokenizer import Tokenizer
from gracelm.sampling_params import SamplingParams
from gracelm.serving.api_errors import APIError
from gracelm.serving.openai_protocol import PromptLogprob, PromptLogprobs


def token_label(tokenizer: Tokenizer, token_id: int, logprob: Logprob | None, as_ids: bool) -> str:
    """The name of a token in logprobs: "token_id:N" if asked, else its own text."""
    if as_ids:
        return f"token_id:{token_id}"
    if logprob is not None and logprob.decoded_token is not None:
        return logprob.decoded_token
    return tokenizer.decode([token_id])


def with_prompt_logprobs(params: SamplingParams, stream: bool, *counts: int | None) -> SamplingParams:
    """`params` asking for the prompt logprobs of the largest of `counts` (the top-N the answer shows at
    each prompt token), or as they are when none is set; `counts[0]` is the `prompt_logprobs` field."""
    asked = [c for c in counts if c is not None]
    if not asked:
        return params
    if stream and counts[0] is not None:
        raise APIError(400, "prompt_logprobs is not supported with stream: true (as in vLLM); ask without "
                            "streaming", param="prompt_logprobs", code="unsupported_parameter")
    return msgspec.structs.replace(params, prompt_logprobs=max(asked))


def vllm_prompt_logprobs(prompt_token_ids: list[int], entries: list[dict[int, Logprob] | None] | None,
                         num_top: int | None) -> PromptLogprobs | None:
    """vLLM's `prompt_logprobs` answer: per prompt token (None for the first), itself and the `num_top`
    most likely tokens at its place, by token id."""
    if entries is None or num_top is None:
        return None
    return [None if entry is None else
            {t: PromptLogprob(logprob=lp.logprob, rank=lp.rank, decoded_token=lp.decoded_token)
             for t, lp in entry.items() if t == token_id or (lp.rank is not None and lp.rank <= num_top)}
            for token_id, entry in zip(prompt_token_ids, entries, strict=True)]
