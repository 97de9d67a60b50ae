"""Embeddings (`/v1/embeddings`, `Engine.embed`) through the official `openai` client against real servers of
tiny random-weight Qwen3 embedding models laid out as Qwen3-Embedding is (`make_tiny_embedding_model`): each
vector against transformers' pooled, normalised output of `AutoModel` in float32 (cosine ≥ 0.9999), for
one request of inputs of mixed lengths, concurrent requests, token-id input, base64 and `dimensions`; mean
and CLS pooling over prompts prefilled in chunks (the offline engine); the errors, each naming its field; each
task refusing the other's routes; a BERT-family encoder refused at start; a drain that finishes an
embedding in flight; the API's count in /metrics.
"""

from __future__ import annotations

import base64
import concurrent.futures
import functools
import json
import signal
import struct
from pathlib import Path

import httpx
import openai
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel, AutoTokenizer

from gracelm import Engine
from gracelm.engine.frontend import TaskError
from gracelm.lifecycle.exit_codes import ExitCode
from tests.process_checks import wait_until
from tests.server_process import ServerProcess, metric_value
from tests.tiny_models import tiny_embedding_model, tiny_model

MODEL = "tiny-embed"
HIDDEN = 64  # tiny_models' hidden size
TEXTS = ["the cat", "a quick red dog jumps over the old stone because the river is blue " * 4,
         "night", "small green bird reads a new book quietly after the long day"]
SLOW_STEPS = json.dumps({"test_step_sleep_s": 0.2})


def _embedding_model(pooling: str = "lasttoken") -> Path:
    # A Matryoshka model (config.json's is_matryoshka), so that `dimensions` is honoured.
    return tiny_embedding_model(pooling, is_matryoshka=True)


def _serve(model: Path, *args: str, env: dict[str, str] | None = None) -> ServerProcess:
    return ServerProcess(model, "--served-model-name", MODEL, "--stats-interval", "0", "--dtype", "float32",
                         *args, env={"OMP_WAIT_POLICY": "PASSIVE", **(env or {})})


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@functools.cache
def _reference_model(path: Path) -> tuple:
    return AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path, dtype=torch.float32).eval()


def _ids(path: Path, text: str) -> list[int]:
    return _reference_model(path)[0](text).input_ids


@torch.no_grad()
def _reference(path: Path, ids: list[int], pooling: str = "lasttoken") -> torch.Tensor:
    """transformers' pooled, normalised vector of `ids`."""
    hidden = _reference_model(path)[1](torch.tensor([ids])).last_hidden_state[0]
    pooled = {"lasttoken": hidden[-1], "mean_tokens": hidden.mean(0), "cls_token": hidden[0]}[pooling]
    return F.normalize(pooled, dim=0)


def _assert_close(vector: list[float], reference: torch.Tensor) -> None:
    ours = torch.tensor(vector)
    assert ours.shape == reference.shape
    assert F.cosine_similarity(ours, reference, dim=0).item() >= 0.9999
    assert abs(ours.norm().item() - 1) < 1e-4


@pytest.fixture(scope="module")
def server():
    """An embedding model's server, its task found from its files (no --task), prefills chunked by 16."""
    with _serve(_embedding_model(), "--max-num-batched-tokens", "16") as process:
        yield process


@pytest.fixture(scope="module")
def client(server):
    return _client(server)


# -- vectors -------------------------------------------------------------------------------------------


def test_one_request_of_mixed_lengths_equals_transformers(client):
    path = _embedding_model()
    answer = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float", user="someone")
    assert [d.index for d in answer.data] == list(range(len(TEXTS)))
    lengths = [len(_ids(path, text)) for text in TEXTS]
    assert max(lengths) > 16 > min(lengths)  # chunked and not
    for data, text in zip(answer.data, TEXTS, strict=True):
        _assert_close(data.embedding, _reference(path, _ids(path, text)))
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == sum(lengths)
    assert answer.model == MODEL and answer.object == "list"


