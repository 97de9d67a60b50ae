"""Fast start (docs/architecture.md, "Start-up"): the converted tokenizer and weights are kept in the cache
directory and a hit gives exactly what a cold start gives, without transformers; a damaged entry is rebuilt,
never fatal; the weights cache stays bounded; a hash begun in a thread is the file's; the KV cache costs no
memset; the supervisor logs one start-up timeline and exposes it in /metrics; the progress line shows on a
terminal only."""

from __future__ import annotations

import gc
import io
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import gguf
import httpx
import numpy as np
import pytest
import torch
import xxhash
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file

import gracelm.startup_timeline as startup_timeline
from gracelm.config import ModelConfig
from gracelm.model import entry_keeper, file_hash, gguf_loader, weight_cache
from gracelm.model.attention import allocate_kv_cache
from gracelm.model.block_linear import BlockLinear
from gracelm.model.file_hash import content_hash
from gracelm.model.kernel_library import LOADED
from gracelm.model.load_progress import load_progress
from gracelm.model.loader import load_model
from gracelm.model.quantized_linear import Int4Linear
from gracelm.model.tokenizer import Tokenizer
from gracelm.model.tokenizer_cache import entry_path as tokenizer_entry
from gracelm.model.weight_cache import MAX_ENTRIES, cached_tensors
from gracelm.model.weight_cache import entry_path as weights_entry
from tests.resident_memory import resident_kb
from tests.server_process import ServerProcess
from tests.test_gguf import gguf_layout, hf_model, run_prefill, write_gguf
from tests.tiny_models import tiny_model

TEXT = "the cat runs <|im_end|> into the river"
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture
def gguf_file(tmp_path: Path) -> Path:
    """A tiny quantized GGUF file of its own (a content hash no other test shares)."""
    model = hf_model("llama", seed=7)
    return write_gguf(tmp_path / "tiny.gguf", gguf_layout(model, "llama"), Q.Q8_0)


def fingerprint(path: Path) -> tuple:
    """What a start gives: greedy tokens, logits, tokenizer ids and stop tokens."""
    loaded = load_model(path, dtype="float32")
    logits = run_prefill(loaded.model, list(range(3, 16)))
    tokenizer = loaded.tokenizer
    return (logits.argmax(-1).tolist(), logits, tokenizer.encode(TEXT), tokenizer.apply_chat_template(CHAT),
            tokenizer.eos_token_ids)


def test_a_cache_hit_equals_a_cold_start(gguf_file: Path) -> None:
    model_hash = content_hash(gguf_file)
    assert not weights_entry(model_hash, torch.float32).exists()
    cold = fingerprint(gguf_file)
    assert weights_entry(model_hash, torch.float32).is_file() and tokenizer_entry(model_hash).is_file()
    warm = fingerprint(gguf_file)
    assert cold[0] == warm[0]
    assert torch.equal(cold[1], warm[1])
    assert cold[2:] == warm[2:]


