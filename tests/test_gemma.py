"""Gemma 2 and Gemma 3 (`gracelm/model/gemma.py`) against transformers, on tiny random-weight models made
here, in float32: logits within `test_model_parity.ATOL` for every way the engine attends (short prompts
batched, longer ones alone, chunks after cached context, decode steps, batch-invariant tiles), with a
sliding window of 8 tokens that every prompt here crosses; greedy tokens equal to `generate`'s; the same from
GGUF files written as llama.cpp's converter writes them (norms stored as 1 + weight, no logits head, the
attention scale and the layers' pattern left to the reader). What the engine cannot honour is refused by
name, at start (exit 3).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from gracelm.config import UnsupportedModelError
from gracelm.lifecycle.exit_codes import ExitCode
from gracelm.model.batch_invariant import make_batch_invariant
from gracelm.model.gemma import GemmaForCausalLM
from gracelm.model.loader import load_model
from gracelm.model.model_files import config_from_hf
from tests.server_process import ServerProcess
from tests.test_gguf import VOCAB as GGUF_VOCAB
from tests.test_gguf import gguf_name, write_gguf
from tests.test_model_parity import (
    PagedRunner,
    assert_greedy_equals_generate,
    assert_matches,
    random_tokens,
    reference_logits,
)
from tests.tiny_models import tiny_model

WINDOW = 8
COMMON = {"num_hidden_layers": 3, "head_dim": 16, "sliding_window": WINDOW, "tie_word_embeddings": True,
          "query_pre_attn_scalar": 24}  # not head_dim: the scale must come from it
VARIANTS = {
    # Gemma 2: layers 0 and 2 slide; scores and logits soft-capped (transformers' defaults, 50 and 30).
    "gemma2": ("gemma2", COMMON),
    # Gemma 3: q/k norms, every 2nd layer global with linear rope scaling, the sliding ones at their own
    # theta; logits capped tightly enough to bite.
    "gemma3": ("gemma3", {**COMMON, "sliding_window_pattern": 2, "final_logit_softcapping": 5.0,
                          "rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
}
Models = tuple[GemmaForCausalLM, torch.nn.Module]


def _reference(directory: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                attn_implementation="eager").eval()


@pytest.fixture(scope="module", params=list(VARIANTS))
def models(request: pytest.FixtureRequest) -> Models:
    """Our frozen model (as the engine runs it) and transformers' of one tiny directory."""
    arch, overrides = VARIANTS[request.param]
    directory = tiny_model(arch, **overrides)
    ours = load_model(directory, dtype="float32").model
    ours.freeze()
    return ours, _reference(directory)


def test_the_config_reaches_the_model(models: Models) -> None:
    ours, reference = models
    assert isinstance(ours, GemmaForCausalLM)
    hf = reference.config
    sliding = [layer.sliding for layer in ours.model.layers]
    assert sliding == [kind == "sliding_attention" for kind in hf.layer_types]
    assert any(sliding) and not all(sliding)
    assert ours.model.layers[0].self_attn.attention.scale == hf.query_pre_attn_scalar**-0.5
    assert ours.config.final_logit_softcapping == hf.final_logit_softcapping
    assert ours.config.context_limit() == (hf.max_position_embeddings, "max_position_embeddings")


def test_prompts_batched_and_alone_cross_the_window(models: Models) -> None:
    ours, reference = models
    # Up to 16 tokens attended in a padded batch, the 17 and 40 alone (`attention.PrefillBatch`).
    prompts = [random_tokens(n, seed=n) for n in (7, 1, 12, 3, 16, 17, 40)]
    for prompt, logits in zip(prompts, PagedRunner(ours).step(list(enumerate(prompts))), strict=True):
        assert_matches(logits, reference_logits(reference, prompt))


def test_chunks_after_context_and_decode_steps(models: Models) -> None:
    ours, reference = models
    prompt, other = random_tokens(30, seed=1), random_tokens(6, seed=2)
    runner = PagedRunner(ours, seed=1)
    got = [runner.step([(0, prompt[:7]), (1, other)])[0]]
    got += runner.step([(0, prompt[7:8])])  # one token: the decode path
    got += runner.step([(1, [5]), (0, prompt[8:20])])[1:]  # a chunk after context, beside a decode
    got += runner.step([(0, prompt[20:])])
    for token in random_tokens(12, seed=3):
        got += runner.step([(0, [token]), (1, [token])])[:1]
    assert_matches(torch.cat(got), reference_logits(reference, runner.tokens[0]))


def test_batch_invariant_mode_computes_the_same() -> None:
    arch, overrides = VARIANTS["gemma2"]
    directory = tiny_model(arch, **overrides)
    ours = load_model(directory, dtype="float32").model
    ours.freeze()
    make_batch_invariant(ours)
    reference = _reference(directory)
    prompts = [random_tokens(n, seed=40 + n) for n in (5, 20)]
    runner = PagedRunner(ours, seed=5)
    for prompt, logits in zip(prompts, runner.step(list(enumerate(prompts))), strict=True):
        assert_matches(logits, reference_logits(reference, prompt))
    decoded = runner.step([(0, [3]), (1, [4])])
    assert_matches(decoded[1], reference_logits(reference, runner.tokens[1])[-1:])


