"""Deterministic mode (`Engine(deterministic=True)`): a request's tokens, and their logprobs to the bit, do
not depend on what else is in its batches — batch size, arrival order, chunked prefill, prefix-cache hits,
preemption — greedy and seeded alike, in bfloat16 and float32, on a tiny model and on the default one.

Also here: the kernel findings the mode rests on (`gracelm/model/batch_invariant.py`), each checked with the
mode and, where the default computation is known to differ, without it; and that the mode still computes
the model (transformers' logits, float32).
"""

from __future__ import annotations

import random

import openai
import pytest
import torch
import torch.nn.functional as F

from gracelm import Engine, SamplingParams
from gracelm.model.attention import score_matmul
from gracelm.model.batch_invariant import make_batch_invariant
from gracelm.model.llama import FrozenLinear
from gracelm.model.loader import load_model
from tests.process_checks import assert_nothing_left
from tests.server_process import ServerProcess
from tests.test_model_parity import ATOL, PagedRunner, random_tokens, reference_logits
from tests.tiny_models import tiny_model

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
# (in, out) of every linear of the default model (SmolLM2-135M): q/k/v, gate/up, down, o, logits.
DEFAULT_MODEL_SHAPES = [(576, 960), (576, 3072), (1536, 576), (576, 576), (576, 49152)]


def _rows_three_ways(fn, x: torch.Tensor, chunk_sizes: tuple[int, ...]) -> list[torch.Tensor]:
    """fn over all of x at once, row by row, and in consecutive chunks of the given sizes, cycled."""
    chunks, start, index = [], 0, 0
    while start < x.shape[0]:
        size = chunk_sizes[index % len(chunk_sizes)]
        chunks.append(fn(x[start:start + size]))
        start, index = start + size, index + 1
    return [fn(x), torch.cat([fn(x[i:i + 1]) for i in range(x.shape[0])]), torch.cat(chunks)]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape", DEFAULT_MODEL_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_a_frozen_linear_gives_a_row_the_same_bits_whatever_its_batch(dtype: str, shape: tuple[int, int]):
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(shape[1], shape[0], generator=generator) * 0.05).to(DTYPES[dtype])
    linear = FrozenLinear([weight])
    make_batch_invariant(linear)
    x = torch.randn(70, shape[0], generator=generator).to(DTYPES[dtype])
    whole, alone, chunked = _rows_three_ways(linear, x, (3, 33, 2, 32))  # 33: past one tile
    assert torch.equal(whole, alone) and torch.equal(whole, chunked)


