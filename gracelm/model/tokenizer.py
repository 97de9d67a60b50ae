"""A model's tokenizer: encode, decode, chat template and stop tokens, over the `tokenizers` library alone.

Built once where the model's files are read (`from_dir` through transformers; `from_gguf` from the file's
metadata by `gguf_tokenizer`, which builds what transformers builds without importing it, or through
transformers for the kinds it leaves to it), so that ids are exactly those transformers gives for the same
files. Then carried as a plain dict (`to_dict`: the `tokenizers` serialization, the chat template, the
special tokens) to wherever it is used: the engine core sends it to the frontend in its `Ready` message,
and the frontend rebuilds it with `from_dict` without importing transformers or torch; a GGUF file's that
`gguf_tokenizer` builds, the frontend builds from the file itself (`engine/early_tokenizer.py`). Chat
templates are rendered with jinja2 in a sandbox set up as transformers sets up its own (trim_blocks,
lstrip_blocks, loop controls, `raise_exception`, a `tojson` that does not escape HTML, `strftime_now`), so
the prompts are the same.

The one thing it adds is `eos_token_ids`, the set of ids that end a generation.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as Backend

from gracelm.model.gguf_tokenizer import build_gguf_tokenizer
from gracelm.model.template_budget import TemplateBudget, bounded_environment

# Rendered as an assistant message to find the token the chat template closes a turn with.
_SENTINEL = "gracelm-end-of-turn-probe"
# The special tokens a chat template may refer to by name (`{{ bos_token }}`), as transformers passes them.
_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


class Tokenizer:
    """`eos_token_ids` holds every id that ends a generation: the tokenizer's eos, the ids a GGUF file names
    as end of turn / end of message (`tokenizer.ggml.eot_token_id`, `eom_token_id`), and the special token
    the chat template writes right after an assistant message (`<|im_end|>` for ChatML, `<|eot_id|>` for
    Llama 3, `<end_of_turn>` for Gemma). A chat model's eos is often not the token that ends its turns
    (Qwen2's eos is `<|endoftext|>`, its turns end with `<|im_end|>`), and stopping only at eos would let
    it run on into a new turn it invents.
    """

    def __init__(self, backend: Backend | None, *, name: str, chat_template: str | None,
                 special_tokens: dict[str, str | None], eos_token_ids: Iterable[int] | None = None,
                 extra_eos_ids: Iterable[int] = ()) -> None:
        self._backend = backend
        self.name = name
        self.chat_template = chat_template
        self.special_tokens = {k: v for k, v in special_tokens.items() if k in _SPECIAL_TOKEN_NAMES and v}
        if eos_token_ids is None:
            ids = [self.eos_token_id, *extra_eos_ids, self._turn_end_id()]
            eos_token_ids = dict.fromkeys(i for i in ids if i is not None)
        self.eos_token_ids: tuple[int, ...] = tuple(eos_token_ids)
        self._serialized: dict[str, Any] | None = None  # `to_dict`'s result, made once (~50 ms)

    @property
    def backend(self) -> Backend:
        """The `tokenizers` tokenizer. One rebuilt from its serialized form (`from_dict`) is built at its
        first use: the engine core sends, caches and fingerprints the serialized form, and hands it to
        llguidance, so only a request whose text it must encode (bad words) builds it there; until then the
        core does not hold it (for a 128k-token vocabulary, tens of MB, and a good part of a warm start)."""
        if self._backend is None:
            assert self._serialized is not None  # `from_dict`'s
            self._backend = Backend.from_str(self.backend_json())
        return self._backend

    def backend_json(self) -> str:
        """The `tokenizers` tokenizer's own serialized form (its tokenizer.json, what llguidance takes), from
        `to_dict`'s, made once: neither built nor serialized again for it."""
        return self.to_dict()["backend"]

    # -- building -------------------------------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """A Hugging Face model directory: tokenizer.json, tokenizer_config.json, chat template (in
        tokenizer_config.json or chat_template.jinja)."""
        from transformers import AutoTokenizer

        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"no tokenizer.json in {path}; a fast tokenizer file is required")
        return cls._of_transformers(AutoTokenizer.from_pretrained(path, local_files_only=True), path.name)

    @classmethod
    def from_gguf(cls, path: str | Path, metadata: dict | None = None) -> Tokenizer:
        """The tokenizer stored in a GGUF file's metadata (vocabulary, merges, special tokens, chat template).

        Built with the `tokenizers` library alone where `gguf_tokenizer` knows the file's kind (the same
        tokenizer transformers builds, without importing it), else through transformers. `metadata`, when
        the caller has already read the file, saves reading it again.
        """
        tokenizer = cls._from_gguf(path, metadata, through_transformers=True)
        assert tokenizer is not None
        return tokenizer

    @classmethod
    def from_gguf_without_transformers(cls, path: str | Path) -> Tokenizer | None:
        """`from_gguf`'s tokenizer where the `tokenizers` library alone builds it; None where the file's kind
        needs transformers, whose import takes seconds and hundreds of MB (torch's among them)."""
        return cls._from_gguf(path, None, through_transformers=False)

    @classmethod
    def _from_gguf(cls, path: str | Path, metadata: dict | None, through_transformers: bool
                   ) -> Tokenizer | None:
        from gracelm.model.gguf_reader import read_gguf

        path = Path(path).resolve()
        if metadata is None:
            metadata = read_gguf(path).metadata
        extra = (metadata.get(f"tokenizer.ggml.{key}") for key in ("eot_token_id", "eom_token_id"))
        extra_eos_ids = [i for i in extra if i is not None]
        try:
            built = build_gguf_tokenizer(metadata)
            if built is None:
                if not through_transformers:
                    return None
                return cls._of_transformers(_gguf_through_transformers(path), path.stem, extra_eos_ids)
        except (ValueError, KeyError, IndexError) as e:  # a kind nobody can build, or missing fields
            raise ValueError(f"{path}: cannot build the tokenizer stored in this GGUF file: {e!r}") from e
        return cls(built.backend, name=path.stem, chat_template=built.chat_template,
                   special_tokens=built.special_tokens, extra_eos_ids=extra_eos_ids)

    @classmethod
    def _of_transformers(cls, hf: Any, name: str, extra_eos_ids: Iterable[int] = ()) -> Tokenizer:
        if not hf.is_fast:
            raise ValueError(f"a fast (tokenizers-backed) tokenizer is required, got {type(hf).__name__}")
        template = hf.chat_template
        if isinstance(template, dict):  # named templates: the default one is the chat template
            template = template.get("default")
        # A copy of the backend, so that nothing transformers set on its own object (padding, truncation)
        # comes along: the serialized form is what every process uses.
        backend = Backend.from_str(hf.backend_tokenizer.to_str())
        specials = {key: getattr(hf, key, None) for key in _SPECIAL_TOKEN_NAMES}
        return cls(backend, name=name, chat_template=template, special_tokens=specials,
                   extra_eos_ids=extra_eos_ids)

    def to_dict(self) -> dict[str, Any]:
        """Everything needed to rebuild this tokenizer elsewhere (`from_dict`), in plain types. Serialized
        once: the core sends it, caches it and fingerprints the KV snapshot with it; do not modify it."""
        if self._serialized is None:
            self._serialized = {"backend": self.backend.to_str(), "name": self.name,
                                "chat_template": self.chat_template, "special_tokens": self.special_tokens,
                                "eos_token_ids": list(self.eos_token_ids)}
        return self._serialized

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Tokenizer:
        tokenizer = cls(None, name=data["name"],
                        chat_template=data["chat_template"], special_tokens=data["special_tokens"],
                        eos_token_ids=data["eos_token_ids"])
        tokenizer._serialized = data  # what it was rebuilt from is already its serialized form
        return tokenizer

    # -- ids ------------------------------------------------------------------------------------------

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self.token_to_id(self.special_tokens.get("bos_token"))

    @property
    def eos_token_id(self) -> int | None:
        return self.token_to_id(self.special_tokens.get("eos_token"))

    @property
    def pad_token_id(self) -> int | None:
        return self.token_to_id(self.special_tokens.get("pad_token"))

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # transformers' clean-up of tokenization spaces is never applied to BPE vocabularies, the kind every
        # model served here has, so the backend's decoding is the whole of it.
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return [self.backend.id_to_token(i) for i in ids]

    # -- chat -----------------------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, **variables: Any) -> list[int]:
        """Token ids of the rendered conversation. The template writes any BOS itself, so none is added."""
        return self.encode(self.render_chat(messages, add_generation_prompt, tools, **variables),
                           add_special_tokens=False)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, *, chat_template: str | None = None,
                    budget: TemplateBudget | None = None, **variables: Any) -> str:
        """`tools` (OpenAI's tool objects) are passed as transformers passes them; a template that does not
        read them (`template_variables`) leaves them out. `chat_template` replaces the model's (a request's,
        rendered within `budget`: `template_budget.py`); `variables` are further template variables (a
        request's chat_template_kwargs, documents)."""
        chat_template = chat_template or self.chat_template
        if not chat_template:
            raise ValueError(f"the model's tokenizer ({self.name}) has no chat template; send a plain prompt "
                             "(completions) instead of chat messages")
        context = {**self.special_tokens, **variables, "messages": messages,
                   "add_generation_prompt": add_generation_prompt, "tools": tools}
        if budget is None:
            return _compiled(chat_template).render(context)
        return budget.render(_bounded(chat_template, budget.max_chars), context)

    def _turn_end_id(self) -> int | None:
        """The special token the chat template writes right after an assistant message's content, if any."""
        if not self.chat_template:
            return None
        messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _SENTINEL}]
        try:
            text = self.render_chat(messages, add_generation_prompt=False)
        except jinja2.TemplateError:  # a template that refuses this conversation shape: no turn token
            return None
        _, found, after = text.partition(_SENTINEL)
        after = after.lstrip()
        if not found:
            return None
        specials = (t.content for t in self.backend.get_added_tokens_decoder().values() if t.special)
        matches = [token for token in specials if after.startswith(token)]
        return self.token_to_id(max(matches, key=len)) if matches else None


