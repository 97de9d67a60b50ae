"""Mixtures of experts (`gracelm/model/moe.py`): Mixtral, Qwen2-MoE (its shared expert), Qwen3-MoE (top-k
renormalised) and OLMoE (q/k norms over the whole projection) give transformers' float32 logits within the
parity tests' tolerance (`tests/test_model_parity.py`), and its greedy tokens, over batched prefills and
decode steps whose sequences pick different experts while some expert is picked by none; from safetensors
(the hub's names, and transformers 5's stacked experts) and from GGUF files written here as llama.cpp's
converter writes them (stacked `ffn_*_exps`; F32 exactly, Q8_0 against its dequantized weights, and the
blocks' own kernel within its 8-bit error). What the engine cannot honour is refused by name.
"""

from __future__ import annotations

import logging
from pathlib import Path

import gguf
import numpy as np
import openai
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import save_file

from gracelm.config import EngineConfig, ModelConfig, UnsupportedModelError
from gracelm.model.batch_invariant import make_batch_invariant
from gracelm.model.gguf_loader import load_gguf
from gracelm.model.llama import LlamaForCausalLM, describe_linear_kernels, linear_path
from gracelm.model.loader import load_model
from gracelm.model.moe import SparseMoeBlock, route
from gracelm.parallel.decode_graph_build import graph_applies
from gracelm.parallel.layout import ShardingError, check_parallel_config
from tests.server_process import ServerProcess
from tests.test_gguf import HIDDEN, VOCAB, llamacpp_permute, run_prefill, write_gguf
from tests.test_model_parity import PagedRunner, assert_matches, random_tokens, reference_logits
from tests.tiny_models import tiny_model

EXPERTS = 8  # with 2 a token, a step of three decode tokens leaves some expert unpicked
MOE = {"num_experts_per_tok": 2}
FAMILIES: dict[str, dict] = {
    "mixtral": {**MOE, "num_local_experts": EXPERTS, "intermediate_size": 64},
    "qwen2_moe": {**MOE, "num_experts": EXPERTS, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 64},
    "qwen3_moe": {**MOE, "num_experts": EXPERTS, "moe_intermediate_size": 32, "norm_topk_prob": True},
    "olmoe": {**MOE, "num_experts": EXPERTS, "intermediate_size": 32},
}
ARCHITECTURES = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM"}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest) -> tuple[str, Path, torch.nn.Module]:
    from transformers import AutoModelForCausalLM

    directory = tiny_model(request.param, **FAMILIES[request.param])
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                     attn_implementation="eager").eval()
    return request.param, directory, reference


class ExpertCalls:
    """Which experts of each MoE layer ran, and how many times, over the forward passes since `clear`; and
    the experts each token of the last pass picked (from the router, as the block routes)."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.blocks = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoeBlock)]
        self.runs: list[dict[int, int]] = [{} for _ in self.blocks]
        self.picks: list[torch.Tensor] = [torch.empty(0) for _ in self.blocks]
        for i, block in enumerate(self.blocks):
            block.register_forward_hook(self._routed(i))
            for e, expert in enumerate(block.experts):
                expert.register_forward_hook(self._ran(i, e))

    def _routed(self, i: int):
        def hook(block: SparseMoeBlock, args: tuple, _: torch.Tensor) -> None:
            self.picks[i] = route(block.gate(args[0]), block.top_k, block.norm_topk_prob)[1]
        return hook

    def _ran(self, i: int, e: int):
        def hook(*_: object) -> None:
            self.runs[i][e] = self.runs[i].get(e, 0) + 1
        return hook

    def clear(self) -> None:
        self.runs = [{} for _ in self.blocks]


@pytest.mark.parametrize("frozen", [False, True], ids=["as-loaded", "frozen"])
def test_logits_and_greedy_tokens_equal_transformers(family: tuple, frozen: bool) -> None:
    name, directory, reference = family
    model = load_model(directory, dtype="float32").model
    assert model.config.architecture == ARCHITECTURES[name]
    if frozen:
        model.freeze()
    calls = ExpertCalls(model)
    prompts = {seq: random_tokens(n, seed=seq) for seq, n in ((0, 9), (1, 3), (2, 17))}
    runner = PagedRunner(model)
    for seq, logits in zip(prompts, runner.step(list(prompts.items())), strict=True):
        assert_matches(logits, reference_logits(reference, prompts[seq]))
    for _ in range(4):  # greedy decode steps of the three sequences together
        calls.clear()
        tokens = {seq: [int(reference_logits(reference, p)[-1].argmax())] for seq, p in prompts.items()}
        step = runner.step(list(tokens.items()))
        for (seq, token), logits in zip(tokens.items(), step, strict=True):
            prompts[seq] = prompts[seq] + token
            expected = reference_logits(reference, prompts[seq])[-1:]
            assert_matches(logits, expected)
            assert int(logits.argmax()) == int(expected.argmax())
        for runs, picks in zip(calls.runs, calls.picks, strict=True):
            picked = set(picks.flatten().tolist())
            assert len({frozenset(row.tolist()) for row in picks}) > 1  # the sequences pick different experts
            assert set(runs) == picked and set(runs.values()) == {1}  # each picked expert run once
            assert len(picked) < EXPERTS  # ... and some expert by none: not run


def test_stacked_experts_as_transformers_5_keeps_them(tmp_path: Path) -> None:
    """A checkpoint of transformers 5's in-memory names (`mlp.experts.gate_up_proj`, 3-D) loads too."""
    from transformers import AutoModelForCausalLM

    directory = tiny_model("mixtral", **FAMILIES["mixtral"])
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                     attn_implementation="eager").eval()
    state = reference.state_dict()
    assert any(t.dim() == 3 for t in state.values())
    for file in directory.iterdir():
        if file.suffix != ".safetensors":
            (tmp_path / file.name).symlink_to(file)
    save_file({name: t.contiguous() for name, t in state.items()}, tmp_path / "model.safetensors")
    prompt = random_tokens(11, seed=3)
    logits = PagedRunner(load_model(tmp_path, dtype="float32").model).step([(0, prompt)])[0]
    assert_matches(logits, reference_logits(reference, prompt))