def test_without_the_mode_a_row_depends_on_its_batch():
    """The findings the linears' tiling answers: MKL's float32 kernel for one row is not the one for two,
    and oneDNN's bfloat16 kernel, for some of the default model's shapes, changes with the count of rows
    (on a Zen 4 CPU past 32 rows for the logits head; on a Zen 5 one from 2 rows for the down projection).
    The second finding is oneDNN's: a CPU without native bfloat16 (AVX2) emulates it outside oneDNN, whose
    rows were found invariant, so there only the first is asserted."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 576, generator=generator)
    weight = torch.randn(960, 576, generator=generator) * 0.05
    assert not torch.equal(F.linear(x[:1], weight), F.linear(x[:2], weight)[:1])
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return

    def depends_on_its_batch(shape: tuple[int, int]) -> bool:
        linear = FrozenLinear([(torch.randn(shape[1], shape[0], generator=generator) * 0.05).bfloat16()])
        rows = (torch.randn(64, shape[0], generator=generator) * 20).bfloat16()
        return not torch.equal(linear(rows), torch.cat([linear(rows[i:i + 1]) for i in range(64)]))

    assert any(depends_on_its_batch(shape) for shape in DEFAULT_MODEL_SHAPES)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_the_score_matmul_gives_a_row_the_same_bits_whatever_the_rows_and_keys_beside_it(dtype: str):
    """Attention's one matmul (`attention.score_matmul`): [rows, 64] x [64, keys], from 3 rows on
    (`attention._MIN_SCORE_ROWS`)."""
    generator = torch.Generator().manual_seed(0)
    queries = torch.randn(3, 192, 64, generator=generator).to(DTYPES[dtype])
    keys = torch.randn(3, 700, 64, generator=generator).to(DTYPES[dtype])
    reference = score_matmul(queries[:, :3], keys[:, :16], batch_invariant=True)
    for rows in (3, 4, 17, 192):
        for length in (16, 17, 160, 700):
            scores = score_matmul(queries[:, :rows], keys[:, :length], batch_invariant=True)
            assert torch.equal(scores[:, :3, :16], reference), (rows, length)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_a_position_gets_the_same_logits_decoded_prefilled_or_in_any_chunk(dtype: str):
    """The whole forward, tiny model: a prompt's positions computed in one prefill, token by token (as decode
    rows), and in chunks beside other sequences' chunks and decodes give the same logits, bit for bit.
    Without the mode (float32, where the kernels differ most) they do not."""
    prompt = random_tokens(41, seed=1)
    results = {}
    for mode in ("deterministic", "default"):
        model = load_model(tiny_model("qwen2"), dtype=dtype).model  # qwen2: biases in q/k/v
        model.freeze()
        if mode == "deterministic":
            make_batch_invariant(model)
        whole = torch.cat(PagedRunner(model, dtype=DTYPES[dtype]).step([(0, prompt)]))
        runner = PagedRunner(model, seed=1, dtype=DTYPES[dtype])
        decoded = torch.cat([runner.step([(0, [token])])[0] for token in prompt])
        runner = PagedRunner(model, seed=2, dtype=DTYPES[dtype])
        others = {seq: random_tokens(n, seed=seq) for seq, n in ((1, 30), (2, 5), (3, 70))}
        runner.step([(seq, tokens[:-1]) for seq, tokens in others.items()])
        chunked, start = [], 0
        for size in (7, 1, 13, 20):
            # Beside a long prefill chunk, a decode and a short chunk of other sequences.
            logits = runner.step([(1, others[1][-1:]), (0, prompt[start:start + size]),
                                  (3, random_tokens(3, size)), (2, [size])])
            chunked.append(logits[1])
            start += size
        results[mode] = (whole, decoded, torch.cat(chunked))
    whole, decoded, chunked = results["deterministic"]
    assert torch.equal(whole, decoded) and torch.equal(whole, chunked)
    if dtype == "float32":
        whole, decoded, chunked = results["default"]
        assert not (torch.equal(whole, decoded) and torch.equal(whole, chunked))


def test_the_mode_still_computes_the_model():
    """float32 logits within the parity tests' tolerance of transformers', through chunks and decodes."""
    from transformers import AutoModelForCausalLM

    directory = tiny_model("llama")
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                     attn_implementation="eager").eval()
    model = load_model(directory, dtype="float32").model
    model.freeze()
    make_batch_invariant(model)
    prompt, other = random_tokens(90, seed=5), random_tokens(9, seed=6)
    runner = PagedRunner(model, seed=4)
    got = [runner.step([(0, prompt[:70]), (1, other)])[0]]  # 70 rows: two tiles of a prefill chunk
    got += runner.step([(0, prompt[70:71])])
    got += runner.step([(1, [3]), (0, prompt[71:])])[1:]
    torch.testing.assert_close(torch.cat(got), reference_logits(reference, prompt), atol=ATOL, rtol=0)


# Engine level: every request run alone is the reference.

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
SEEDED = [SamplingParams(temperature=0.9, top_p=0.8, seed=11, max_tokens=10, ignore_eos=True, logprobs=0),
          SamplingParams(temperature=1.2, top_k=40, seed=12, max_tokens=10, ignore_eos=True, logprobs=0),
          SamplingParams(temperature=0.7, top_k=300, min_p=0.05, seed=13, max_tokens=10, ignore_eos=True,
                         logprobs=0)]


def _mixed_prompts(count: int) -> list[list[int]]:
    """Lengths 3 to 150 in no order; a third of them share a 40-token prefix, a few share 20 more."""
    rng = random.Random(7)
    shared = [rng.randrange(3, 500) for _ in range(60)]
    prompts = []
    for i in range(count):
        own = [rng.randrange(3, 500) for _ in range(3 + (i * 37) % 148)]
        prefix = shared[:60] if i % 6 == 0 else shared[:40] if i % 3 == 0 else []
        prompts.append(prefix + own)
    return prompts


def _params(count: int) -> list[SamplingParams]:
    """Greedy and the seeded kinds in turn; each seeded request with a seed of its own."""
    kinds = [GREEDY, *SEEDED]
    params = []
    for i in range(count):
        kind = kinds[i % len(kinds)]
        params.append(kind if kind.seed is None else SamplingParams(**{
            **{name: getattr(kind, name) for name in kind.__struct_fields__}, "seed": kind.seed + i}))
    return params


def _results(outputs) -> list[tuple[list[int], list[dict[int, float]]]]:
    """Each request's tokens and, per token, the logprobs the engine returned (exact floats)."""
    return [(list(completion.token_ids),
             [{token: entry.logprob for token, entry in at.items()} for at in completion.logprobs])
            for completion in (out.outputs[0] for out in outputs)]