def _gguf_through_transformers(path: Path) -> Any:
    """transformers' own reading of the file's tokenizer, for the kinds `gguf_tokenizer` leaves to it.
    Not `AutoTokenizer.from_pretrained(dir, gguf_file=...)`: that parses the whole file a second time for
    the model config."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(name_or_path=str(path.parent), gguf_file=path.name, local_files_only=True)


@functools.lru_cache(maxsize=8)
def _compiled(chat_template: str) -> jinja2.Template:
    """The template compiled once, in a sandbox: chat templates come with models and are untrusted."""
    return _compiled_environment().from_string(chat_template)


def template_variables(chat_template: str, budget: TemplateBudget | None = None) -> frozenset[str]:
    """The variables a chat template reads from its context (`tools` when it has a tools section); a
    request's (`budget`) read in the bounded environment, which folds no constants."""
    # One cache entry whether the budget is passed or left out: the tool-call parser's choice and the
    # prompts read the server's template once between them.
    return _template_variables(chat_template, budget)


@functools.lru_cache(maxsize=8)
def _template_variables(chat_template: str, budget: TemplateBudget | None) -> frozenset[str]:
    env = _compiled_environment() if budget is None else bounded_environment(_configure, budget.max_chars)
    return frozenset(jinja2.meta.find_undeclared_variables(env.parse(chat_template)))


@functools.cache
def _compiled_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    _configure(env)
    return env


@functools.lru_cache(maxsize=8)
def _bounded(chat_template: str, max_chars: int) -> jinja2.Template:
    """A request's template, compiled in the bounded sandbox (`template_budget.py`)."""
    return bounded_environment(_configure, max_chars).from_string(chat_template)


def _configure(env: jinja2.Environment) -> None:
    """What transformers gives a chat template beyond jinja2's own."""
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja2's own `tojson` escapes HTML characters, which would change the prompt.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)
