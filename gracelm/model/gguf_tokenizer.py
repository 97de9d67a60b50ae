"""A GGUF file's tokenizer, built from its metadata with the `tokenizers` library alone.

transformers builds it too (`PreTrainedTokenizerFast(gguf_file=...)`), but importing transformers costs a cold
start most of a second before its converter even runs. This module builds the very tokenizer transformers
builds (the same `tokenizers` serialization, named special tokens and chat template) for the kinds most files
carry: byte-level BPE (`tokenizer.ggml.model` "gpt2": GPT-2, SmolLM, Llama 3, Qwen2 and Qwen3) and
SentencePiece BPE ("llama": Llama 2, Mistral). For anything else (another model kind, an architecture
transformers builds its own way, a pre-tokenizer not listed here) `build_gguf_tokenizer` returns None and the
caller goes through transformers.

What transformers does, in order, and so what this does: a backend from the vocabulary and merges (GPT-2's
or Llama's tokenizer class with its default special tokens), the tokens the file marks as control (special)
and user-defined (added, not special), the pre-tokenizer's split for the file's `tokenizer.ggml.pre`, then the
file's named special tokens and a post-processor that adds BOS (and EOS) as the file says. The order matters:
a token added that the vocabulary lacks takes the next free id, and a token added twice keeps the flags of
the last addition.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, decoders, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend
from tokenizers.models import BPE

# llama.cpp's token types (`tokenizer.ggml.token_type`).
_CONTROL, _USER_DEFINED = 3, 4

# The splits transformers applies before byte-level BPE, by `tokenizer.ggml.pre`; None keeps GPT-2's own.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_BYTE_LEVEL_SPLITS: dict[str | None, str | None] = {
    None: None, "default": None, "gpt-2": None, "smollm": None, "starcoder": None,
    "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# Architectures whose SentencePiece vocabulary transformers builds its own way (respelled tokens, another
# normalizer): left to it.
_OWN_SENTENCEPIECE = frozenset({"gemma", "gemma2", "gemma3", "phi3"})
# The special tokens each kind's tokenizer class starts with, in the order it adds them.
_CLASS_DEFAULTS = {"gpt2": ("<|endoftext|>",), "llama": ("<s>", "</s>", "<unk>")}
# Named special tokens and their id's metadata key, in the order transformers adds them.
_NAMED_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
              "pad_token": "padding_token_id"}


@dataclass(frozen=True)
class GGUFTokenizer:
    backend: Backend
    special_tokens: dict[str, str | None]  # bos_token, eos_token, unk_token, pad_token
    chat_template: str | None


def build_gguf_tokenizer(metadata: dict[str, Any]) -> GGUFTokenizer | None:
    """The tokenizer a GGUF file's metadata describes, or None where transformers must build it."""
    if not builds_alone(metadata):
        return None
    kind = metadata["tokenizer.ggml.model"]
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    merges = _merges(metadata, tokens)
    backend = _byte_level(tokens, merges) if kind == "gpt2" else _sentencepiece(tokens, merges)
    backend.add_tokens([AddedToken(token, special=True) for token in _CLASS_DEFAULTS[kind]])
    _add_marked_tokens(backend, metadata, byte_level=kind == "gpt2")
    split = _BYTE_LEVEL_SPLITS.get(metadata.get("tokenizer.ggml.pre"))
    if kind == "gpt2" and split is not None:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    special_tokens = _add_named_tokens(backend, metadata)
    # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise.
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", kind == "llama"))
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    backend.post_processor = _post_processor(backend, special_tokens, add_bos, add_eos)
    return GGUFTokenizer(backend, special_tokens, metadata.get("tokenizer.chat_template"))


