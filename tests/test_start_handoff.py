"""What the frontend does while the engine core starts (docs/architecture.md, "Start-up"): it reads the
model's tokenizer from the cache, or builds a GGUF file's from its metadata, beside the core's start. For a
GGUF file whose tokenizer the `tokenizers` library builds alone, the core builds none before Ready and sends
none: the frontend's is taken where it is of the file the core loaded, and kept in the cache; otherwise the
core sends its own, and the frontend's is taken only where it is that one. The frontend reads no model file
to find the task, which the core finds and sends in Ready. `known_hash` gives a kept hash without hashing;
`kept_tokenizer` reads an entry without repairing it, which is the core's part. The core's own tokenizer,
built or read from the cache at its first use, stays its serialized form until a request needs text
encoded."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as Q

import gracelm.engine.core as core_module
import gracelm.engine.early_tokenizer as early_tokenizer
import gracelm.model.tokenizer_cache as tokenizer_cache
from gracelm import Engine
from gracelm.cache_dir import ENV as CACHE_ENV
from gracelm.cache_dir import cache_dir
from gracelm.config import EngineConfig
from gracelm.engine import messages as msg
from gracelm.engine.core import EngineCore
from gracelm.model import file_hash
from gracelm.model.file_hash import content_hash, known_hash
from gracelm.model.gguf_loader import open_gguf
from gracelm.model.loader import load_model
from gracelm.model.model_files import ModelLoadError
from gracelm.model.token_constraints import GrammarCompiler
from gracelm.model.tokenizer import Tokenizer
from gracelm.model.tokenizer_cache import entry_path, kept_tokenizer
from gracelm.sampling_params import SamplingParams
from gracelm.structured_output import StructuredOutputs
from tests.test_gguf import gguf_layout, hf_model, write_gguf

ENGINE = {"dtype": "float32", "num_threads": 1, "enforce_eager": True}


@pytest.fixture
def gguf_file(tmp_path: Path) -> Path:
    """A tiny GGUF file of its own: a content hash no other test shares."""
    return write_gguf(tmp_path / "tiny.gguf", gguf_layout(hf_model("llama", seed=11), "llama"), Q.Q8_0)


def _index() -> str | None:
    index = cache_dir() / file_hash.INDEX
    return index.read_text() if index.exists() else None


def test_a_hash_is_known_once_kept_and_not_before_nor_after_a_change(tmp_path: Path) -> None:
    path = tmp_path / "weights.gguf"
    path.write_bytes(b"first weights")
    before = _index()
    assert known_hash(path) is None
    assert _index() == before  # nothing hashed, nothing kept
    assert known_hash(path.parent) is None  # a directory: its files' hashes are not all kept
    digest = content_hash(path)
    assert known_hash(path) == digest
    path.write_bytes(b"other weights, same directory")
    assert known_hash(path) is None
    assert known_hash(tmp_path / "missing.gguf") is None


def test_the_kept_tokenizer_is_the_entrys_and_a_damaged_entry_is_left_to_the_core(gguf_file: Path) -> None:
    model_file = open_gguf(gguf_file)
    assert kept_tokenizer(model_file.model_hash) is None  # not built yet
    built = model_file.tokenizer()  # built and kept
    kept = kept_tokenizer(model_file.model_hash)
    assert kept is not None and kept.to_dict() == built.to_dict()
    entry = entry_path(model_file.model_hash)
    entry.write_bytes(b"{not json")
    assert kept_tokenizer(model_file.model_hash) is None
    assert entry.read_bytes() == b"{not json"  # the core reports and rebuilds it


def _recording(monkeypatch: pytest.MonkeyPatch) -> list[Tokenizer | None]:
    """What the frontend's read of the tokenizer cache returned, each time."""
    read: list[Tokenizer | None] = []

    def recorded(model_hash: str) -> Tokenizer | None:
        read.append(kept_tokenizer(model_hash))
        return read[-1]

    monkeypatch.setattr(tokenizer_cache, "kept_tokenizer", recorded)  # imported by the frontend's read
    return read


