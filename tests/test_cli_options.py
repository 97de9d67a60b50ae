"""`gracelm serve`'s options from issue 11, each shown by its effect on a real server of a tiny random model:
repeatable served names and API keys (through the official `openai` client), `--generation-config`
defaults, `--chat-template`, `--max-logprobs`, `--no-enable-prefix-caching`, `--disable-log-requests`,
`--uvicorn-log-level`; the context-overflow message clients match; the subcommand's usage on a usage
error; and the rule that puts MODEL after a repeatable option's values."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import httpx
import openai
import pytest

from gracelm.cli import main as cli
from gracelm.serving.chat_template_option import read_chat_template
from gracelm.serving.generation_defaults import load_generation_defaults
from tests.server_process import GRACELM, ServerProcess
from tests.tiny_models import tiny_model

NAMES = ("tiny-main", "tiny-alias")
KEYS = ("key-one", "key-two", "kéy-three")  # a non-ASCII key too: compared as UTF-8 bytes
CONTEXT = 64
MAX_NEW_TOKENS = 3
# A template whose output ignores the messages: a chat prompt of this many words or more shows it was used.
TEMPLATE = "{% for i in range(40) %}the {% endfor %}"
# litellm maps an OpenAI-compatible server's 400 to ContextWindowExceededError on this text.
LITELLM_CONTEXT_MATCH = "This model's maximum context length is"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny model with a generation_config.json carrying sampling defaults."""
    directory = tmp_path_factory.mktemp("gen-config") / "model"
    shutil.copytree(tiny_model("llama"), directory)
    (directory / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": 2, "temperature": 0.0, "max_new_tokens": MAX_NEW_TOKENS}))
    return directory


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    with ServerProcess(model_dir, "--served-model-name", *NAMES, "--api-key", *KEYS,
                       "--chat-template", str(template), "--max-logprobs", "3",
                       "--max-model-len", str(CONTEXT), "--no-enable-prefix-caching",
                       "--disable-log-requests", "--uvicorn-log-level", "warning",
                       env={"GRACELM_API_KEY": None}) as server:
        yield server  # stopped at exit: exit code 0, nothing left behind


def _client(server, key: str = KEYS[0]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=120)


def test_every_served_name_and_key_is_accepted_and_the_first_name_reported(server):
    assert [m.id for m in _client(server).models.list().data] == list(NAMES)
    for key in KEYS[:2]:  # the openai client sends ASCII headers only
        for name in NAMES:
            answer = _client(server, key).completions.create(model=name, prompt="the cat", max_tokens=2)
            assert answer.model == NAMES[0]
    headers = {"Authorization": f"Bearer {KEYS[2]}".encode()}
    assert httpx.get(f"{server.url}/v1/models", headers=headers).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        _client(server, "key-three").models.list()
    with pytest.raises(openai.NotFoundError, match="tiny-alias"):
        _client(server).completions.create(model="other", prompt="the cat", max_tokens=2)


def test_generation_config_defaults_apply_to_fields_left_out(server):
    client = _client(server)
    # max_new_tokens is the default max_tokens (of chat: completions' own default is OpenAI's 16); a
    # request's own value wins.
    messages = [{"role": "user", "content": "hi"}]
    plain = client.chat.completions.create(model=NAMES[0], messages=messages, extra_body={"ignore_eos": True})
    assert plain.usage.completion_tokens == MAX_NEW_TOKENS and plain.choices[0].finish_reason == "length"
    longer = client.chat.completions.create(model=NAMES[0], messages=messages, max_tokens=6,
                                            extra_body={"ignore_eos": True})
    assert longer.usage.completion_tokens == 6
    # temperature 0 by default: seeds make no difference; a request's own temperature 1 samples.
    greedy = {client.completions.create(model=NAMES[0], prompt="the cat", max_tokens=8, seed=seed,
                                        extra_body={"ignore_eos": True}).choices[0].text
              for seed in (1, 2, 3)}
    sampled = {client.completions.create(model=NAMES[0], prompt="the cat", max_tokens=8, seed=seed,
                                         temperature=1.0, extra_body={"ignore_eos": True}).choices[0].text
               for seed in (1, 2, 3)}
    assert len(greedy) == 1 and len(sampled) > 1
    assert "sampling defaults from" in server.log() and "max_tokens=3" in server.log()


def test_chat_template_option_renders_the_messages(server):
    answer = _client(server).chat.completions.create(model=NAMES[1], max_tokens=1,
                                                     messages=[{"role": "user", "content": "hi"}])
    assert answer.usage.prompt_tokens >= 40  # the model's ChatML template makes a handful of tokens of "hi"


def test_max_logprobs_caps_logprobs_and_top_logprobs(server):
    client = _client(server)
    with pytest.raises(openai.BadRequestError, match="--max-logprobs") as error:
        client.chat.completions.create(model=NAMES[0], messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=1, logprobs=True, top_logprobs=4)
    assert error.value.body["param"] == "top_logprobs" and "between 0 and 3" in error.value.body["message"]
    with pytest.raises(openai.BadRequestError, match="--max-logprobs"):
        client.completions.create(model=NAMES[0], prompt="the cat", max_tokens=1, logprobs=4)
    answer = client.completions.create(model=NAMES[0], prompt="the cat", max_tokens=1, logprobs=3)
    assert len(answer.choices[0].logprobs.top_logprobs[0]) == 3


def test_context_overflow_is_worded_as_openai_words_it(server):
    client = _client(server)
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=NAMES[0], prompt=[5] * 70, max_tokens=4)
    message = error.value.body["message"]
    assert message.startswith(LITELLM_CONTEXT_MATCH)
    assert message == (f"This model's maximum context length is {CONTEXT} tokens. However, you requested 74 "
                       f"tokens (70 in the messages, 4 in the completion). Please reduce the length of the "
                       f"messages or completion.")
    assert error.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError, match="you requested 80 tokens") as error:
        client.completions.create(model=NAMES[0], prompt=[5] * 20, max_tokens=60)
    assert error.value.body["param"] == "max_tokens" and LITELLM_CONTEXT_MATCH in error.value.body["message"]