def test_a_load_counts_converting_as_repack_and_a_cache_hit_as_read(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The start-up timeline's marks of a GGUF load (`startup_timeline.LOAD_WORK`): the header read, the
    content verified, the weights converted on a cold start and read from the cache on a warm one."""
    gguf_file = write_gguf(tmp_path / "own.gguf", gguf_layout(hf_model("llama", seed=13), "llama"), Q.Q8_0)
    timeline = startup_timeline.begin()
    monkeypatch.setattr(startup_timeline, "_current", timeline)  # the suite's process has no timeline after
    marks = []
    for _ in range(2):
        timeline.marks.clear()
        load_model(gguf_file, dtype="float32")
        marks.append([phase for phase, _ in timeline.marks])
    assert marks[0] == ["read", "verify", "repack", "model"], marks  # the tokenizer: at its first use
    assert marks[1] == ["read", "verify", "read", "model"], marks
    assert [part.split()[0] for part in timeline.load_split().split(", ")] == list(startup_timeline.LOAD_WORK)


@pytest.mark.parametrize("size", [0, 1, (64 << 20) + 12345])
def test_a_files_hash_is_the_xxh3_of_all_its_bytes(tmp_path: Path, size: int) -> None:
    """The definition (XXH3-128 of the bytes, as `xxhash` computes it); one byte changed anywhere, or two
    parts swapped, changes it."""
    data = bytearray(os.urandom(size))
    path = tmp_path / "weights.bin"
    path.write_bytes(data)
    assert content_hash(path) == xxhash.xxh3_128_hexdigest(bytes(data))
    if size > 1:
        data[size // 2] ^= 1
        changed = tmp_path / "changed.bin"
        changed.write_bytes(data)
        swapped = tmp_path / "swapped.bin"
        swapped.write_bytes(data[size // 2:] + data[:size // 2])
        assert len({content_hash(path), content_hash(changed), content_hash(swapped)}) == 3


def test_a_prefetched_hash_is_the_files_and_a_failed_one_fails_as_a_hash_does(tmp_path: Path) -> None:
    """`file_hash.prefetch` (the engine core's, beside its imports): the next `content_hash` takes its result,
    a file changed since is hashed again, and a file that cannot be read raises as without a prefetch."""
    path = tmp_path / "weights.bin"
    path.write_bytes(os.urandom(3 << 20))
    file_hash.prefetch(path)
    assert content_hash(path) == xxhash.xxh3_128_hexdigest(path.read_bytes())
    path.write_bytes(b"other weights")
    file_hash.prefetch(path)
    assert content_hash(path) == xxhash.xxh3_128_hexdigest(b"other weights")
    missing = tmp_path / "missing.gguf"
    file_hash.prefetch(missing)
    with pytest.raises(FileNotFoundError):
        content_hash(missing)


def test_a_cache_hit_imports_no_transformers(gguf_file: Path) -> None:
    load_model(gguf_file, dtype="float32")  # fills the cache (the suite's, which the child inherits)
    code = ("import sys; from gracelm.model.loader import load_model; "
            f"load_model({str(gguf_file)!r}, dtype='float32'); print('transformers' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env=os.environ)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_the_load_parses_the_vocabulary_only_to_build_the_tokenizer(gguf_file: Path) -> None:
    """A warm start's tokenizer comes from the cache: its header read skips the string arrays (vocabulary,
    merges), which a tokenizer missing from the cache reads from the file then."""
    model_file = gguf_loader.open_gguf(gguf_file)
    assert model_file.gguf.metadata["tokenizer.ggml.tokens"] is None
    assert model_file.tokenizer().to_dict() == Tokenizer.from_gguf(gguf_file).to_dict()  # a miss: built


# What the server's command would wait for before its engine core starts, were they imported then: the HTTP
# stack and the serving code, the tokenizer and its templates, the grammar library, the version lookup,
# another command's options.
LOADED_WITH_THE_CORE = ("fastapi", "uvicorn", "pydantic", "prometheus_client", "jinja2", "tokenizers",
                        "llguidance", "importlib.metadata", "gracelm.model.tokenizer",
                        "gracelm.engine.output_processor", "gracelm.serving.serving_options",
                        "gracelm.deploy.config")


def test_the_server_imports_only_what_starts_its_core_before_it_starts() -> None:
    code = ("import sys, gracelm.cli.main as cli, gracelm.server.api_server; "
            "cli.build_parser('serve').parse_args(['serve', 'MODEL']); "
            f"print([name for name in {LOADED_WITH_THE_CORE!r} if name in sys.modules])")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env=os.environ)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize("damage", ["truncated", "garbage", "other tensors"])
def test_a_damaged_weights_entry_is_rebuilt_with_a_log_line(gguf_file: Path, damage: str,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    cold = fingerprint(gguf_file)
    entry = weights_entry(content_hash(gguf_file), torch.float32)
    data = entry.read_bytes()
    if damage == "truncated":
        entry.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        entry.write_bytes(os.urandom(len(data)))
    else:  # a valid safetensors file, of something else
        from safetensors.torch import save_file

        save_file({"model.embed_tokens.weight": torch.zeros(2, 2)}, entry)
    with caplog.at_level(logging.WARNING, logger="gracelm.model.weight_cache"):
        rebuilt = fingerprint(gguf_file)
    assert f"converted-weights cache entry {entry} is " in caplog.text
    assert "converting the weights again" in caplog.text
    assert torch.equal(rebuilt[1], cold[1]) and rebuilt[2:] == cold[2:]
    assert entry.read_bytes() == data  # rebuilt, the same bytes


@pytest.mark.parametrize("damage", [b"", b"{not json", b'{"backend": "{}"}'])
def test_a_damaged_tokenizer_entry_is_rebuilt_with_a_log_line(gguf_file: Path, damage: bytes,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    cold = fingerprint(gguf_file)
    entry = tokenizer_entry(content_hash(gguf_file))
    entry.write_bytes(damage)
    with caplog.at_level(logging.WARNING, logger="gracelm.model.tokenizer_cache"):
        rebuilt = fingerprint(gguf_file)
    assert f"tokenizer cache entry {entry} is unreadable" in caplog.text
    assert rebuilt[2:] == cold[2:]
    assert entry.stat().st_size > 1000  # written again, whole


def test_a_directory_model_keeps_its_tokenizer_too() -> None:
    directory = tiny_model("llama")
    first = load_model(directory).tokenizer
    assert tokenizer_entry(content_hash(directory)).is_file()
    again = load_model(directory).tokenizer
    assert again.encode(TEXT) == first.encode(TEXT) and again.eos_token_ids == first.eos_token_ids


def test_the_weights_cache_keeps_the_most_recently_used_entries(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRACELM_CACHE_DIR", str(tmp_path / "cache"))
    expected = {"w": ((2, 3), torch.float32)}
    hashes = [f"{i:064x}" for i in range(MAX_ENTRIES + 2)]
    folder = weights_entry(hashes[0], torch.float32).parent
    stale_version = folder / f"{hashes[0]}-float32-v0.safetensors"
    stale_version.write_bytes(b"old format")
    for i, model_hash in enumerate(hashes):
        cached_tensors(model_hash, torch.float32, expected, lambda tensors: tensors["w"].zero_())
        os.utime(weights_entry(model_hash, torch.float32), (1000 + i, 1000 + i))
        if i == 1:  # used again: the newest for a while
            cached_tensors(hashes[0], torch.float32, expected, lambda _: pytest.fail("a hit converts none"))
            os.utime(weights_entry(hashes[0], torch.float32), (5000, 5000))
    kept = sorted(p.name for p in folder.iterdir())
    assert len(kept) == MAX_ENTRIES
    assert weights_entry(hashes[0], torch.float32).name in kept  # recently used, older by its writing
    assert weights_entry(hashes[1], torch.float32).name not in kept
    assert not stale_version.exists()


@pytest.mark.parametrize("refusal", ["no room for the file", "no temporary file"])
def test_an_unwritable_cache_serves_anyway(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refusal: str,
                                           caplog: pytest.LogCaptureFixture) -> None:
    """A full disk (the entry's writes refused) or a read-only one: the weights are converted into memory and
    served, with a warning, and no file is left, the entry's lock file included."""
    monkeypatch.setenv("GRACELM_CACHE_DIR", str(tmp_path / "cache"))

    def refuse(*args: object) -> None:
        raise OSError(28, "No space left on device")

    if refusal == "no room for the file":
        monkeypatch.setattr(os, "pwrite", refuse)
    else:
        monkeypatch.setattr(entry_keeper, "write_atomic", refuse)
    expected = {"w": ((2,), torch.float32)}
    weights = cached_tensors("ab" * 32, torch.float32, expected, lambda tensors: tensors["w"].fill_(1.0))
    assert torch.equal(weights["w"], torch.ones(2))
    assert "cannot keep the converted weights" in caplog.text
    assert list(weights_entry("ab" * 32, torch.float32).parent.iterdir()) == []


# Tensors of every element size and alignment: a dtype of each size, a scalar, an empty tensor, and a stack of
# three matrices' blocks whose last tile is partial.
_KINDS = {"f64": ((3,), torch.float64), "f32": ((5, 3), torch.float32), "i32": ((7,), torch.int32),
          "bf16": ((3, 5), torch.bfloat16), "f16": ((1,), torch.float16), "i16": ((3,), torch.int16),
          "u8": ((13,), torch.uint8), "i8": ((2, 2), torch.int8), "bool": ((5,), torch.bool),
          "scalar": ((), torch.float32), "empty": ((0, 4), torch.bfloat16)}
_STACK_ROWS = (32, 48, 40)


def _blocks_of(rows: int, seed: int) -> np.ndarray:
    weights = np.random.default_rng(seed).normal(0.0, 0.05, (rows, 96)).astype(np.float32)
    return gguf.quants.quantize(weights, Q.Q4_1)


def _fill_every_kind(tensors: dict[str, torch.Tensor]) -> None:
    """Writes values of its own into every tensor of `_KINDS`, and the stack's blocks."""
    for name, tensor in tensors.items():
        if name == "stack.packed":
            BlockLinear.pack_into([torch.from_numpy(_blocks_of(rows, rows)) for rows in _STACK_ROWS], Q.Q4_1,
                                  {"packed": tensor})
        else:
            tensor.copy_(torch.arange(tensor.numel()).view(tensor.shape) * 3 % 7 - 2)


def _garbage(expected: weight_cache.Expected) -> dict[str, torch.Tensor]:
    """Tensors of `expected` full of bytes that no conversion writes, for a fill to overwrite."""
    tensors = {name: torch.empty(shape, dtype=dtype) for name, (shape, dtype) in expected.items()}
    for tensor in tensors.values():
        tensor.view(-1).view(torch.uint8).fill_(0xA5 if tensor.dtype != torch.bool else 1)
    return tensors


def _same_bytes(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Whether `a` and `b` hold tensors of the same names, shapes, dtypes and bytes."""
    def as_bytes(t: torch.Tensor) -> torch.Tensor:
        return t.contiguous().view(-1).view(torch.uint8)

    return a.keys() == b.keys() and all(
        a[n].dtype == b[n].dtype and a[n].shape == b[n].shape and torch.equal(as_bytes(a[n]), as_bytes(b[n]))
        for n in a)


@pytest.mark.skipif(not LOADED, reason="gracelm._kernels is not built")
def test_an_entry_is_written_from_the_tensors_served_as_safetensors_reads_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cold start's entry, written from the tensors it serves: safetensors' `load_file` reads exactly what
    the same conversion writes into memory, each tensor aligned to its element's size; the tensors served
    are memory of their own, not a view of the file, and no mapping of the file is left."""
    monkeypatch.setenv("GRACELM_CACHE_DIR", str(tmp_path / "cache"))
    stack_form = BlockLinear.stored_form_of((sum(_STACK_ROWS), 96), Q.Q4_1)
    expected = {**_KINDS, "stack.packed": stack_form["packed"]}
    served = cached_tensors("cd" * 32, "mixed", expected, _fill_every_kind)
    entry = weights_entry("cd" * 32, "mixed")
    assert _mappings_of(entry.parent) == []
    in_memory = _garbage(expected)
    _fill_every_kind(in_memory)
    stack = torch.cat([BlockLinear.from_file(_blocks_of(rows, rows), Q.Q4_1).packed for rows in _STACK_ROWS])
    assert torch.equal(in_memory["stack.packed"], stack)  # the partial last tile's padding too
    assert _same_bytes(load_file(entry), in_memory)
    assert _same_bytes(served, in_memory)
    assert all(t.data_ptr() % t.element_size() == 0 for t in served.values())
    assert int.from_bytes(entry.read_bytes()[:8], "little") % 8 == 0  # the data starts 8-aligned
    data = entry.read_bytes()
    served["f32"].fill_(99.0)
    assert entry.read_bytes() == data
    assert sorted(p.name for p in entry.parent.iterdir()) == [entry.name]  # no lock or temporary file


def _mappings_of(folder: Path) -> list[str]:
    """This process's memory mappings of files in `folder` (/proc/self/maps lines)."""
    return [line for line in Path("/proc/self/maps").read_text().splitlines() if str(folder) in line]


@pytest.mark.parametrize("failure", [RuntimeError, OSError], ids=["error", "unreadable source"])
def test_a_converter_that_raises_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               failure: type[Exception], caplog: pytest.LogCaptureFixture
                                               ) -> None:
    """The converter's error reaches the caller as it is (an OSError of its own is no cache failure to
    serve around), once half the tensors are written: no entry, no temporary file, and no mapping once the
    error is gone."""
    monkeypatch.setenv("GRACELM_CACHE_DIR", str(tmp_path / "cache"))
    expected = {"a": ((64,), torch.float32), "b": ((64,), torch.float32)}

    def fail_half_way(tensors: dict[str, torch.Tensor]) -> None:
        tensors["a"].fill_(1.0)
        raise failure("the converter's own failure")

    with pytest.raises(failure, match="the converter's own failure"):
        cached_tensors("ef" * 32, torch.float32, expected, fail_half_way)
    folder = weights_entry("ef" * 32, torch.float32).parent
    assert list(folder.iterdir()) == []
    assert "cannot keep the converted weights" not in caplog.text
    gc.collect()
    assert _mappings_of(folder) == []


@pytest.mark.skipif(not LOADED, reason="gracelm._kernels is not built")
@pytest.mark.parametrize("kind", ["bfloat16", "blocks", "int4"])
def test_a_gguf_models_entry_is_its_conversion_into_memory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """A GGUF model's entries (dense, the blocks with q/k/v and gate/up stacked, torch's int4 form) written
    on a cold start read back with `load_file` as the conversion into memory of garbage gives them, and the
    model's file is unmapped once converted."""
    monkeypatch.setenv("GRACELM_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "m.gguf", gguf_layout(hf_model("llama", seed=21), "llama"), Q.Q4_1)
    calls = []

    def recorded(model_hash: str, entry_kind: object, expected: weight_cache.Expected,
                 fill: weight_cache.Fill) -> dict[str, torch.Tensor]:
        calls.append((entry_kind, expected, fill))
        return cached_tensors(model_hash, entry_kind, expected, fill)

    monkeypatch.setattr(gguf_loader, "cached_tensors", recorded)
    model = gguf_loader.open_gguf(path)
    if kind == "bfloat16":
        model.weights(torch.bfloat16)
    else:
        model.low_bit_weights(BlockLinear if kind == "blocks" else Int4Linear)
    [(entry_kind, expected, fill)] = calls
    assert path.name not in "".join(_mappings_of(path.parent))
    in_memory = _garbage(expected)
    fill(in_memory)
    assert _same_bytes(load_file(weights_entry(model.model_hash, entry_kind)), in_memory)
    if kind == "blocks":
        assert any("+" in name for name in expected), expected  # stacks


def test_the_kv_cache_is_zero_and_writable() -> None:
    config = ModelConfig.from_hf_config({"architectures": ["LlamaForCausalLM"], "vocab_size": 8,
                                         "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
                                         "num_attention_heads": 2, "num_key_value_heads": 1,
                                         "max_position_embeddings": 64, "rms_norm_eps": 1e-6})
    caches = allocate_kv_cache(config, num_blocks=5, block_size=4, dtype=torch.bfloat16)
    assert [tuple(c.shape) for c in caches] == [(2, 1, 5, 4, 8)] * 2
    assert all(c.dtype == torch.bfloat16 and c.is_contiguous() and not c.any() for c in caches)
    caches[0][0, 0, 3] = 1.5  # one block of keys: 4 tokens of 8 values
    assert caches[0].sum() == 4 * 8 * 1.5 and not caches[1].any()  # layers do not share memory


def test_the_kv_cache_maps_memory_only_where_written() -> None:
    config = ModelConfig.from_hf_config({"architectures": ["LlamaForCausalLM"], "vocab_size": 8,
                                         "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 1,
                                         "num_attention_heads": 4, "num_key_value_heads": 2,
                                         "max_position_embeddings": 64, "rms_norm_eps": 1e-6})
    cache = allocate_kv_cache(config, num_blocks=8192, block_size=16, dtype=torch.bfloat16)[0]  # 16 MiB
    assert resident_kb(cache) == 0
    cache[0, 0, 0] = 1.0  # one block of keys
    assert 0 < resident_kb(cache) <= 2048  # a page: 4 KB (2 MB where every mapping is huge)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("terminal", [True, False])
def test_the_progress_line_shows_on_a_terminal_only(monkeypatch: pytest.MonkeyPatch, terminal: bool) -> None:
    stream = _Terminal() if terminal else io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    assert list(load_progress(range(3), 3, "converting weights")) == [0, 1, 2]
    assert ("converting weights: 100%" in stream.getvalue()) == terminal


PHASES = ("boot", "bind", "prepare", "spawn", "core_import", "read", "model", "tokenizer", "repack",
          "kv_cache", "warmup", "scheduler", "handoff", "frontend", "http_import", "http")


def test_the_start_up_timeline_is_logged_once_and_in_metrics() -> None:
    with ServerProcess(tiny_model("llama"), "--kv-cache-memory", "1MiB", "--num-threads", "1",
                       "--stats-interval", "0") as server:
        metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
        log = server.log()
    lines = [line for line in log.splitlines() if "start-up timeline (ms): " in line]
    assert len(lines) == 1, log[-3000:]
    load = re.findall(r"model load: read [\d.]+ s, verify [\d.]+ s, repack [\d.]+ s, compile [\d.]+ s, "
                      r"warmup [\d.]+ s", log)
    assert len(load) == 1, log[-3000:]
    timeline = dict(part.rsplit(" ", 1) for part in lines[0].split("start-up timeline (ms): ")[1].split(", "))
    assert tuple(timeline) == (*PHASES, "total"), lines[0]
    assert all(int(ms) >= 0 for ms in timeline.values())
    assert abs(sum(int(timeline[p]) for p in PHASES) - int(timeline["total"])) <= len(PHASES)
    gauges = dict(re.findall(r'gracelm_startup_phase_seconds\{[^}]*phase="(\w+)"\} (\S+)', metrics))
    assert set(gauges) == {*PHASES, "total"}
    assert float(gauges["total"]) == pytest.approx(int(timeline["total"]) / 1000, abs=0.002)
