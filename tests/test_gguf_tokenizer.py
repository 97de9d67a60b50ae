"""A GGUF file's tokenizer built with `tokenizers` alone (`gguf_tokenizer`) is the one transformers builds
from the same file: the same serialization, named special tokens, chat template, ids and text, for
byte-level (Llama 3, Qwen2, GPT-2 splits) and SentencePiece vocabularies written here with gguf-py; other
kinds go through transformers; the default model's cold start imports no transformers."""

from __future__ import annotations

import json
import subprocess
import sys
from functools import cache
from itertools import accumulate
from pathlib import Path
from typing import Any

import gguf
import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers, trainers

from gracelm.model.gguf_reader import read_gguf
from gracelm.model.gguf_tokenizer import build_gguf_tokenizer
from gracelm.model.model_files import default_model_path
from gracelm.model.tokenizer import Tokenizer
from tests.tiny_models import training_text

CORPUS = [
    "Hello, world! The cat sat on the mat.",
    "  leading spaces,\ttabs\n\n\nnew lines and trailing   ",
    "Ünïcödé: naïve café, Straße, Ελληνικά, русский, 日本語のテキスト, 中文, 한국어 😀👍🏽 👨‍👩‍👧‍👦",
    "Numbers 1234567890 3.14159 -42 1e-9 and 2024-12-31, URLs https://example.com/a?b=c&d=e",
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # O(2^n)\n",
    "I'm sure they'll say it's what we'd DONE'VE",
    "<|begin_of_text|><|im_start|>user\nspecials <think>inside</think> text<|im_end|><|eot_id|><|endoftext|>",
    "<s>[INST] a sentencepiece prompt [/INST]</s><unk>",
    "",
]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}")
NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


def _trained(pre_tokenizer: Any, alphabet: list[str]) -> tuple[list[str], list[str]]:
    """A BPE vocabulary and merges learned on English-like text and the corpus, so that the corpus meets
    merges (words, digits, code) and bytes no merge covers."""
    bpe = Backend(models.BPE())
    bpe.pre_tokenizer = pre_tokenizer
    trainer = trainers.BpeTrainer(vocab_size=700, initial_alphabet=alphabet, show_progress=False)
    bpe.train_from_iterator(training_text() + CORPUS[:6], trainer=trainer)
    model = json.loads(bpe.to_str())["model"]
    return sorted(model["vocab"], key=model["vocab"].get), [" ".join(pair) for pair in model["merges"]]


@cache
def byte_level_vocabulary() -> tuple[list[str], list[str]]:
    return _trained(pre_tokenizers.ByteLevel(add_prefix_space=False), pre_tokenizers.ByteLevel.alphabet())