def test_greedy_tokens_equal_transformers_generate(models: Models) -> None:
    ours, reference = models
    assert_greedy_equals_generate(ours, reference, random_tokens(9, seed=7), 16)


# llama.cpp's names of Gemma's layer tensors: `ffn_norm` is the norm before the MLP.
_GGUF_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def gguf_and_reference(directory: Path, arch: str, qtype: Q, layers: int) -> tuple[Path, torch.nn.Module]:
    """A tiny transformers Gemma and its GGUF file in llama.cpp's converter's layout, whose quantized
    matrices the transformers model takes back dequantized (so both compute the same function)."""
    import transformers

    names = {"gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
             "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM")}
    config = getattr(transformers, names[arch][0])(
        vocab_size=GGUF_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
        sliding_window=WINDOW, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=True)
    torch.manual_seed(0)
    reference = getattr(transformers, names[arch][1])(config).eval()
    tensors = {}
    with torch.no_grad():
        for name, param in reference.named_parameters():  # the tied logits head is the embedding
            param.copy_(torch.empty_like(param).uniform_(-0.5, 0.5) if "norm" in name
                        else torch.randn_like(param) * 0.1)
            value = param.numpy()
            if "norm" in name:
                value = value + 1.0  # the converter stores Gemma's 1 + weight
            elif qtype != Q.F32:
                blocks = gguf.quants.quantize(value, qtype)
                param.copy_(torch.from_numpy(gguf.quants.dequantize(blocks, qtype)))
            tensors[gguf_name(name, _GGUF_NAMES)] = value.copy()
    metadata = {"block_count": layers, "embedding_length": 64, "feed_forward_length": 128, "key_length": 16,
                "value_length": 16, "rope_dimension_count": 16, "layer_norm_rms_eps": 1e-6,
                "sliding_window": WINDOW}
    if arch == "gemma2":
        metadata |= {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}
    else:
        metadata |= {"rope_freq_base": 1_000_000.0}
    path = write_gguf(directory / f"{arch}.gguf", tensors, qtype, arch=arch, heads=(4, 2), metadata=metadata)
    return path, reference


# Gemma 3 with six layers: llama.cpp's pattern makes every 6th layer global, as transformers' default does.
@pytest.mark.parametrize("arch, qtype, layers", [("gemma2", Q.F32, 3), ("gemma3", Q.Q8_0, 6)],
                         ids=["gemma2-F32", "gemma3-Q8_0"])
def test_gguf_as_llamacpp_writes_it(tmp_path: Path, arch: str, qtype: Q, layers: int) -> None:
    path, reference = gguf_and_reference(tmp_path, arch, qtype, layers)
    loaded = load_model(path, dtype="float32")
    assert loaded.config.architecture == type(reference).__name__
    kinds = reference.config.layer_types
    assert loaded.config.sliding_layers == tuple(kind == "sliding_attention" for kind in kinds)
    model = loaded.model
    model.freeze()
    prompts = [[token % GGUF_VOCAB for token in random_tokens(n, seed=n)] for n in (12, 30)]
    runner = PagedRunner(model)
    for prompt, logits in zip(prompts, runner.step(list(enumerate(prompts))), strict=True):
        assert_matches(logits, reference_logits(reference, prompt))
    decoded = runner.step([(0, [7]), (1, [9])])
    assert_matches(decoded[1], reference_logits(reference, runner.tokens[1])[-1:])


GEMMA3_SHAPE = {"architectures": ["Gemma3ForCausalLM"], "vocab_size": 512, "hidden_size": 64,
                "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}


@pytest.mark.parametrize("hf, named", [
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"attention_bias": True}, "attention_bias"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ({"layer_types": ["sliding_attention", "chunked_attention"]}, "chunked_attention"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "yarn", "factor": 2.0}}}, "yarn"),
], ids=["bidirectional", "attention-bias", "gemma3-attention-softcap", "layer-type", "local-rope-scaling"])
def test_what_cannot_be_honoured_is_refused_by_name(hf: dict, named: str) -> None:
    with pytest.raises(UnsupportedModelError, match=named):
        config_from_hf({**GEMMA3_SHAPE, **hf})


def test_a_refused_feature_fails_the_start_with_exit_3() -> None:
    directory = tiny_model("gemma3", use_bidirectional_attention=True, num_hidden_layers=1, head_dim=16)
    process = ServerProcess(directory, wait_ready=False)
    try:
        assert process.wait_exit(120) == ExitCode.STARTUP_FAILURE
        assert "use_bidirectional_attention" in process.log()
    finally:
        process.close_log()


def test_transformers_4_configs_of_gemma3() -> None:
    """The older config.json: top-level `rope_theta`, `rope_scaling`, `rope_local_base_freq` and the pattern
    of sliding layers as one number."""
    config = config_from_hf({**GEMMA3_SHAPE, "num_hidden_layers": 6, "rope_theta": 1e6,
                                         "rope_local_base_freq": 1e4, "sliding_window_pattern": 3,
                                         "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    assert config.sliding_layers == (True, True, False, True, True, False)
    assert (config.rope_theta, config.rope_local_theta) == (1e6, 1e4)
    assert config.rope_scaling == {"rope_type": "linear", "factor": 8.0}
