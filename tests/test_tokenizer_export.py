"""`gracelm tokenizer [MODEL] --out DIR`: the directory it writes loads with `transformers.AutoTokenizer` and
encodes, decodes and renders chats exactly as gracelm's own tokenizer, for the default model's GGUF file and
for Hugging Face directories (one whose tokenizer adds a BOS); a bad MODEL, a DIR in use or a bad template
is a usage error that writes nothing."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import processors

from gracelm.cli.tokenizer_export import FILES
from gracelm.model.model_files import default_model_path
from gracelm.model.tokenizer import Tokenizer
from tests.server_process import GRACELM
from tests.test_tokenizer import CONVERSATIONS, TEXTS
from tests.tiny_models import tiny_model


def _export(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(GRACELM), "tokenizer", *args], capture_output=True, text=True, timeout=120)


def _with_bos(tmp_path: Path) -> Path:
    """A tiny model's tokenizer files, its tokenizer made to add a BOS to every encoding (as Llama's does)."""
    model = tmp_path / "with-bos"
    model.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tiny_model("llama") / name, model / name)
    raw = RawTokenizer.from_file(str(model / "tokenizer.json"))
    bos = json.loads((model / "tokenizer_config.json").read_text())["bos_token"]
    raw.post_processor = processors.TemplateProcessing(single=f"{bos} $A",
                                                       special_tokens=[(bos, raw.token_to_id(bos))])
    raw.save(str(model / "tokenizer.json"))
    return model


def _model(kind: str, tmp_path: Path) -> Path:
    if kind == "default":
        return default_model_path()
    return tiny_model("llama") if kind == "tiny" else _with_bos(tmp_path)


@pytest.mark.parametrize("kind", ["default", "tiny", "tiny-with-bos"])
def test_the_directory_loads_with_transformers_and_encodes_as_gracelm(kind: str, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    model, out = _model(kind, tmp_path), tmp_path / "out"
    result = _export(str(model), "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert f"wrote {out}" in result.stdout
    assert sorted(p.name for p in out.iterdir()) == sorted(FILES)
    ours = Tokenizer.from_gguf(model) if model.suffix == ".gguf" else Tokenizer.from_dir(model)
    hf = AutoTokenizer.from_pretrained(out)
    assert {"bos_token": hf.bos_token, "eos_token": hf.eos_token}.items() <= ours.special_tokens.items()
    for text in TEXTS:
        for add in (True, False):
            assert hf.encode(text, add_special_tokens=add) == ours.encode(text, add_special_tokens=add)
        ids = ours.encode(text)
        for skip in (True, False):
            assert hf.decode(ids, skip_special_tokens=skip) == ours.decode(ids, skip_special_tokens=skip)
    if kind == "tiny-with-bos":
        assert hf.encode("the cat")[0] == ours.bos_token_id
    for messages in CONVERSATIONS:
        for prompt in (True, False):
            rendered = hf.apply_chat_template(messages, add_generation_prompt=prompt, return_dict=True)
            assert list(rendered["input_ids"]) == ours.apply_chat_template(messages, prompt)


def test_chat_template_option_replaces_the_models(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    out = tmp_path / "out"
    assert _export(str(tiny_model("llama")), "--out", str(out), "--chat-template", template).returncode == 0
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == template
    hf = AutoTokenizer.from_pretrained(out)
    assert hf.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "<user>hi"


def test_a_bad_model_dir_or_template_is_a_usage_error_that_writes_nothing(tmp_path: Path) -> None:
    model, out, missing = str(tiny_model("llama")), tmp_path / "out", tmp_path / "missing.gguf"
    not_a_model = str(tiny_model("llama") / "config.json")
    (tmp_path / "a-file").write_text("")
    refusals = [
        ((str(missing), "--out", str(out)), f"model path {missing} does not exist"),
        ((not_a_model, "--out", str(out)), "neither a Hugging Face model directory"),
        ((model, "--out", str(out), "--chat-template", "no-such-file"), "--chat-template is neither a file"),
        ((model, "--out", str(tmp_path / "a-file")), "exists and is not a directory"),
    ]
    for args, problem in refusals:
        result = _export(*args)
        assert (result.returncode, result.stdout) == (2, ""), result
        assert result.stderr.startswith("gracelm tokenizer: ") and problem in result.stderr, result.stderr
        assert not out.exists()
    assert _export(model, "--out", str(out)).returncode == 0
    again = _export(model, "--out", str(out))
    assert again.returncode == 2 and "is not empty" in again.stderr and "--force" in again.stderr
    assert _export(model, "--out", str(out), "--force").returncode == 0  # an earlier export is replaced
    (out / "notes.txt").write_text("mine")
    forced = _export(model, "--out", str(out), "--force")
    assert forced.returncode == 2 and "notes.txt" in forced.stderr
    assert (out / "notes.txt").read_text() == "mine"
    assert _export("--out", str(tmp_path / "default")).returncode == 0  # MODEL left out: the default model
    usage = subprocess.run([str(GRACELM), "tokenizer", model], capture_output=True, text=True, timeout=60)
    assert usage.returncode == 2 and "--out" in usage.stderr