def test_batch_invariant_mode_holds_for_experts() -> None:
    """A sequence's logits, bit for bit, alone or beside others that route elsewhere."""
    model = load_model(tiny_model("qwen2_moe", **FAMILIES["qwen2_moe"]), dtype="float32").model
    model.freeze()
    make_batch_invariant(model)
    prompt = random_tokens(21, seed=5)
    alone = PagedRunner(model).step([(0, prompt)])[0]
    beside = PagedRunner(model, seed=1).step([(1, random_tokens(40, seed=6)), (0, prompt), (2, [7])])[1]
    assert torch.equal(alone, beside)


# GGUF files as llama.cpp's converter writes them: experts stacked per layer [experts, rows, columns].
GGUF_FAMILIES = {
    "mixtral": ("llama", {"num_local_experts": EXPERTS, "intermediate_size": 64}),
    "qwen2_moe": ("qwen2moe", {"num_experts": EXPERTS, "moe_intermediate_size": 32,
                               "shared_expert_intermediate_size": 64, "intermediate_size": 96}),
    "qwen3_moe": ("qwen3moe", {"num_experts": EXPERTS, "moe_intermediate_size": 32, "norm_topk_prob": True,
                               "intermediate_size": 96}),
    "olmoe": ("olmoe", {"num_experts": EXPERTS, "intermediate_size": 32}),
}
_GGUF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
               "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp",
               "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
               "mlp.shared_expert.down_proj": "ffn_down_shexp",
               "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
# Kept in float32 by the converter whatever the file's type: the routers.
_F32_KINDS = ("ffn_gate_inp", "ffn_gate_inp_shexp")