def _generate(llm: Engine, prompts, params, order: list[int]):
    """The requests `order` lists, sent in that order as one batch; results in the prompts' order."""
    outputs = llm.generate([prompts[i] for i in order], [params[i] for i in order], use_tqdm=False)
    by_index = dict(zip(order, _results(outputs), strict=True))
    return [by_index[i] for i in sorted(order)]


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_a_request_gets_the_same_tokens_and_logprobs_in_any_batch(dtype: str):
    model = str(tiny_model("llama"))
    prompts, params = _mixed_prompts(32), _params(32)
    base = {"dtype": dtype, "deterministic": True, "max_model_len": 256, "num_threads": 1}
    with Engine(model, **base) as llm:
        alone = [_generate(llm, prompts, params, [i])[0] for i in range(32)]
        rng = random.Random(3)
        for size in (2, 8, 32):
            for first in range(0, 32, size):
                order = list(range(first, first + size))
                rng.shuffle(order)  # arrival order
                assert _generate(llm, prompts, params, order) == alone[first:first + size], (size, order)
    # Small steps: every prompt chunked, chunks of several requests in a step beside decodes; a KV cache so
    # small that requests are preempted and recomputed (their generated tokens then prefilled).
    for options in ({"max_num_batched_tokens": 24}, {"kv_cache_memory": 40 * _block_bytes(dtype)}):
        with Engine(model, **base, **options) as llm:
            assert _generate(llm, prompts, params, list(range(31, -1, -1))) == alone, options
            if "kv_cache_memory" in options:
                assert llm.stats()["num_preemptions"] > 0
    assert_nothing_left()


def _block_bytes(dtype: str) -> int:
    """One block of the tiny model's cache: 2 layers x (K, V) x 16 tokens x 2 KV heads x 16 dims."""
    return 2 * 2 * 16 * 2 * 16 * torch.empty((), dtype=DTYPES[dtype]).element_size()


