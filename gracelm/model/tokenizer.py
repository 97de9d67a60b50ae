"""A model's tokenizer: encode, decode, chat template and stop tokens, from a HF directory or a GGUF file.

A thin layer over transformers' fast tokenizer, so that ids are exactly those transformers gives for the
same files. The one thing it adds is `eos_token_ids`, the set of ids that end a generation.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import jinja2
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from gracelm.model.gguf_reader import read_gguf

# Rendered as an assistant message to find the token the chat template closes a turn with.
_SENTINEL = "gracelm-end-of-turn-probe"


class Tokenizer:
    """Wraps a transformers fast tokenizer (`.hf`, for the incremental detokenizer).

    `eos_token_ids` holds every id that ends a generation: the tokenizer's eos, the ids a GGUF file names
    as end of turn / end of message (`tokenizer.ggml.eot_token_id`, `eom_token_id`), and the special token
    the chat template writes right after an assistant message (`<|im_end|>` for ChatML, `<|eot_id|>` for
    Llama 3, `<end_of_turn>` for Gemma). A chat model's eos is often not the token that ends its turns
    (Qwen2's eos is `<|endoftext|>`, its turns end with `<|im_end|>`), and stopping only at eos would let
    it run on into a new turn it invents.
    """

    def __init__(self, hf: PreTrainedTokenizerFast, extra_eos_ids: Iterable[int] = ()) -> None:
        if not hf.is_fast:
            raise ValueError(f"a fast (tokenizers-backed) tokenizer is required, got {type(hf).__name__}")
        self.hf = hf
        ids = [hf.eos_token_id, *extra_eos_ids, _turn_end_id(hf)]
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(i for i in ids if i is not None))

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """A Hugging Face model directory: tokenizer.json, tokenizer_config.json, chat template (in
        tokenizer_config.json or chat_template.jinja)."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"no tokenizer.json in {path}; a fast tokenizer file is required")
        return cls(AutoTokenizer.from_pretrained(path, local_files_only=True))

    @classmethod
    def from_gguf(cls, path: str | Path, metadata: dict | None = None) -> Tokenizer:
        """The tokenizer stored in a GGUF file's metadata (vocabulary, merges, special tokens, chat template).

        Built directly rather than through `AutoTokenizer.from_pretrained(dir, gguf_file=...)`, which gives
        the same tokenizer but first parses the whole file a second time for the model config (~5 s for
        SmolLM2-135M, against ~0.4 s here). `metadata`, when the caller has already read the file, saves
        reading it again for the end-of-turn ids.
        """
        path = Path(path).resolve()
        if metadata is None:
            metadata = read_gguf(path).metadata
        try:
            hf = PreTrainedTokenizerFast(
                name_or_path=str(path.parent), gguf_file=path.name, local_files_only=True
            )
        except (ValueError, KeyError) as e:  # a tokenizer kind transformers cannot build, or missing fields
            raise ValueError(f"{path}: cannot build the tokenizer stored in this GGUF file: {e!r}") from e
        extra = (metadata.get(f"tokenizer.ggml.{key}") for key in ("eot_token_id", "eom_token_id"))
        return cls(hf, extra_eos_ids=(i for i in extra if i is not None))

    @property
    def bos_token_id(self) -> int | None:
        return self.hf.bos_token_id

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included."""
        return len(self.hf)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return self.hf.convert_ids_to_tokens(list(ids))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered conversation. The template writes any BOS itself, so none is added."""
        if not self.hf.chat_template:
            raise ValueError(
                f"the model's tokenizer ({self.hf.name_or_path}) has no chat template; "
                "send a plain prompt (completions) instead of chat messages"
            )
        return list(
            self.hf.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
            )
        )


def _turn_end_id(hf: PreTrainedTokenizerFast) -> int | None:
    """The special token the chat template writes right after an assistant message's content, if any."""
    if not hf.chat_template:
        return None
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _SENTINEL}]
    try:
        text = hf.apply_chat_template(messages, tokenize=False)
    except jinja2.TemplateError:  # a template that refuses this conversation shape: no turn token to learn
        return None
    _, found, after = text.partition(_SENTINEL)
    after = after.lstrip()
    if not found:
        return None
    specials = (t.content for t in hf.added_tokens_decoder.values() if t.special)
    matches = [token for token in specials if after.startswith(token)]
    return hf.convert_tokens_to_ids(max(matches, key=len)) if matches else None