def test_concurrent_requests_of_mixed_lengths(client):
    path = _embedding_model()
    texts = [" ".join(TEXTS[:1 + i % 4]) * (1 + i % 3) for i in range(12)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda t: client.embeddings.create(model=MODEL, input=t,
                                                                   encoding_format="float"), texts))
    for answer, text in zip(answers, texts, strict=True):
        _assert_close(answer.data[0].embedding, _reference(path, _ids(path, text)))


def test_token_id_input(client):
    path = _embedding_model()
    ids = [[5, 17, 300, 42], [7] * 40, [99]]
    one = client.embeddings.create(model=MODEL, input=ids[0], encoding_format="float")
    _assert_close(one.data[0].embedding, _reference(path, ids[0]))
    several = client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    for data, prompt in zip(several.data, ids, strict=True):
        _assert_close(data.embedding, _reference(path, prompt))
    assert several.usage.prompt_tokens == 45


def test_base64_decodes_to_the_floats(server, client):
    floats = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    raw = httpx.post(f"{server.url}/v1/embeddings", json={"input": TEXTS, "encoding_format": "base64"},
                     timeout=60).json()
    for data, plain in zip(raw["data"], floats.data, strict=True):
        packed = base64.b64decode(data["embedding"])
        decoded = struct.unpack(f"<{len(packed) // 4}f", packed)
        assert list(decoded) == pytest.approx(plain.embedding, abs=1e-6)
    # The client asks for base64 by default and decodes it itself.
    default = client.embeddings.create(model=MODEL, input=TEXTS)
    for data, plain in zip(default.data, floats.data, strict=True):
        assert data.embedding == pytest.approx(plain.embedding, abs=1e-6)


def test_dimensions_truncate_then_normalise(client):
    full = client.embeddings.create(model=MODEL, input=TEXTS[1], encoding_format="float").data[0].embedding
    short = client.embeddings.create(model=MODEL, input=TEXTS[1], encoding_format="float",
                                     dimensions=16).data[0].embedding
    assert len(full) == HIDDEN and len(short) == 16
    _assert_close(short, F.normalize(torch.tensor(full[:16]), dim=0))
    for dimensions in (0, HIDDEN + 1):
        with pytest.raises(openai.BadRequestError) as e:
            client.embeddings.create(model=MODEL, input="x", dimensions=dimensions)
        assert e.value.body["param"] == "dimensions"


def test_normalize_false_returns_the_pooled_vector(server):
    path = _embedding_model()
    raw = httpx.post(f"{server.url}/v1/embeddings", json={"input": "the cat", "normalize": False},
                     timeout=60).json()["data"][0]["embedding"]
    hidden = _reference_model(path)[1](torch.tensor([_ids(path, "the cat")])).last_hidden_state[0, -1]
    assert torch.allclose(torch.tensor(raw), hidden.detach(), atol=1e-4)


# -- errors --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"input": ["the cat", "the cat runs " * 300]}, 400, "input.1"),  # over the model's 512 tokens
    ({"input": [[1, 2], []]}, 400, "input.1"),
    ({"input": [5, 100000]}, 400, "input"),
    ({"input": []}, 400, "input"),
    ({"input": ["x"] * 2049}, 400, "input"),
    ({"input": "x", "model": "other"}, 404, "model"),
    ({"input": "x", "encoding_format": "int8"}, 400, "encoding_format"),
    ({"input": "x", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens"),
])
def test_errors_name_their_field(server, body, status, param):
    r = httpx.post(f"{server.url}/v1/embeddings", json=body, timeout=60)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_a_long_input_is_refused_in_openai_words_or_truncated(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=MODEL, input=[[3] * 513])
    assert "maximum context length is 512" in e.value.message and e.value.code == "context_length_exceeded"
    path = _embedding_model()
    kept = client.embeddings.create(model=MODEL, input=[[3] * 600 + [5, 6]], encoding_format="float",
                                    extra_body={"truncate_prompt_tokens": 512})
    _assert_close(kept.data[0].embedding, _reference(path, [3] * 510 + [5, 6]))


def test_unknown_fields_are_refused_as_openai_does(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=MODEL, input="x", extra_body={"embed_dtype": "float16"})
    assert e.value.body["message"] == "Unrecognized request argument supplied: embed_dtype"