def test_without_the_mode_batching_changes_logprobs():
    """The default mode does not have the property: batched, the same requests' logprobs differ (float32,
    whose kernels differ for every row count; on this tiny model bfloat16's rounding may hide it)."""
    model = str(tiny_model("llama"))
    prompts, params = _mixed_prompts(32), [GREEDY] * 32
    with Engine(model, dtype="float32", max_model_len=256, num_threads=1) as llm:
        alone = [_generate(llm, prompts, params, [i])[0] for i in range(32)]
        batched = _generate(llm, prompts, params, list(range(32)))
    assert batched != alone
    assert_nothing_left()


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "default"])
def test_the_default_model_gives_a_request_the_same_tokens_in_any_batch(deterministic: bool):
    """SmolLM2-135M (the default model) in bfloat16: chat prompts of different lengths, some sharing a
    system prompt, alone against batched in reverse order, with a step budget that chunks them. Without the
    mode, some request's tokens or logprobs differ where this host's default kernels depend on the batch
    (the AMX kernel serves calls of 16 rows or more, VNNI's the others); where every default kernel is
    row-invariant for these prompts (the blocks kernel without AMX), there is no difference to show."""
    system = {"role": "system", "content": "You are a careful assistant. Answer in one short sentence."}
    questions = ["Name a colour.", "What is the capital of Italy, and which river runs through it?",
                 "Say hello.", "Why is the sky blue? Explain it to a child who is five years old.",
                 "Count to three.", "What is two plus two?"]
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0),
              SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=12, ignore_eos=True,
                             logprobs=0)] * 3
    # enforce_eager: the default computation as it runs before a compiled decode step is loaded.
    with Engine(dtype="bfloat16", deterministic=deterministic, max_num_batched_tokens=40,
                enforce_eager=True) as llm:
        prompts = [llm.tokenizer.apply_chat_template([system, {"role": "user", "content": q}] if i % 2 else
                                                     [{"role": "user", "content": q}])
                   for i, q in enumerate(questions)]
        alone = [_generate(llm, prompts, params, [i])[0] for i in range(len(prompts))]
        batched = _generate(llm, prompts, params, list(range(len(prompts)))[::-1])
        linear = llm.stats()["kernel_paths"]["linear"]
    assert_nothing_left()
    if not deterministic and batched == alone:
        pytest.skip(f"this host's default kernels ({linear}) gave these prompts the same tokens in any batch")
    assert (batched == alone) == deterministic


def test_a_deterministic_server_answers_a_batch_as_it_answers_each_prompt():
    """`gracelm serve --deterministic`, through the official client: one completions request of a list of
    prompts (one batch, chunked by a small step budget) gives each prompt what a request of it alone gives,
    sampled with a seed, logprobs included."""
    prompts = _mixed_prompts(8)
    with ServerProcess(tiny_model("llama"), "--deterministic", "--dtype", "bfloat16", "--served-model-name",
                       "tiny", "--max-num-batched-tokens", "24", "--max-model-len", "256",
                       "--num-threads", "1", env={"GRACELM_API_KEY": None}) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
        fields = {"model": "tiny", "max_tokens": 8, "temperature": 0.8, "seed": 3, "logprobs": 2,
                  "extra_body": {"ignore_eos": True}}
        batch = sorted(client.completions.create(prompt=prompts, **fields).choices, key=lambda c: c.index)
        alone = [client.completions.create(prompt=prompt, **fields).choices[0] for prompt in prompts]

    def answers(choices):
        return [(c.text, c.logprobs.token_logprobs, c.logprobs.top_logprobs) for c in choices]

    assert answers(batch) == answers(alone)


@pytest.mark.timeout(300)
def test_three_tensor_parallel_ranks_keep_the_property():
    """With three ranks the row-parallel linears' partial sums are gathered and added in rank order (gloo's
    ring all-reduce adds them in an order that follows the tensor's size)."""
    model = str(tiny_model("llama", hidden_size=96, num_attention_heads=6, num_key_value_heads=3,
                           intermediate_size=192))
    prompts, params = _mixed_prompts(12), _params(12)
    with Engine(model, dtype="bfloat16", deterministic=True, tensor_parallel_size=3, max_model_len=256,
                max_num_batched_tokens=24, kv_cache_memory="4MiB", num_threads=1) as llm:
        alone = [_generate(llm, prompts, params, [i])[0] for i in range(12)]
        assert _generate(llm, prompts, params, list(range(11, -1, -1))) == alone
    assert_nothing_left()
