"""The tokenizer gives exactly transformers' ids, text and chat prompts, for the default model's GGUF file
and for a Hugging Face directory; stop tokens, BOS handling and a missing chat template."""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

import pytest
from tokenizers import Tokenizer as RawTokenizer

from gracelm.model.model_files import default_model_path
from gracelm.model.tokenizer import Tokenizer
from tests.tiny_models import tiny_model

TEXTS = [
    "Hello, world!",
    "  leading spaces and\ttabs\n\nnew lines   ",
    "Ünïcödé: naïve café, Straße, Ελληνικά, русский, 日本語のテキスト, 中文, 한국어",
    "Emoji: 😀👍🏽 👨‍👩‍👧‍👦 🇫🇷 ✨",
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # O(2^n)\n",
    "<|im_start|>user\nspecial tokens inside text<|im_end|><|endoftext|>",
    "Numbers 1234567890 3.14159 -42 1e-9, URLs https://example.com/a?b=c&d=e",
    "",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi 👋"}],
    [
        {"role": "user", "content": "Write a haiku."},
        {"role": "assistant", "content": "Autumn moonlight—\na worm digs silently\ninto the chestnut."},
        {"role": "user", "content": "Another, in 日本語."},
    ],
]


@pytest.fixture(scope="module")
def gguf_tokenizers():
    """Ours, and transformers' own reading of the same file (slow: it parses the whole file twice)."""
    from transformers import AutoTokenizer

    path = default_model_path()
    start = time.perf_counter()
    ours = Tokenizer.from_gguf(path)
    elapsed = time.perf_counter() - start
    reference = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return ours, reference, elapsed


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_gguf_encode_equals_transformers(gguf_tokenizers, add_special_tokens: bool) -> None:
    ours, reference, _ = gguf_tokenizers
    for text in TEXTS:
        expected = reference.encode(text, add_special_tokens=add_special_tokens)
        assert ours.encode(text, add_special_tokens=add_special_tokens) == expected, text


def test_gguf_decode_equals_transformers(gguf_tokenizers) -> None:
    ours, reference, _ = gguf_tokenizers
    for text in TEXTS:
        ids = reference.encode(text)
        for skip in (True, False):
            expected = reference.decode(ids, skip_special_tokens=skip)
            assert ours.decode(ids, skip_special_tokens=skip) == expected
        assert ours.convert_ids_to_tokens(ids) == reference.convert_ids_to_tokens(ids)
    # Round trip of ordinary text, and special tokens dropped only when asked.
    assert ours.decode(ours.encode(TEXTS[3])) == TEXTS[3]
    assert ours.decode(ours.encode(TEXTS[5]), skip_special_tokens=True) == "user\nspecial tokens inside text"


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_gguf_chat_template_equals_transformers(gguf_tokenizers, add_generation_prompt: bool) -> None:
    ours, reference, _ = gguf_tokenizers
    for messages in CONVERSATIONS:
        expected = reference.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        got = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        assert got == list(expected["input_ids"])
    prompt = ours.decode(ours.apply_chat_template(CONVERSATIONS[0]), skip_special_tokens=False)
    assert prompt.endswith("<|im_start|>assistant\n") and "What is the capital of France?<|im_end|>" in prompt


def test_gguf_special_ids_and_speed(gguf_tokenizers) -> None:
    ours, reference, elapsed = gguf_tokenizers
    assert ours.vocab_size == len(reference) == 49152
    assert ours.bos_token_id == reference.bos_token_id
    im_end = reference.convert_tokens_to_ids("<|im_end|>")
    assert ours.eos_token_ids == (im_end,) == (reference.eos_token_id,)  # SmolLM2: eos is the turn end
    assert isinstance(ours.backend, RawTokenizer)
    assert elapsed < 3.0, f"building the GGUF tokenizer took {elapsed:.2f} s"


@pytest.fixture
def hf_dir(tmp_path: Path) -> Path:
    """The tokenizer files of a tiny model, in a directory the test may change."""
    source = tiny_model("llama")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(source / name, tmp_path / name)
    return tmp_path


def test_from_dir_equals_transformers(hf_dir: Path) -> None:
    from transformers import AutoTokenizer

    ours, reference = Tokenizer.from_dir(hf_dir), AutoTokenizer.from_pretrained(hf_dir)
    for text in TEXTS:
        ids = reference.encode(text)
        assert ours.encode(text) == ids
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)
    for messages in CONVERSATIONS:
        expected = reference.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
        assert ours.apply_chat_template(messages) == list(expected)
    assert ours.eos_token_ids == (reference.convert_tokens_to_ids("<|im_end|>"),)


def test_chat_template_from_tokenizer_config(hf_dir: Path) -> None:
    """Older directories keep the template inside tokenizer_config.json instead of chat_template.jinja."""
    template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}<|endoftext|>{% endfor %}"
    config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    (hf_dir / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    (hf_dir / "chat_template.jinja").unlink()
    tokenizer = Tokenizer.from_dir(hf_dir)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "the cat"}], add_generation_prompt=False)
    assert tokenizer.decode(ids, skip_special_tokens=False) == "[user]the cat<|endoftext|>"
    # This template ends turns with <|endoftext|>, so it stops a generation as eos does.
    end = tokenizer.token_to_id("<|endoftext|>")
    assert tokenizer.eos_token_ids == (tokenizer.eos_token_id, end)


def test_no_double_bos(hf_dir: Path) -> None:
    """A tokenizer that adds BOS (Llama's post-processor), with a template that writes it too: the
    prompt starts with one BOS."""
    from tokenizers import processors

    raw = RawTokenizer.from_file(str(hf_dir / "tokenizer.json"))
    bos_token = json.loads((hf_dir / "tokenizer_config.json").read_text())["bos_token"]
    bos_spec = (bos_token, raw.token_to_id(bos_token))
    raw.post_processor = processors.TemplateProcessing(single=f"{bos_token} $A", special_tokens=[bos_spec])
    raw.save(str(hf_dir / "tokenizer.json"))
    (hf_dir / "chat_template.jinja").write_text(
        "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    )
    tokenizer = Tokenizer.from_dir(hf_dir)
    bos = tokenizer.bos_token_id
    assert tokenizer.encode("the cat")[0] == bos  # plain encoding adds it
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "the cat"}])
    assert ids[0] == bos and ids[1] != bos and ids.count(bos) == 1


def test_missing_chat_template_is_a_clear_error(hf_dir: Path) -> None:
    (hf_dir / "chat_template.jinja").unlink()
    tokenizer = Tokenizer.from_dir(hf_dir)
    assert tokenizer.encode("the cat")  # plain prompts still work
    with pytest.raises(ValueError, match="has no chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def test_directory_without_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=re.escape(f"no tokenizer.json in {tmp_path}")):
        Tokenizer.from_dir(tmp_path)