def _greedy(engine: Engine) -> list[int]:
    [output] = engine.generate(["the cat runs"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    return output.outputs[0].token_ids


def _rebuilt(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """The serialized tokenizers the frontend rebuilt (the core's, after Ready, or a kept one), each time."""
    rebuilt: list[dict] = []
    from_dict = Tokenizer.from_dict.__func__  # type: ignore[attr-defined]

    def recorded(cls: type[Tokenizer], data: dict) -> Tokenizer:
        rebuilt.append(data)
        return from_dict(cls, data)

    monkeypatch.setattr(Tokenizer, "from_dict", classmethod(recorded))
    return rebuilt


def _kept_meanwhile() -> None:
    """Waits for the frontend's writes of the tokenizers it built (beside the first requests)."""
    for thread in threading.enumerate():
        if thread.name == "keep-tokenizer":
            thread.join(timeout=60)


def test_a_started_model_takes_its_tokenizer_from_the_cache_while_the_core_starts(
        gguf_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    read = _recording(monkeypatch)
    rebuilt = _rebuilt(monkeypatch)
    with Engine(str(gguf_file), **ENGINE) as cold:  # the file unknown: its tokenizer built from it here
        cold_tokenizer, cold_tokens = cold.tokenizer.to_dict(), _greedy(cold)
    _kept_meanwhile()
    assert read == [] and rebuilt == []  # neither read from the cache nor the core's rebuilt
    assert cold_tokenizer == Tokenizer.from_gguf(gguf_file).to_dict()
    assert kept_tokenizer(content_hash(gguf_file)).to_dict() == cold_tokenizer  # kept by the frontend
    rebuilt.clear()
    with Engine(str(gguf_file), **ENGINE) as warm:
        assert len(read) == 1 and read[0] is not None and warm.tokenizer is read[0]
        assert warm.tokenizer.to_dict() == cold_tokenizer and _greedy(warm) == cold_tokens
    assert rebuilt == [cold_tokenizer]  # the kept entry's, once


def test_the_core_builds_no_tokenizer_before_ready_where_the_frontend_builds_it(
        gguf_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A GGUF file whose tokenizer builds without transformers: the core's load neither builds nor reads it,
    and its Ready carries none; its own is built at the first use, and kept."""
    built: list[Path] = []
    from_gguf = Tokenizer.from_gguf.__func__  # type: ignore[attr-defined]

    def recorded(cls: type[Tokenizer], path: Path, metadata: dict | None = None) -> Tokenizer:
        built.append(path)
        return from_gguf(cls, path, metadata)

    monkeypatch.setattr(Tokenizer, "from_gguf", classmethod(recorded))
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))  # none of this file's tokenizer kept yet
    read = _recording(monkeypatch)
    config = EngineConfig(model=str(gguf_file), dtype="float32", num_threads=1, enforce_eager=True,
                          kv_cache_memory="1MiB", max_model_len=256)
    core = EngineCore(config)
    try:
        assert core.tokenizer_in_file and core_module._tokenizer_sent(core) is None
        assert built == [] and read == []
        assert core.tokenizer.to_dict() == core.tokenizer.to_dict() and len(built) == 1  # built once
        assert kept_tokenizer(content_hash(gguf_file)).to_dict() == core.tokenizer.to_dict()
    finally:
        core.executor.shutdown()


def test_the_cores_tokenizer_of_a_file_changed_since_the_load_is_refused(
        gguf_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Built at its first use, long after the load: where the file was replaced meanwhile (and the cache
    kept no tokenizer of the loaded one), it is refused, naming the file, rather than another model's."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    loaded = load_model(gguf_file, dtype="float32")
    model_hash = content_hash(gguf_file)
    other = write_gguf(tmp_path / "other.gguf", gguf_layout(hf_model("llama", seed=12), "llama"), Q.Q8_0)
    gguf_file.write_bytes(other.read_bytes())
    with pytest.raises(ModelLoadError, match=f"{gguf_file} changed since its model was loaded"):
        loaded.tokenizer  # noqa: B018
    assert not entry_path(model_hash).exists()  # nothing kept under the loaded model's hash


def test_a_gguf_kind_only_transformers_builds_is_sent_by_the_core(gguf_file: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The frontend cannot build it (it imports no transformers): the core builds it before Ready and sends
    it, and the frontend rebuilds that one."""
    import gracelm.model.loader as loader

    monkeypatch.setattr(loader, "builds_alone", lambda metadata: False)
    config = EngineConfig(model=str(gguf_file), dtype="float32", num_threads=1, enforce_eager=True,
                          kv_cache_memory="1MiB", max_model_len=256)
    core = EngineCore(config)
    try:
        assert not core.tokenizer_in_file
        assert core_module._tokenizer_sent(core) == Tokenizer.from_gguf(gguf_file).to_dict()
    finally:
        core.executor.shutdown()


def _ready(gguf_file: Path, model_hash: str, tokenizer: dict | None = None) -> msg.Ready:
    return msg.Ready(256, "tiny", {}, tokenizer, model_hash, 16)


def _got(value: early_tokenizer.Got) -> Future[early_tokenizer.Got]:
    future: Future[early_tokenizer.Got] = Future()
    future.set_result(value)
    return future


def test_a_tokenizer_built_here_is_taken_where_it_is_of_the_loaded_file_and_kept(
        gguf_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))  # none of this file's tokenizer kept yet
    got = early_tokenizer.read(str(gguf_file))  # before the core's hash is kept: kept after Ready
    assert got.tokenizer is not None and got.model_hash is None and got.stamp is not None
    model_hash = content_hash(gguf_file)
    assert not entry_path(model_hash).exists()
    taken = early_tokenizer.take(_ready(gguf_file, model_hash), str(gguf_file), _got(got))
    _kept_meanwhile()
    assert taken is got.tokenizer
    assert kept_tokenizer(model_hash).to_dict() == taken.to_dict()
    entry_path(model_hash).unlink()
    got = early_tokenizer.read(str(gguf_file))  # the hash kept meanwhile: kept at once
    assert got.model_hash == model_hash and kept_tokenizer(model_hash).to_dict() == taken.to_dict()
    assert early_tokenizer.take(_ready(gguf_file, model_hash), str(gguf_file), _got(got)) is got.tokenizer


def test_a_tokenizer_built_while_the_file_changed_is_neither_kept_nor_taken(
        gguf_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Replaced while the frontend built its tokenizer, the file's new hash (kept by the core) is not the
    tokenizer's: nothing is kept under it, and the tokenizer is not taken as the file's."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    other = write_gguf(tmp_path / "other.gguf", gguf_layout(hf_model("llama", seed=12), "llama"), Q.Q8_0)
    content_hash(gguf_file)
    build = Tokenizer.from_gguf_without_transformers.__func__  # type: ignore[attr-defined]

    def replaced_meanwhile(cls: type[Tokenizer], path: Path) -> Tokenizer | None:
        tokenizer = build(cls, path)
        gguf_file.write_bytes(other.read_bytes())
        content_hash(gguf_file)  # the new content's hash kept, as the core keeps it
        return tokenizer

    monkeypatch.setattr(Tokenizer, "from_gguf_without_transformers", classmethod(replaced_meanwhile))
    got = early_tokenizer.read(str(gguf_file))
    assert got.tokenizer is not None and got.stamp is None and got.model_hash is None
    assert not list(cache_dir("tokenizers").iterdir())


def test_a_tokenizer_read_before_the_file_changed_is_not_taken(gguf_file: Path, tmp_path: Path) -> None:
    """The file replaced after the frontend read it: it reads the file again, and takes that only where it
    is what the core loaded (its hash in Ready); else the start fails, naming the file."""
    original_hash = content_hash(gguf_file)
    got = early_tokenizer.read(str(gguf_file))
    other = write_gguf(tmp_path / "other.gguf", gguf_layout(hf_model("llama", seed=12), "llama"), Q.Q8_0)
    other_tokenizer = Tokenizer.from_gguf(other)
    assert other_tokenizer.to_dict() != got.tokenizer.to_dict()
    gguf_file.write_bytes(other.read_bytes())  # the core loaded this one
    taken = early_tokenizer.take(_ready(gguf_file, content_hash(other)), str(gguf_file), _got(got))
    assert taken is not got.tokenizer and taken.backend_json() == other_tokenizer.backend_json()
    with pytest.raises(RuntimeError, match=f"{gguf_file} changed while the engine core loaded it"):
        early_tokenizer.take(_ready(gguf_file, original_hash), str(gguf_file), _got(got))


def test_a_kept_tokenizer_of_another_model_is_not_taken(gguf_file: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    other = write_gguf(tmp_path / "other.gguf", gguf_layout(hf_model("llama", seed=12), "llama"), Q.Q8_0)
    open_gguf(other).tokenizer()  # kept, under the other file's hash
    asked: list[Path] = []

    def stale(path: Path) -> str | None:  # the first answer is the other file's: a stale index
        asked.append(path)
        return content_hash(other) if len(asked) == 1 else known_hash(path)

    monkeypatch.setattr(early_tokenizer, "known_hash", stale)
    read = _recording(monkeypatch)
    with Engine(str(gguf_file), **ENGINE) as engine:
        assert len(read) == 1 and read[0] is not None and engine.tokenizer is not read[0]
        assert engine.tokenizer.to_dict() == Tokenizer.from_gguf(gguf_file).to_dict()


def test_a_tokenizer_built_here_that_is_not_the_cores_is_not_taken(gguf_file: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the core sends its tokenizer (a kind only transformers builds), one got here that is another
    is not taken: the core's is rebuilt from its Ready."""
    other = write_gguf(tmp_path / "other.gguf", gguf_layout(hf_model("llama", seed=12), "llama"), Q.Q8_0)
    other_tokenizer = Tokenizer.from_gguf(other)
    core_tokenizer = Tokenizer.from_gguf(gguf_file).to_dict()
    assert other_tokenizer.to_dict() != core_tokenizer
    got = early_tokenizer.Got(other_tokenizer, None, None)
    rebuilt = _rebuilt(monkeypatch)
    taken = early_tokenizer.take(_ready(gguf_file, content_hash(gguf_file), core_tokenizer), str(gguf_file),
                                 _got(got))
    assert taken is not other_tokenizer and rebuilt == [core_tokenizer]


def test_the_frontend_builds_no_tokenizer_that_needs_transformers(gguf_file: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A GGUF kind that only transformers builds: the frontend's thread gives none (the core's is rebuilt
    after Ready), instead of importing transformers, and torch with it, into the HTTP process."""
    import gracelm.model.tokenizer as tokenizer_module

    def refused(path: Path) -> object:
        raise AssertionError("the frontend built a tokenizer through transformers")

    monkeypatch.setattr(tokenizer_module, "build_gguf_tokenizer", lambda metadata: None)
    monkeypatch.setattr(tokenizer_module, "_gguf_through_transformers", refused)
    assert early_tokenizer.begin(str(gguf_file)).result(timeout=60).tokenizer is None


def test_the_task_comes_from_the_core_and_a_header_the_frontend_failed_to_read_is_read_again(
        gguf_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The frontend reads a GGUF header only for the tokenizer, in a thread beside the core's start: a
    failure there costs a second read after Ready; the core, which reads the same file in its own process,
    finds the task."""
    import gracelm.model.gguf_reader as gguf_reader

    read_gguf = gguf_reader.read_gguf
    calls: list[Path] = []

    def failing_once(path: Path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 1:
            raise OSError("the frontend cannot read this GGUF header")
        return read_gguf(path, *args, **kwargs)

    monkeypatch.setattr(gguf_reader, "read_gguf", failing_once)
    with Engine(str(gguf_file), **ENGINE) as engine:
        assert engine.pooling is None and engine.config.task == "generate"
        assert len(calls) == 2
        assert engine.tokenizer.to_dict() == Tokenizer.from_gguf(gguf_file).to_dict()
        assert len(_greedy(engine)) == 4


def test_the_cores_tokenizer_is_built_only_where_a_request_needs_its_text_encoded(gguf_file: Path) -> None:
    """A warm start's engine core (its tokenizer from the cache) sends, fingerprints and compiles grammars
    from the serialized form: its start, warm-up included, builds no `tokenizers` object; encoding does."""
    config = EngineConfig(model=str(gguf_file), dtype="float32", num_threads=1, enforce_eager=True,
                          kv_cache_memory="1MiB", max_model_len=256)
    first = EngineCore(config)
    first.tokenizer  # noqa: B018 - built at its first use, and kept
    first.executor.shutdown()
    core = EngineCore(config)
    try:
        tokenizer = core.tokenizer
        assert tokenizer._backend is None
        compiler = GrammarCompiler(tokenizer, core.model_config.vocab_size)
        assert not compiler.matcher(StructuredOutputs(regex="[a-z]{2,5}")).is_error()
        assert tokenizer._backend is None
        built = open_gguf(gguf_file).tokenizer()
        assert tokenizer.to_dict() == built.to_dict() and tokenizer._backend is None
        assert tokenizer.encode("the cat runs") == built.encode("the cat runs")
        assert tokenizer._backend is not None
    finally:
        core.executor.shutdown()