@cache
def sentencepiece_vocabulary() -> tuple[list[str], list[str]]:
    return _trained(pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first"), [])


def write_tokenizer_gguf(path: Path, kind: str, tokens: list[str], types: list[int], *, arch: str = "llama",
                         pre: str | None = None, merges: list[str] | None = None,
                         scores: list[float] | None = None, ids: dict[str, int] | None = None,
                         flags: dict[str, bool] | None = None, chat_template: str | None = CHAT_TEMPLATE
                         ) -> Path:
    """A GGUF file holding metadata alone: a tokenizer as llama.cpp writes one. `ids` are named by
    gguf-py's writer (`bos_token_id`, `pad_token_id`...), `flags` too (`add_bos_token`)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_tokenizer_model(kind)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if merges is not None:
        w.add_token_merges(merges)
    if scores is not None:
        w.add_token_scores(scores)
    for name, value in {**(ids or {}), **(flags or {})}.items():
        getattr(w, f"add_{name}")(value)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# Byte-level files: the tokens appended to the learned vocabulary, with their types (3 control, 4 user
# defined); a control and a user-defined token spelled with a space (respelled in the vocabulary, so left
# out of the added tokens).
LLAMA3_EXTRAS = {"<|begin_of_text|>": 3, "<|end_of_text|>": 3, "<|eot_id|>": 3, "<think>": 4, "</think>": 4,
                 "<|bad control|>": 3, "<|spaced user|>": 4}
QWEN_EXTRAS = {"<|endoftext|>": 3, "<|im_start|>": 3, "<|im_end|>": 3, "<think>": 4, "</think>": 4}
BYTE_LEVEL_FILES = {
    # Llama 3: BOS added, no <|endoftext|> in the vocabulary (GPT-2's default special token takes a new id).
    "llama-bpe": (LLAMA3_EXTRAS, {"bos_token_id": "<|begin_of_text|>", "eos_token_id": "<|eot_id|>",
                                  "eot_token_id": "<|eot_id|>"}, {"add_bos_token": True}),
    # Qwen2/Qwen3: no BOS id, a pad token, no flags beyond add_bos_token.
    "qwen2": (QWEN_EXTRAS, {"eos_token_id": "<|im_end|>", "pad_token_id": "<|endoftext|>"},
              {"add_bos_token": False}),
    # GPT-2's own split, EOS added to every sequence, one token for every named special.
    "gpt-2": (QWEN_EXTRAS, {"bos_token_id": "<|endoftext|>", "eos_token_id": "<|endoftext|>",
                            "unk_token_id": "<|endoftext|>", "pad_token_id": "<|endoftext|>"},
              {"add_eos_token": True}),
    # An older file: no pre-tokenizer name, no flags.
    None: (QWEN_EXTRAS, {"eos_token_id": "<|endoftext|>"}, {}),
}


def write_byte_level(path: Path, pre: str | None, extras: dict[str, int], ids: dict[str, str],
                     flags: dict[str, bool]) -> Path:
    learned, merges = byte_level_vocabulary()
    tokens = learned + list(extras)
    types = [1] * len(learned) + list(extras.values())
    return write_tokenizer_gguf(path, "gpt2", tokens, types, pre=pre, merges=merges, flags=flags,
                                ids={name: tokens.index(token) for name, token in ids.items()})


def write_sentencepiece(path: Path, with_merges: bool, flags: dict[str, bool], arch: str = "llama") -> Path:
    """Llama 2's layout: <unk> <s> </s>, the 256 byte tokens (type 6), then pieces scored best first."""
    learned, merges = sentencepiece_vocabulary()
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tokens = ["<unk>", "<s>", "</s>", *byte_tokens, *learned]
    types = [2, 3, 3, *[6] * 256, *[1] * len(learned)]
    scores = [0.0] * (3 + 256) + [-float(i) for i in range(len(learned))]
    return write_tokenizer_gguf(path, "llama", tokens, types, arch=arch, scores=scores, flags=flags,
                                merges=merges if with_merges else None,
                                ids={"bos_token_id": 1, "eos_token_id": 2, "unk_token_id": 0})


def transformers_tokenizer(path: Path) -> Any:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(name_or_path=str(path.parent), gguf_file=path.name, local_files_only=True)


def assert_same_as_transformers(ours: Tokenizer, reference: Any) -> None:
    assert json.loads(ours.backend.to_str()) == json.loads(reference.backend_tokenizer.to_str())
    assert ours.special_tokens == {name: value for name in NAMES if (value := getattr(reference, name))}
    assert ours.chat_template == reference.chat_template
    for text in CORPUS:
        for add_special_tokens in (True, False):
            ids = reference.encode(text, add_special_tokens=add_special_tokens)
            assert ours.encode(text, add_special_tokens=add_special_tokens) == ids, text
            for skip in (True, False):
                expected = reference.decode(ids, skip_special_tokens=skip)
                assert ours.decode(ids, skip_special_tokens=skip) == expected


@pytest.mark.parametrize("pre", list(BYTE_LEVEL_FILES))
def test_byte_level_equals_transformers(tmp_path: Path, pre: str | None) -> None:
    path = write_byte_level(tmp_path / "tiny.gguf", pre, *BYTE_LEVEL_FILES[pre])
    assert build_gguf_tokenizer(read_gguf(path).metadata) is not None  # built without transformers
    ours, reference = Tokenizer.from_gguf(path), transformers_tokenizer(path)
    assert_same_as_transformers(ours, reference)
    added = {t.content for t in ours.backend.get_added_tokens_decoder().values()}
    assert not added & {"<|bad control|>", "<|spaced user|>"}


def test_llama3_split_and_stop_tokens(tmp_path: Path) -> None:
    """What the Llama 3 file above must give beyond agreeing with transformers: digits in threes, BOS
    first, generation ending at the file's end of turn, <think> matched whole."""
    path = write_byte_level(tmp_path / "tiny.gguf", "llama-bpe", *BYTE_LEVEL_FILES["llama-bpe"])
    ours = Tokenizer.from_gguf(path)
    pieces = ours.convert_ids_to_tokens(ours.encode("1234567"))
    cuts = set(accumulate(len(piece) for piece in pieces[1:]))
    # No token across a group of three digits (GPT-2's split makes "4567" of this vocabulary).
    assert pieces[0] == "<|begin_of_text|>" and {3, 6} <= cuts
    assert ours.encode("a <think>", add_special_tokens=False)[-1] == ours.token_to_id("<think>")
    assert ours.eos_token_ids == (ours.token_to_id("<|eot_id|>"),)


@pytest.mark.parametrize(("with_merges", "flags"), [(False, {}), (True, {"add_bos_token": False,
                                                                         "add_eos_token": True})])
def test_sentencepiece_equals_transformers(tmp_path: Path, with_merges: bool, flags: dict[str, bool]) -> None:
    """Without merges (as llama.cpp writes SentencePiece files) they come from the scores; without the
    flag, BOS is added."""
    path = write_sentencepiece(tmp_path / "tiny.gguf", with_merges, flags)
    assert build_gguf_tokenizer(read_gguf(path).metadata) is not None
    ours = Tokenizer.from_gguf(path)
    assert_same_as_transformers(ours, transformers_tokenizer(path))
    assert (ours.encode("the cat")[0] == ours.bos_token_id) == ("add_bos_token" not in flags)


def test_other_kinds_go_through_transformers(tmp_path: Path) -> None:
    """A pre-tokenizer this module does not know, and an architecture transformers builds its own way."""
    tekken = write_byte_level(tmp_path / "tekken.gguf", "tekken", *BYTE_LEVEL_FILES["qwen2"])
    phi3 = write_sentencepiece(tmp_path / "phi3.gguf", True, {}, arch="phi3")
    for path in (tekken, phi3):
        assert build_gguf_tokenizer(read_gguf(path).metadata) is None
        assert_same_as_transformers(Tokenizer.from_gguf(path), transformers_tokenizer(path))


def test_a_kind_nobody_builds_is_a_clear_error(tmp_path: Path) -> None:
    path = write_tokenizer_gguf(tmp_path / "rwkv.gguf", "rwkv", ["a", "b"], [1, 1])
    with pytest.raises(ValueError, match="cannot build the tokenizer stored in this GGUF file"):
        Tokenizer.from_gguf(path)


def test_default_model_equals_transformers_without_importing_it() -> None:
    path = default_model_path()
    script = (f"import json, sys\nfrom gracelm.model.tokenizer import Tokenizer\n"
              f"data = Tokenizer.from_gguf({str(path)!r}).to_dict()\n"
              "print(json.dumps({'loaded': 'transformers' in sys.modules, 'tokenizer': data}))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    result = json.loads(out)
    assert result["loaded"] is False
    ours = Tokenizer.from_dict(result["tokenizer"])
    assert_same_as_transformers(ours, transformers_tokenizer(path))
