"""The path matrix (docs/kernel_paths.md): every kernel path this machine can run, end to end through the HTTP
server and the offline `Engine`, on a tiny 4-bit model, the paths of other CPUs by masking features.

For each path, a server serves one request decoding while others arrive (prompts below and above the
short-prompt threshold, a prefix-cache hit, a request with n=2, a structured-output request beside plain
ones), then a burst that a small KV cache must preempt; then an `Engine` runs a batch of 36 prompts of mixed
lengths in its first step, and a few that repeat themselves, speculating (prompt lookup): its verification
steps, decode steps of several rows per sequence, take the path as decode steps do. A compiled path
serves with its decode graphs loaded from the cache the suite built, and must have run steps through them.
Every greedy answer is held to the eager dense path (`--quantization none --enforce-eager --decode-attention
unfused`, the path's dtype): each generated
token's logprob equals the reference's within `LOGPROB_TOLERANCE`, and the reference ranks the token within
`GAP_TOLERANCE` of its best. Nothing of a server may be left after its stop, in TMPDIR neither.

The two traces of a crash every compiled path had (a server at the second concurrent request, an Engine at a
batch of mixed prompts) are the first two phases of each path's run. The paths a machine cannot run are
skipped with their reason; the run prints which ran.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from gracelm import Engine, SamplingParams
from gracelm.cache_dir import ENV
from tests.faults.helpers import memory_cgroup, small_filesystem
from tests.kernel_paths import PATHS, KernelPath, matrix_gguf
from tests.server_process import ServerProcess, metric_value
from tests.test_gguf import VOCAB

# Bounds of a path's greedy tokens against the eager dense path (docs/kernel_paths.md).
LOGPROB_TOLERANCE = 0.3
GAP_TOLERANCE = 0.3
# The KV cache of every run, in blocks of 16 tokens: 2 layers x (K, V) x 2 KV heads x 16 x 64 dims.
KV_BLOCKS = 32
BLOCK_BYTES = {"bfloat16": 2 * 2 * 2 * 16 * 64 * 2, "float32": 2 * 2 * 2 * 16 * 64 * 4}
GREEDY = {"temperature": 0.0, "logprobs": 1, "extra_body": {"return_tokens_as_token_ids": True,
                                                           "ignore_eos": True}}
RAN: list[str] = []
# The Engine phase speculates (n-grams), whatever its batch: its verification steps take the path too.
SPECULATING = {"speculative": "ngram", "prompt_lookup_min": 1, "speculative_max_batch": 64}


def prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(length)]


def dtype_of(path: KernelPath) -> str:
    return "float32" if {"avx512", "avx2"} & set(path.mask) else "bfloat16"


def engine_kwargs(path: KernelPath) -> dict:
    """Each rank holds its share of the KV heads: KV_BLOCKS blocks whatever the ranks."""
    ranks = path.options.get("tensor_parallel_size", 1)
    memory = KV_BLOCKS * BLOCK_BYTES[dtype_of(path)] // ranks
    return {"max_model_len": 256, "num_threads": 1, "kv_cache_memory": memory, **path.engine_options()}


@pytest.fixture(scope="module")
def references() -> Iterator[dict[str, Engine]]:
    """The eager dense path in each dtype, scoring what the paths generated."""
    engines: dict[str, Engine] = {}
    options = {"quantization": "none", "enforce_eager": True, "decode_attention": "unfused",
               "max_model_len": 256, "num_threads": 1, "enable_prefix_caching": False}
    try:
        engines["bfloat16"] = Engine(str(matrix_gguf()), **options)
        engines["float32"] = Engine(str(matrix_gguf()), mask_cpu_features=["avx512"], **options)
        yield engines
    finally:
        for engine in engines.values():
            engine.shutdown()


def assert_like_reference(reference: Engine, answers: list[tuple[list[int], list[int], list[float]]]
                          ) -> None:
    """Each (prompt, generated tokens, their logprobs) held to the reference's scores of the same tokens."""
    scored = reference.generate([p + tokens for p, tokens, _ in answers],
                                SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    for (p, tokens, logprobs), out in zip(answers, scored, strict=True):
        for i, (token, logprob) in enumerate(zip(tokens, logprobs, strict=True)):
            ranked = out.outputs[0].prompt_logprobs[len(p) + i]
            best = max(entry.logprob for entry in ranked.values())
            expected = ranked[token].logprob
            where = f"token {i} ({token}) of an answer to a prompt of {len(p)} tokens"
            assert abs(logprob - expected) <= LOGPROB_TOLERANCE, f"{where}: {logprob} vs {expected}"
            assert expected >= best - GAP_TOLERANCE, f"{where}: the reference's best {best}, this {expected}"


def completion(client: OpenAI, prompt_ids: list[int] | list[list[int]], max_tokens: int, **options) -> list:
    options = {"extra_body": {"ignore_eos": True}, **options}
    answer = client.completions.create(model="tiny", prompt=prompt_ids, max_tokens=max_tokens, **options)
    return answer.choices


def greedy_answer(client: OpenAI, prompt_ids: list[int], max_tokens: int
                  ) -> tuple[list[int], list[int], list[float]]:
    [answer] = greedy_answers(client, [prompt_ids], max_tokens)
    return answer


def greedy_answers(client: OpenAI, prompts: list[list[int]], max_tokens: int
                   ) -> list[tuple[list[int], list[int], list[float]]]:
    """One request of several prompts: the engine takes them in together, so they run at the same time
    whatever the load on the machine."""
    choices = sorted(completion(client, prompts, max_tokens, **GREEDY),
                     key=lambda choice: choice.index)
    answers = []
    for prompt_ids, choice in zip(prompts, choices, strict=True):
        tokens = [int(token.removeprefix("token_id:")) for token in choice.logprobs.tokens]
        assert len(tokens) == max_tokens and choice.finish_reason == "length"
        answers.append((prompt_ids, tokens, choice.logprobs.token_logprobs))
    return answers


def in_threads(calls: list) -> list:
    """Runs each call in a thread of its own, at once; their results in order (a call's exception raised)."""
    results: list = [None] * len(calls)

    def run(i: int) -> None:
        try:
            results[i] = calls[i]()
        except BaseException as e:  # noqa: BLE001 - raised in the test's thread below
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


def serve_the_scenario(server: ServerProcess) -> list[tuple[list[int], list[int], list]]:
    """The HTTP phase; the greedy answers, to be held to the reference."""
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    long_prompt = prompt(40, 2)
    answers: list = []
    decoding = threading.Thread(target=lambda: answers.append(greedy_answer(client, prompt(3, 1), 150)))
    decoding.start()
    wait_for_tokens(server)
    sampled, structured, short, long = in_threads([
        lambda: completion(client, prompt(12, 3), 16, n=2, temperature=0.8, seed=7, logprobs=1),
        # constrained: it may end (its grammar allows nothing after a choice)
        lambda: completion(client, prompt(9, 4), 8, temperature=0.0, extra_body={"guided_choice":
                                                                                   ["red", "green", "blue"]}),
        lambda: greedy_answer(client, prompt(8, 5), 24),  # below the short-prompt threshold
        lambda: greedy_answer(client, long_prompt, 24),  # above it
    ])
    decoding.join(120)
    assert len(answers) == 1, "the request decoding meanwhile did not finish"
    assert len(sampled) == 2 and all(len(choice.logprobs.tokens) == 16 for choice in sampled)
    assert structured[0].text in ("red", "green", "blue"), structured[0].text
    hits_before = metric_value(metrics(server), "gracelm_prefix_cache_hits_total")
    again = greedy_answer(client, long_prompt[:32] + prompt(6, 6), 12)  # its first 32 tokens cached
    assert metric_value(metrics(server), "gracelm_prefix_cache_hits_total") >= hits_before + 32
    # Six sequences of 100 tokens need 42 blocks of the 32 there are: some are preempted.
    burst = greedy_answers(client, [prompt(40, 10 + i) for i in range(6)], 60)
    assert metric_value(metrics(server), "gracelm_num_preemptions_total") > 0
    return [*answers, short, long, again, *burst]


def wait_for_tokens(server: ServerProcess) -> None:
    """Until the engine has generated a few tokens (the request decoding meanwhile has started)."""
    for _ in range(300):
        if metric_value(metrics(server), "gracelm_generation_tokens_total") >= 3:
            return
        threading.Event().wait(0.02)
    raise AssertionError("no token generated")


def metrics(server: ServerProcess) -> str:
    return httpx.get(f"{server.url}/metrics", timeout=10).text


def compiled_steps(server: ServerProcess) -> float:
    """The counter's value; 0 before its first step (a labelled counter has no sample until then)."""
    try:
        return metric_value(metrics(server), "gracelm_decode_graph_steps_total")
    except KeyError:
        return 0.0


def kernel_paths(server: ServerProcess) -> dict[str, str]:
    """Each part's path whose gauge is 1."""
    found = {}
    for line in metrics(server).splitlines():
        if line.startswith("gracelm_kernel_path{") and line.endswith(" 1.0"):
            labels = dict(part.split("=", 1) for part in line[line.index("{") + 1:line.index("}")].split(","))
            found[labels["part"].strip('"')] = labels["path"].strip('"')
    return found


def load_graphs(server: ServerProcess) -> None:
    """Steps until the core has loaded its graphs from the cache (it does between steps) and reports them."""
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    completion(client, prompt(4, 0), 2)
    assert kernel_paths(server)["decode_graph"] == "compiled", server.log()[-3000:]


@pytest.mark.parametrize("path", PATHS, ids=lambda path: path.name)
def test_a_path_serves_concurrent_mixed_work_as_the_dense_path_does(path: KernelPath, graph_cache: Path,
                                                                   references: dict[str, Engine]) -> None:
    reason = path.why_not_here()
    if reason is not None:
        pytest.skip(f"path {path.name}: {reason}")
    kwargs = engine_kwargs(path)
    args = [*path.server_args(), "--served-model-name", "tiny", "--max-model-len", "256",
            "--num-threads", "1", "--kv-cache-memory", str(kwargs["kv_cache_memory"]),
            "--stats-interval", "0"]
    with ServerProcess(matrix_gguf(), *args, env={ENV: str(graph_cache)}) as server:
        if path.compiled:
            load_graphs(server)
        steps = compiled_steps(server)
        answers = serve_the_scenario(server)
        paths = kernel_paths(server)
        if path.compiled:
            assert paths["decode_graph"] == "compiled", server.log()[-3000:]
            assert compiled_steps(server) > steps + 100
        else:
            assert compiled_steps(server) == 0
        if path.options.get("dense_weights") == "on":  # prompts of >= 16 tokens took the dense copy
            assert "/dense-" in paths["linear"], paths
    assert_like_reference(references[dtype_of(path)], answers)
    with Engine(str(matrix_gguf()), **kwargs, **SPECULATING) as llm:
        prompts = [prompt(4 + (i * 7) % 40, 100 + i) for i in range(36)]  # 4 to 43 tokens: both sides of 16
        batch = greedy_engine_answers(llm, prompts, 12)
        # Verification steps: phrases said again, so that prompt lookup drafts and some drafts are kept.
        batch += greedy_engine_answers(llm, [prompt(5 + i, 200 + i) * 3 for i in range(4)], 24)
        stats = llm.stats()
        assert stats["kernel_paths"] == paths
        assert stats["spec_decode"]["num_accepted_tokens"] > 0
    assert_like_reference(references[dtype_of(path)], batch)
    RAN.append(f"{path.name} ({', '.join(f'{part} {name}' for part, name in sorted(paths.items()))})")


def greedy_engine_answers(llm: Engine, prompts: list[list[int]], max_tokens: int
                          ) -> list[tuple[list[int], list[int], list[float]]]:
    outputs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0,
                                                   logprobs=0), use_tqdm=False)
    answers = []
    for p, out in zip(prompts, outputs, strict=True):
        tokens = out.outputs[0].token_ids
        logprobs = [at[t].logprob for t, at in zip(tokens, out.outputs[0].logprobs, strict=True)]
        answers.append((p, tokens, logprobs))
    return answers