def moe_hf_model(family: str) -> torch.nn.Module:
    import transformers

    _, shape = GGUF_FAMILIES[family]
    config_class, model_class = (getattr(transformers, f"{ARCHITECTURES[family][:-len('ForCausalLM')]}{kind}")
                                 for kind in ("Config", "ForCausalLM"))
    config = config_class(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
                          rope_theta=10000.0, tie_word_embeddings=False, num_experts_per_tok=2, **shape)
    torch.manual_seed(0)
    model = model_class(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            norm = "norm" in name
            p.copy_((1.0 if norm else 0.0) + (0.3 if norm else 0.08) * torch.randn_like(p))
    return model


def gguf_tensors(model: torch.nn.Module, gguf_arch: str) -> dict[str, np.ndarray]:
    """The model's tensors under llama.cpp's names and layout (its q/k rows permuted for "llama")."""
    config, out = model.config, {}
    for name, t in model.state_dict().items():
        w = t.float().numpy().copy()
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            out[{"model.embed_tokens.weight": "token_embd", "model.norm.weight": "output_norm",
                 "lm_head.weight": "output"}[name] + ".weight"] = w
            continue
        _, _, layer, *rest = name.split(".")
        part = ".".join(rest[:-1]) if rest[-1] in ("weight", "bias") else ".".join(rest)
        prefix = f"blk.{layer}."
        if part == "mlp.experts.gate_up_proj":  # transformers 5: [experts, gate rows then up rows, hidden]
            gate, up = np.split(w, 2, axis=1)
            out[f"{prefix}ffn_gate_exps.weight"], out[f"{prefix}ffn_up_exps.weight"] = gate, up
        elif part == "mlp.experts.down_proj":
            out[f"{prefix}ffn_down_exps.weight"] = w
        else:
            if gguf_arch == "llama" and part in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = config.num_attention_heads if "q_proj" in part else config.num_key_value_heads
                w = llamacpp_permute(w, heads)
            out[f"{prefix}{_GGUF_NAMES[part]}.{rest[-1]}"] = w
    return out


def write_moe_gguf(path: Path, model: torch.nn.Module, family: str, qtype: Q) -> Path:
    gguf_arch, shape = GGUF_FAMILIES[family]
    tensors = gguf_tensors(model, gguf_arch)
    routers = {name: (tensors.pop(name), Q.F32) for name in list(tensors)
               if name.split(".")[-2] in _F32_KINDS}
    metadata = {"expert_count": EXPERTS, "expert_used_count": 2,
                "feed_forward_length": shape["intermediate_size"]}
    if "moe_intermediate_size" in shape:
        metadata["expert_feed_forward_length"] = shape["moe_intermediate_size"]
    if "shared_expert_intermediate_size" in shape:
        metadata["expert_shared_feed_forward_length"] = shape["shared_expert_intermediate_size"]
    return write_gguf(path, tensors, qtype, arch=gguf_arch, metadata=metadata, raw_tensors=routers)


def q8_0_round_trip(model: torch.nn.Module) -> None:
    """The model's matrices replaced by their Q8_0 values (as dequantized from the file), the routers kept."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and not name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
                blocks = gguf.quants.quantize(p.numpy(), Q.Q8_0)
                p.copy_(torch.from_numpy(gguf.quants.dequantize(blocks, Q.Q8_0)).reshape(p.shape))


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0], ids=lambda q: q.name)
@pytest.mark.parametrize("name", list(GGUF_FAMILIES))
def test_gguf_logits_equal_transformers(tmp_path: Path, name: str, qtype: Q) -> None:
    model = moe_hf_model(name)
    original = model.lm_head.weight.clone()
    path = write_moe_gguf(tmp_path / "m.gguf", model, name, qtype)
    if qtype == Q.Q8_0:
        q8_0_round_trip(model)  # the reference: the file's dequantized weights
        assert not torch.equal(model.lm_head.weight, original)
    config, weights, _ = load_gguf(path)
    assert config.architecture == ARCHITECTURES[name]
    assert (config.num_experts, config.num_experts_per_tok) == (EXPERTS, 2)
    assert config.norm_topk_prob == (name in ("mixtral", "qwen3_moe"))
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in weights
    tokens = random_tokens(13, seed=0)
    tokens = [t % VOCAB for t in tokens]
    with torch.no_grad():
        expected = model(torch.tensor([tokens])).logits[0]
    loaded = load_model(path, dtype="float32")
    loaded.freeze()
    assert 1.0 < expected.abs().max() < 30.0  # far from zero, so that a wrong weight would show
    torch.testing.assert_close(run_prefill(loaded.model, tokens), expected, atol=1e-4, rtol=0)


def test_gguf_experts_run_on_the_files_blocks(tmp_path: Path) -> None:
    """Each expert's Q8_0 matrices serve in the file's blocks alone (the low-bit kernel; gate and up
    stacked), a decode step's rows and a prompt's: logits as far from the dequantized weights' as the dense
    bfloat16 path's are, within a factor for the kernel's 8-bit activations."""
    model = moe_hf_model("qwen2_moe")
    path = write_moe_gguf(tmp_path / "m.gguf", model, "qwen2_moe", Q.Q8_0)
    q8_0_round_trip(model)
    blocks = load_model(path, dtype="bfloat16", dense_weights="off")
    if not blocks.int4:
        pytest.skip("no low-bit kernel serves this CPU's bfloat16 models")
    blocks.freeze()
    expert = blocks.model.model.layers[0].mlp.experts[3]
    assert expert.gate_up_proj.int4 is not None and not expert.gate_up_proj.has_dense
    # The routers' float32 matrices are dense, but no expert is: the kernels are told as the blocks alone.
    assert "/dense" not in linear_path(blocks.model), linear_path(blocks.model)
    described = describe_linear_kernels(blocks.model)
    assert "for every row, no dense copy" in described and "of no low-bit form" in described, described
    dense = load_model(path, dtype="bfloat16", quantization="none")
    dense.freeze()
    prompt = [t % VOCAB for t in random_tokens(21, seed=0)]
    with torch.no_grad():
        expected = model(torch.tensor([prompt])).logits[0]
    errors = {}
    for name, loaded in (("blocks", blocks), ("dense", dense)):
        runner = PagedRunner(loaded.model, dtype=torch.bfloat16)
        logits = torch.cat([runner.step([(0, prompt[:-3])])[0],
                            *(runner.step([(0, [token])])[0] for token in prompt[-3:])])
        errors[name] = (logits - expected).abs().max()
    assert 0 < errors["blocks"] <= 2 * errors["dense"], errors


def test_experts_split_a_steps_rows_between_blocks_and_dense_weights(tmp_path: Path) -> None:
    """With a dense copy beside the blocks, a decode token takes the blocks and a prompt the dense weights
    (`low_bit_gate.py`), in each expert's call as in every other linear: in a step of both, the prompt gets
    the logits of the dense weights alone and the decode token those it gets alone, bit for bit."""
    path = write_moe_gguf(tmp_path / "m.gguf", moe_hf_model("mixtral"), "mixtral", Q.Q8_0)
    both = load_model(path, dtype="bfloat16")
    if not both.int4:
        pytest.skip("no low-bit kernel serves this CPU's bfloat16 models")
    dense = load_model(path, dtype="bfloat16", quantization="none")
    both.freeze()
    dense.freeze()
    short, long = ([t % VOCAB for t in random_tokens(n, seed=n)] for n in (5, 30))

    def decoded(loaded, beside: list) -> list[torch.Tensor]:
        runner = PagedRunner(loaded.model, dtype=torch.bfloat16)
        runner.step([(0, short)])
        return runner.step([(0, [7]), *beside])

    mixed = decoded(both, [(1, long)])
    assert torch.equal(mixed[1], PagedRunner(dense.model, dtype=torch.bfloat16).step([(1, long)])[0])
    assert torch.equal(mixed[0], decoded(both, [])[0])
    assert not torch.equal(mixed[0], decoded(dense, [])[0])


def test_decode_steps_run_eagerly_saying_why(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A model the compiled decode steps would serve but for its experts (a CPU bfloat16 model of low-bit
    forms) serves eagerly, and the log says why."""
    path = write_moe_gguf(tmp_path / "m.gguf", moe_hf_model("olmoe"), "olmoe", Q.Q8_0)
    loaded = load_model(path, dtype="bfloat16")
    if not loaded.int4:
        pytest.skip("no low-bit kernel serves this CPU's bfloat16 models")
    loaded.freeze()
    with caplog.at_level(logging.INFO, logger="gracelm.parallel.decode_graph_build"):
        assert not graph_applies(EngineConfig(model=str(path)), loaded, 1)
    assert "not for OlmoeForCausalLM: a mixture of experts" in caplog.text


def test_tensor_parallelism_is_refused_for_a_mixture_of_experts() -> None:
    directory = tiny_model("olmoe", **FAMILIES["olmoe"])
    with pytest.raises(ShardingError, match="OlmoeForCausalLM is a mixture-of-experts model"):
        check_parallel_config(EngineConfig(model=str(directory), tensor_parallel_size=2))


SHAPE = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_experts": 4, "num_experts_per_tok": 2}


def test_gpt_oss_is_refused_naming_what_it_needs(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedModelError, match="attention sinks and its MXFP4"):
        ModelConfig.from_hf_config({**SHAPE, "architectures": ["GptOssForCausalLM"]})
    path = write_gguf(tmp_path / "m.gguf", {}, Q.F32, arch="gpt-oss")
    with pytest.raises(UnsupportedModelError, match="'gpt-oss': gpt-oss: its attention sinks"):
        load_gguf(path)


def test_olmoe_clip_qkv_is_refused() -> None:
    with pytest.raises(UnsupportedModelError, match="clip_qkv"):
        ModelConfig.from_hf_config({**SHAPE, "architectures": ["OlmoeForCausalLM"], "clip_qkv": 8.0})


def test_qwen2_moe_dense_layers() -> None:
    """Qwen2-MoE's `mlp_only_layers` and `decoder_sparse_step` keep some layers' MLPs dense."""
    hf = {**SHAPE, "architectures": ["Qwen2MoeForCausalLM"], "num_hidden_layers": 6, "decoder_sparse_step": 2,
          "mlp_only_layers": [3]}
    config = ModelConfig.from_hf_config(hf)
    assert [config.sparse_layer(i) for i in range(6)] == [False, True, False, False, False, True]


def test_a_mixtral_server_answers_a_chat_through_openai() -> None:
    with ServerProcess(tiny_model("mixtral", **FAMILIES["mixtral"]), "--served-model-name", "tiny-mixtral",
                       "--dtype", "float32", "--stats-interval", "0") as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        answer = client.chat.completions.create(model="tiny-mixtral", max_tokens=8, temperature=0,
                                                messages=[{"role": "user", "content": "the quick red dog"}])
        assert answer.choices[0].message.content
        assert answer.usage.completion_tokens > 0