def builds_alone(metadata: dict[str, Any]) -> bool:
    """Whether `build_gguf_tokenizer` builds this metadata's tokenizer (not None), told from its kind and
    keys alone: the metadata may be read without its string arrays (`read_gguf`), whose keys it keeps."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind == "gpt2":
        handled = metadata.get("tokenizer.ggml.pre") in _BYTE_LEVEL_SPLITS
    else:
        handled = kind == "llama" and metadata.get("general.architecture") not in _OWN_SENTENCEPIECE
    merges = "tokenizer.ggml.merges" in metadata or metadata.get("tokenizer.ggml.scores") is not None
    return handled and merges


def _add_named_tokens(backend: Backend, metadata: dict[str, Any]) -> dict[str, str | None]:
    """The tokens the file names by id (bos, eos, unk, pad), added as special tokens where not added yet."""
    tokens = metadata["tokenizer.ggml.tokens"]
    named = {name: None if (i := metadata.get(f"tokenizer.ggml.{key}")) is None else tokens[i]
             for name, key in _NAMED_IDS.items()}
    added = {token.content for token in backend.get_added_tokens_decoder().values()}
    missing = dict.fromkeys(token for token in named.values() if token is not None and token not in added)
    backend.add_tokens([AddedToken(token, special=True) for token in missing])
    return named


def _byte_level(tokens: Sequence[str], merges: list[tuple[str, ...]]) -> Backend:
    """GPT-2's tokenizer. A token the file spells in plain text (a special token with a space, say) is
    respelled in the byte alphabet, as every other token of the vocabulary is."""
    spelling, outside = _byte_spelling(), _outside_byte_alphabet()
    vocab = {"".join(spelling[b] for b in token.encode()) if outside.search(token) else token: index
             for index, token in enumerate(tokens)}
    backend = Backend(BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                          end_of_word_suffix="", fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece(tokens: Sequence[str], merges: list[tuple[str, ...]]) -> Backend:
    """Llama's tokenizer: `▁` for a space, prepended to the text once; bytes the vocabulary lacks fall back
    to its `<0xNN>` tokens."""
    vocab = {token: index for index, token in enumerate(tokens)}
    backend = Backend(BPE(vocab=vocab, merges=merges, dropout=None, fuse_unk=True, byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(content=" ", left=1)])
    return backend


def _merges(metadata: dict[str, Any], tokens: Sequence[str]) -> list[tuple[str, ...]]:
    """The file's merges; else those its vocabulary and scores imply (SentencePiece files store no merges)."""
    merges = metadata.get("tokenizer.ggml.merges")
    if merges is not None:
        return [tuple(merge.split(" ")) for merge in merges]
    return _merges_from_scores(tokens, metadata["tokenizer.ggml.scores"])


def _merges_from_scores(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, ...]]:
    """Every split of a token into two vocabulary tokens is a merge, ranked by the token's score (higher
    first), then by the shorter left and right parts; a token's own splits in vocabulary order."""
    index = {token: i for i, token in enumerate(tokens)}
    ranked = []
    for token, score in dict(zip(tokens, scores, strict=False)).items():
        splits = [(token[:cut], token[cut:]) for cut in range(1, len(token))]
        found = sorted(((left, right) for left, right in splits if left in index and right in index),
                       key=lambda pair: (index[pair[0]], index[pair[1]]))
        ranked.extend((left, right, score) for left, right in found)
    ranked.sort(key=lambda merge: (merge[2], len(merge[0]), len(merge[1])), reverse=True)
    return [(left, right) for left, right, _ in ranked]


def _add_marked_tokens(backend: Backend, metadata: dict[str, Any], byte_level: bool) -> None:
    """Control tokens as special tokens, user-defined ones (`<think>`) as added tokens, so that both are
    matched whole in the text. A byte-level control token spelled outside the byte alphabet is a llama.cpp
    mislabel, left out: adding it would grow the vocabulary past the model's."""
    tokens = metadata["tokenizer.ggml.tokens"]
    # A file's types may stop short of its tokens; those past the end count as normal, as in transformers.
    marked = list(zip(tokens, metadata.get("tokenizer.ggml.token_type") or (), strict=False))
    outside = _outside_byte_alphabet()
    control = [AddedToken(token, normalized=False, special=True)
               for token, kind in marked
               if kind == _CONTROL and not (byte_level and outside.search(token))]
    if control:
        backend.add_special_tokens(control)
    user_defined = [AddedToken(token, normalized=False, special=False) for token, kind in marked
                    if kind == _USER_DEFINED and backend.token_to_id(token) is not None]
    if user_defined:
        backend.add_tokens(user_defined)


def _post_processor(backend: Backend, special_tokens: dict[str, str | None], add_bos: bool,
                    add_eos: bool) -> processors.TemplateProcessing:
    bos, eos = special_tokens["bos_token"], special_tokens["eos_token"]
    add_bos, add_eos = add_bos and bos is not None, add_eos and eos is not None
    first = f"{bos}:0 " if add_bos else ""
    single = f"{first}$A:0{f' {eos}:0' if add_eos else ''}"
    pair = f"{single}{f' {bos}:1' if add_bos else ''} $B:1{f' {eos}:1' if add_eos else ''}"
    named = [token for token, wanted in ((bos, add_bos), (eos, add_eos)) if wanted]
    return processors.TemplateProcessing(single=single, pair=pair,
                                         special_tokens=[(t, backend.token_to_id(t)) for t in named])


@functools.cache
def _outside_byte_alphabet() -> re.Pattern[str]:
    """Matches a character that is not one of `_byte_spelling`'s."""
    return re.compile(f"[^{re.escape(''.join(_byte_spelling().values()))}]")


@functools.cache
def _byte_spelling() -> dict[int, str]:
    """GPT-2's spelling of bytes as printable characters: printable Latin-1 bytes as themselves, the others
    as the code points from 256 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}