def compiled_path_args() -> list[str]:
    """A server's options for the first compiled path this machine runs (the test is skipped where none)."""
    path = next((path for path in PATHS if path.compiled and path.why_not_here() is None), None)
    if path is None:
        pytest.skip("no compiled path runs here")
    return [*path.server_args(), "--served-model-name", "tiny", "--num-threads", "1",
            "--max-model-len", "256"]


def test_a_runtime_directory_too_small_for_the_graphs_costs_them_never_the_start(graph_cache: Path) -> None:
    """The core unpacks its graphs into its runtime directory (its TMPDIR): where that filesystem cannot
    hold one, the graphs do not serve, /metrics says so, and the server serves eagerly and stops clean."""
    args = compiled_path_args()
    with small_filesystem("1m") as small:
        env = {ENV: str(graph_cache), "XDG_RUNTIME_DIR": str(small)}
        with ServerProcess(matrix_gguf(), *args, env=env) as server:
            assert kernel_paths(server)["decode_graph"] == "eager-fallback"
            assert server.log().count("decode graph: cannot load") == 2, server.log()[-3000:]
            client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
            assert greedy_answer(client, prompt(5, 9), 20)
        assert list(small.iterdir()) == []


def test_a_compiler_that_would_not_fit_in_memory_costs_the_graphs_never_the_start(tmp_path: Path) -> None:
    """The compiler loads a model of its own: inside a memory limit that holds the server but not it, the
    graphs are given up before it starts (with an empty graph cache, a start would compile), /metrics says
    so, and the server serves eagerly."""
    args = compiled_path_args()
    with memory_cgroup(1200 << 20) as (_, prefix), \
            ServerProcess(matrix_gguf(), *args, env={ENV: str(tmp_path / "cache")}, prefix=prefix) as server:
        assert kernel_paths(server)["decode_graph"] == "eager-fallback"
        refusal = "decode graph: not compiled: the compiler's copy of the model and its work need"
        assert refusal in server.log() and "memory cgroup" in server.log(), server.log()[-3000:]
        assert not list((tmp_path / "cache").rglob("*.pt2"))
        client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
        assert greedy_answer(client, prompt(5, 9), 20)


def test_the_run_says_which_paths_ran(capsys: pytest.CaptureFixture) -> None:
    """Last of the module: the coverage of this machine, in the CI log."""
    skipped = [f"{path.name} ({path.why_not_here()})" for path in PATHS if path.why_not_here()]
    with capsys.disabled():
        print("\nkernel paths run here:\n  " + "\n  ".join(RAN or ["none"]))
        print("kernel paths skipped here:\n  " + "\n  ".join(skipped or ["none"]))
    assert len(RAN) == len(PATHS) - len(skipped)