def test_disabled_prefix_caching_looks_nothing_up(server):
    client = _client(server)
    for _ in range(2):
        client.completions.create(model=NAMES[0], prompt=[7] * 40, max_tokens=1)
    body = httpx.get(f"{server.url}/metrics").text
    assert 'gracelm_prefix_cache_queries_total{model_name="tiny-main"} 0.0' in body
    assert "vllm:" not in body  # vLLM's names only with --metrics-names vllm


def test_request_log_and_access_log_are_off_as_asked(server):
    _client(server).completions.create(model=NAMES[0], prompt="the cat", max_tokens=1)
    log = server.log()
    assert "prompt tokens" not in log  # --disable-log-requests
    assert "HTTP/1.1" not in log  # --uvicorn-log-level warning: no access lines


def _usage_error(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(GRACELM), *args], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("args, usage", [
    (["serve", "--no-such-option"], "usage: gracelm serve"),
    (["serve", "--max-logprobs", "many"], "usage: gracelm serve"),
    (["deploy", "systemd", "--no-such-option"], "usage: gracelm deploy systemd"),
    (["generate", "--prompt", "x", "--no-such-option"], "usage: gracelm generate"),
])
def test_a_usage_error_prints_the_subcommands_usage(args, usage):
    result = _usage_error(*args)
    assert result.returncode == 2
    assert result.stderr.startswith(usage), result.stderr
    assert "--no-such-option" in result.stderr or "many" in result.stderr


@pytest.mark.parametrize("args, problem", [
    (["serve", "--max-logprobs", "21"], "max_logprobs must be between 0 and 20"),
    (["serve", "--chat-template", "no-such-file"], "chat_template is neither a file nor a Jinja template"),
    (["serve", "--chat-template", "{% for %}"], "chat_template does not compile"),
    (["serve", "--generation-config", "/"], "generation_config must be auto, vllm or a folder"),
    (["serve", "--api-key", ""], "api_key must not be empty"),
    (["serve", "--quantization", "awq"], "argument --quantization: invalid choice: 'awq'"),
    (["serve", "--dense-weights", "off", "--deterministic"],
     "dense_weights off (--dense-weights) cannot serve deterministic"),
    (["serve", "--dense-weights", "off", "--tensor-parallel-size", "2"],
     "dense_weights off (--dense-weights) cannot serve tensor_parallel_size > 1"),
    (["serve", "--dense-weights", "off", "--quantization", "none"],
     "dense_weights off (--dense-weights) cannot serve quantization none"),
    (["serve", "--disable-access-log-for-endpoints", "/health,ready"],
     "disable_access_log_for_endpoints takes paths such as /ready, got 'ready'"),
])
def test_a_bad_value_is_a_usage_error_naming_it(args, problem):
    result = _usage_error(*args)
    assert result.returncode == 2 and problem in result.stderr, result.stderr


def test_an_empty_key_in_the_environment_is_refused_as_an_empty_option_is():
    """`GRACELM_API_KEY=""` once turned authentication off without a word, where `--api-key ""` is refused."""
    result = subprocess.run([str(GRACELM), "serve", "--port", "0"], capture_output=True, text=True,
                            timeout=60, env={**os.environ, "GRACELM_API_KEY": ""})
    assert result.returncode == 2, result.stderr
    assert "GRACELM_API_KEY is set but empty" in result.stderr


@pytest.mark.parametrize("argv, model, keys", [
    (["serve", "MODEL", "--api-key", "a", "b"], "MODEL", ["a", "b"]),
    (["serve", "--api-key", "a", "b", "MODEL"], "MODEL", ["a", "b"]),
    (["serve", "--api-key", "a", "MODEL"], "MODEL", ["a"]),  # as when --api-key took one value
    (["serve", "--api-key", "a", "--api-key", "b"], None, ["a", "b"]),
    (["serve", "--api-key", "a", "b", "--port", "1"], None, ["a", "b"]),
    (["serve", "--model", "MODEL", "--api-key", "a", "b"], "MODEL", ["a", "b"]),
])
def test_model_after_a_repeatable_options_values(argv, model, keys):
    args = cli.build_parser().parse_args(argv)
    args.argv = argv
    cli._merge_model_argument(args)
    assert getattr(args, "model", None) == model and args.api_key == keys


def test_chat_template_is_a_file_or_inline_text(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages }}")
    assert read_chat_template(str(path)) == "{{ messages }}"
    assert read_chat_template("{% if x %}y{% endif %}") == "{% if x %}y{% endif %}"


def test_generation_config_sources(model_dir, tmp_path, caplog):
    caplog.set_level("INFO", logger="gracelm.server")
    assert load_generation_defaults("auto", model_dir) == {"temperature": 0.0, "max_tokens": MAX_NEW_TOKENS}
    assert load_generation_defaults("vllm", model_dir) == {}
    folder_config = {"top_p": 0.5, "top_k": 7, "do_sample": True}
    (tmp_path / "generation_config.json").write_text(json.dumps(folder_config))
    assert load_generation_defaults(str(tmp_path), model_dir) == {"top_p": 0.5, "top_k": 7}
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    assert load_generation_defaults("auto", gguf) == {}
    assert "a GGUF file, which has no generation_config.json" in caplog.text
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 9}))
    with pytest.raises(ValueError, match="temperature"):
        load_generation_defaults(str(tmp_path), model_dir)