def test_an_embedding_server_refuses_generation(client):
    for create in (lambda: client.chat.completions.create(model=MODEL, max_tokens=2,
                                                          messages=[{"role": "user", "content": "hi"}]),
                   lambda: client.completions.create(model=MODEL, prompt="hi", max_tokens=2)):
        with pytest.raises(openai.BadRequestError) as e:
            create()
        assert e.value.body["param"] == "model" and "embeddings" in e.value.message


def test_a_generation_server_refuses_embeddings():
    with _serve(tiny_model("qwen3")) as process:
        with pytest.raises(openai.BadRequestError) as e:
            _client(process).embeddings.create(model=MODEL, input="x")
        assert e.value.body["param"] == "model" and "--task embed" in e.value.message
        # and serves text, as before
        assert _client(process).completions.create(model=MODEL, prompt="hi", max_tokens=2).choices


def test_the_routers_probes_see_an_embedding_model(server):
    assert httpx.get(f"{server.url}/health_generate", timeout=60).status_code == 200
    assert httpx.get(f"{server.url}/server_info", timeout=30).json()["is_generation"] is False


def test_embeddings_are_counted_by_api(server, client):
    client.embeddings.create(model=MODEL, input="count me")
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    assert metric_value(text, "gracelm_api_requests_total", api="embeddings") >= 1


def test_every_request_field_is_documented():
    from gracelm.serving.embeddings_protocol import EmbeddingRequest

    table = (Path(__file__).parent.parent / "docs" / "api_fields.md").read_text().split("### Embeddings")[1]
    missing = [f for f in EmbeddingRequest.model_fields if f"| `{f}` |" not in table]
    assert not missing, f"embedding fields missing from docs/api_fields.md: {missing}"


# -- the offline engine: mean and CLS pooling over chunked prefills -------------------------------------


@pytest.mark.parametrize("pooling", ["mean_tokens", "cls_token"])
def test_engine_embed_pools_as_the_model_says(pooling):
    path = tiny_embedding_model(pooling)
    with Engine(str(path), dtype="float32", max_num_batched_tokens=16, num_threads=1) as engine:
        outputs = engine.embed(TEXTS, use_tqdm=False)
        with pytest.raises(ValueError, match="dimensions"):  # not a Matryoshka model
            engine.embed("x", dimensions=8)
        with pytest.raises(TaskError):
            engine.generate("x")
    for output, text in zip(outputs, TEXTS, strict=True):
        assert output.prompt_token_ids == _ids(path, text)
        _assert_close(output.embedding, _reference(path, output.prompt_token_ids, pooling))


# -- start and stop ------------------------------------------------------------------------------------


def test_a_bert_family_encoder_is_refused_at_start(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertModel"], "model_type": "bert"}))
    process = ServerProcess(tmp_path, "--task", "embed", wait_ready=False)
    try:
        assert process.wait_exit(120) == ExitCode.STARTUP_FAILURE
        assert "BertModel is a BERT-family encoder" in process.log()
    finally:
        process.close_log()


def test_a_drain_finishes_an_embedding_in_flight():
    path = _embedding_model()
    process = _serve(path, "--task", "embed", "--max-num-batched-tokens", "16",
                     env={"GRACELM_TEST_HOOKS": SLOW_STEPS})
    try:
        client = _client(process)
        ids = [11] * 200  # 13 chunks of 16: seconds of slow steps
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            future = pool.submit(client.embeddings.create, model=MODEL, input=[ids], encoding_format="float")
            wait_until(lambda: metric_value(httpx.get(f"{process.url}/metrics", timeout=30).text,
                                            "gracelm_api_requests_total", api="embeddings") >= 1, 30,
                       "the embedding's admission")
            process.process.send_signal(signal.SIGTERM)
            answer = future.result(timeout=60)
        _assert_close(answer.data[0].embedding, _reference(path, ids))
        assert process.wait_exit() == 0
        process.assert_nothing_left()
    finally:
        process.kill()
        process.close_log()
