"""Tiny random-weight Hugging Face model directories, made on the fly for tests (nothing is downloaded).

`make_tiny_model(dir, arch)` writes config.json, model.safetensors and a byte-level BPE tokenizer trained
here on generated text, with a ChatML chat template; `make_tiny_embedding_model` a Qwen3-Embedding
look-alike (`tiny_embedding_model` once a session). Same arguments, same bytes: weights come from a fixed
seed and the text and the trainer are deterministic. `tiny_model(arch, **overrides)` makes each variant
once per test session, in a temporary directory removed at exit.
"""

from __future__ import annotations

import atexit
import json
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
VOCAB_SIZE = 512

_BASE_SHAPE: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
}
_WORDS = (
    "the a an cat dog bird model token server request answer question river stone light night day "
    "runs jumps reads writes sees finds makes takes gives quick slow red blue green small large old new "
    "and but or because when while after before under over into with from about quietly happily"
).split()


def _hf_classes(arch: str) -> tuple[type, type]:
    import transformers

    names = {
        "llama": ("LlamaConfig", "LlamaForCausalLM"),
        "mistral": ("MistralConfig", "MistralForCausalLM"),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
        "phi3": ("Phi3Config", "Phi3ForCausalLM"),
        "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
        "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
        "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
        "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
        "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
        "olmoe": ("OlmoeConfig", "OlmoeForCausalLM"),
    }
    if arch not in names:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose from {', '.join(names)}")
    config_name, model_name = names[arch]
    return getattr(transformers, config_name), getattr(transformers, model_name)


def training_text(lines: int = 300, seed: int = 0) -> list[str]:
    """English-like sentences from a small word list: enough for BPE to learn a few hundred merges."""
    rng = random.Random(seed)
    return [
        " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 14))).capitalize() + rng.choice(".?!")
        for _ in range(lines)
    ]


def _write_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(training_text(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(directory)


def make_tiny_model(directory: str | Path, arch: str = "llama", **config_overrides: Any) -> Path:
    """Writes a complete tiny HF model directory (float32 safetensors, tokenizer, chat template)."""
    config_cls, model_cls = _hf_classes(arch)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = config_cls(**{**_BASE_SHAPE, **config_overrides})
    torch.manual_seed(0)
    model = model_cls(config).to(torch.float32).eval()
    # The default init (std 0.02) gives nearly uniform logits; wider weights make the parity tests bite.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.1)
    model.save_pretrained(directory, safe_serialization=True)
    _write_tokenizer(directory)
    return directory


# sentence-transformers' modules of an embedding model: the transformer, its Pooling, and Normalize.
_ST_MODULES = [{"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{kind}"}
               for i, (path, kind) in enumerate([("", "Transformer"), ("1_Pooling", "Pooling"),
                                                 ("2_Normalize", "Normalize")])]
POOLING_MODES = ("lasttoken", "mean_tokens", "cls_token")


def make_tiny_embedding_model(directory: str | Path, pooling: str = "lasttoken",
                              **config_overrides: Any) -> Path:
    """A tiny Qwen3 decoder laid out as Qwen3-Embedding is: the weights under the names Qwen3Model saves (no
    `model.` prefix, no logits head) and sentence-transformers' files, pooling by `pooling` (one of
    `POOLING_MODES`) and normalising."""
    from safetensors.torch import load_file, save_file

    directory = make_tiny_model(directory, "qwen3", **config_overrides)
    weights = directory / "model.safetensors"
    state = load_file(weights)
    decoder = {name.removeprefix("model."): t for name, t in state.items() if not name.startswith("lm_head.")}
    save_file(decoder, weights, metadata={"format": "pt"})
    (directory / "modules.json").write_text(json.dumps(_ST_MODULES))
    flags = {f"pooling_mode_{mode}": mode == pooling for mode in POOLING_MODES}
    hidden = json.loads((directory / "config.json").read_text())["hidden_size"]
    (directory / "1_Pooling").mkdir()
    (directory / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": hidden,
                                                                      **flags}))
    (directory / "2_Normalize").mkdir()
    return directory


_session_dir: Path | None = None
_made: dict[str, Path] = {}


def tiny_model(arch: str = "llama", **config_overrides: Any) -> Path:
    """`make_tiny_model` once per (arch, overrides) in this process; the directory is shared, read-only."""
    return _once(make_tiny_model, arch, **config_overrides)


def tiny_embedding_model(pooling: str = "lasttoken", **config_overrides: Any) -> Path:
    """`make_tiny_embedding_model` once per (pooling, overrides) in this process, as `tiny_model`."""
    return _once(make_tiny_embedding_model, pooling, **config_overrides)


def _once(make: Any, variant: str, **config_overrides: Any) -> Path:
    global _session_dir
    key = json.dumps([make.__name__, variant, config_overrides], sort_keys=True)
    if key not in _made:
        if _session_dir is None:
            _session_dir = Path(tempfile.mkdtemp(prefix="gracelm-tiny-models-"))
            atexit.register(shutil.rmtree, _session_dir, True)
        _made[key] = make(_session_dir / f"{variant}-{len(_made)}", variant, **config_overrides)
    return _made[key]
