"""`gracelm tokenizer [MODEL] --out DIR`: the tokenizer gracelm serves MODEL with, written as a Hugging Face
tokenizer directory, for the tools that count and render prompts with transformers on their side (guidellm's
`--processor`, lm-eval's `tokenizer=`), which a GGUF file does not give them.

DIR gets two files, all that `transformers.AutoTokenizer.from_pretrained(DIR)` reads:

- `tokenizer.json`: the `tokenizers` serialization of the very tokenizer the server encodes with (built as
  the engine builds it, `Tokenizer.from_gguf` or `from_dir`, and from the same cache);
- `tokenizer_config.json`: the class `PreTrainedTokenizerFast` (known to every transformers version), the
  special tokens the chat template may name (bos, eos, unk, pad), the chat template (the model's, or
  `--chat-template`'s, read as `serve` reads it), kept here rather than in `chat_template.jinja` since every
  transformers version reads it here, and `clean_up_tokenization_spaces: false`, as gracelm decodes.

So the directory encodes, decodes and renders chats exactly as the server does. DIR must be new or empty:
nothing is overwritten silently. `--force` replaces an earlier export, a DIR holding only these files, and
never a directory holding anything else.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from gracelm.cache_dir import write_atomic
from gracelm.lifecycle.exit_codes import ExitCode
from gracelm.model.file_hash import content_hash
from gracelm.model.model_files import resolve_model_path
from gracelm.model.tokenizer import Tokenizer
from gracelm.model.tokenizer_cache import cached_tokenizer
from gracelm.serving.chat_template_option import read_chat_template

FILES = ("tokenizer.json", "tokenizer_config.json")


def run(args: argparse.Namespace) -> int:
    """Writes the tokenizer directory; a bad MODEL, DIR or template is a usage error (exit 2)."""
    try:
        out = _checked_out_dir(Path(args.out), args.force)
        template = None if args.chat_template is None else _template(args.chat_template)
        tokenizer = _model_tokenizer(args.model_path)
        _write(tokenizer, template or tokenizer.chat_template, out)
    except (ValueError, OSError) as exc:  # a model or file refused, named by the message
        print(f"gracelm tokenizer: {exc}", file=sys.stderr)
        return ExitCode.USAGE
    print(f"wrote {out}: {', '.join(FILES)} ({tokenizer.name}, {tokenizer.vocab_size} tokens)")
    return ExitCode.CLEAN_STOP


def _checked_out_dir(out: Path, force: bool) -> Path:
    """`out` if it may be written: new or empty, or with `force` an earlier export; else a `ValueError`."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a directory")
    present = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if present and not force:
        raise ValueError(f"--out {out} is not empty ({', '.join(present[:4])}"
                         f"{', ...' if len(present) > 4 else ''}); name a new directory, or add --force to "
                         f"replace an earlier export")
    foreign = [name for name in present if name not in FILES]
    if foreign:
        raise ValueError(f"--out {out} holds files of its own ({', '.join(foreign[:4])}); --force replaces "
                         f"only an earlier export ({' and '.join(FILES)}), name another directory")
    return out


def _model_tokenizer(model: str | None) -> Tokenizer:
    """The tokenizer `gracelm serve MODEL` encodes with (None: the default model), from the server's cache
    when it has one."""
    path = resolve_model_path(model)
    if path.is_dir():
        return cached_tokenizer(content_hash(path), lambda: Tokenizer.from_dir(path))
    return cached_tokenizer(content_hash(path), lambda: Tokenizer.from_gguf(path))


def _write(tokenizer: Tokenizer, chat_template: str | None, out: Path) -> None:
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **tokenizer.special_tokens,
              "clean_up_tokenization_spaces": False}
    if chat_template:
        config["chat_template"] = chat_template
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "tokenizer.json", tokenizer.backend_json().encode())
    text = json.dumps(config, indent=2, ensure_ascii=False) + "\n"
    write_atomic(out / "tokenizer_config.json", text.encode())


def _template(value: str) -> str:
    try:
        return read_chat_template(value)
    except ValueError as exc:
        raise ValueError(f"--chat-template {exc}") from None
