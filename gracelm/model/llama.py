"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Phi-3/4; with mixtures of experts, `moe.py`:
Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) over a paged KV cache.

Parameter names equal Hugging Face's, so a HF state dict loads as it is. A plain module: it knows nothing of
serving, scheduling or parallelism; head counts are read from the projections' outputs at run time, so a
tensor-parallel wrapper may shard the q/k/v/o and gate/up/down linears from outside.

Once loaded (and sharded, if at all), `LlamaForCausalLM.freeze()` turns the linears into `FrozenLinear`s:
q/k/v and gate/up stacked by rows into one matmul each, bfloat16 weights reordered once for oneDNN, and
where the weights came in 4-bit blocks, their 4-bit form beside, for steps of few rows
(`model/quantized_linear.py`). The matmuls are most of a decode step's time. A frozen linear keeps its
parts' row counts (`output_sizes`).
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

import gracelm.cpu_features as cpu_features
from gracelm.config import ModelConfig, UnsupportedModelError
from gracelm.model.attention import AttentionMetadata, LayerAttention, paged_attention
from gracelm.model.block_linear import amx_rows
from gracelm.model.decode_graph import DecodeGraph
from gracelm.model.forward_batch import ForwardBatch
from gracelm.model.low_bit_gate import SHORT_PROMPT, Int4Gate
from gracelm.model.moe import GRAPH_REFUSAL, SparseMoeBlock
from gracelm.model.quantized_linear import (
    INT4_MAX_ROWS,
    KERNEL_DTYPE,
    Int4Choice,
    LowBitForm,
    rows_for,
)
from gracelm.model.rope import apply_rope, attention_factor, inverse_frequencies, rope_cos_sin
from gracelm.model.row_tiles import RowTiles

logger = logging.getLogger(__name__)

SUPPORTED_ACTIVATIONS = ("silu",)


def rms_normalised(x: torch.Tensor, eps: float) -> torch.Tensor:
    """`x` over the root mean square of its last dimension, in float32 (every family's norms scale this)."""
    x32 = x.float()
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    """Normalises in float32 and scales in the input dtype, as transformers does."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * rms_normalised(x, self.eps).to(x.dtype)


class FrozenLinear(nn.Module):
    """One or several linears of the same input, stacked by rows, frozen for inference: one matmul instead of
    several. `output_sizes` are the parts' widths, in order: a tensor-parallel split of the output takes
    its share of each part. bfloat16 weights on CPU are reordered once into oneDNN's blocked layout: the
    same kernel as `F.linear` (bit-identical results) without the per-call weight reorder, which costs most
    at small batches. Float32 keeps the plain weight and MKL,
    so float32 logits stay those of transformers.

    With a 4-bit form (`int4`), at most `int4_max_rows` rows of a call use it instead, in a model only the
    rows of decode tokens and short prompts (`low_bit_gate.py`): the int4 kernel reads a quarter of the
    bytes, which decides a decode step of few sequences (`model/quantized_linear.py`). `int4_max_rows` may
    be set at any time: 0 never uses the int4 form, `sys.maxsize` always does (one kernel for every row)."""

    def __init__(self, weights: list[torch.Tensor], biases: list[torch.Tensor] | None = None,
                 int4: LowBitForm | None = None, int4_max_rows: int = INT4_MAX_ROWS) -> None:
        super().__init__()
        weight = _stacked(weights)
        self.output_sizes = tuple(w.shape[0] for w in weights)
        self.bias = (torch.cat(biases) if len(biases) > 1 else biases[0]) if biases else None
        self.packed = _onednn_packed(weight)
        self.weight = weight if self.packed is None else None
        self.int4 = None if int4 is None else int4.to_dtype(KERNEL_DTYPE)
        if not self.has_dense and self.int4 is None:
            raise ValueError(f"a linear of {list(weight.shape)} has neither dense weights nor a low-bit form")
        self.int4_gate = Int4Gate(int4_max_rows)  # its own until a model shares one (`of`)
        # Batch-invariant mode: each kernel called on a fixed count of rows (`batch_invariant.py`).
        self.row_tiles: RowTiles | None = None

    @property
    def has_dense(self) -> bool:
        """Whether it holds dense weights (none where the file's low-bit form serves every row)."""
        return self.packed is not None or not self.weight.is_meta

    @property
    def int4_max_rows(self) -> int:
        return self.int4_gate.max_rows

    @int4_max_rows.setter
    def int4_max_rows(self, rows: int) -> None:
        self.int4_gate.max_rows = rows

    @classmethod
    def of(cls, linears: list[nn.Module], int4: Int4Choice | None = None) -> FrozenLinear:
        """Of modules with a `weight` (linears, or a tied embedding) and maybe a `bias`; with their stacked
        4-bit form where `int4` has one for each."""
        weights = [linear.weight for linear in linears]
        has_bias = getattr(linears[0], "bias", None) is not None
        biases = [linear.bias for linear in linears] if has_bias else None
        if int4 is None:
            return cls(weights, biases)
        frozen = cls(weights, biases, int4.stacked(linears))
        frozen.int4_gate = int4.gate
        return frozen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x @ weight.T + bias: the 4-bit form's for the rows the gate gives it, the dense for the others."""
        tile = None if self.row_tiles is None else self.row_tiles.tile
        rows = False if self.int4 is None else self.int4_gate.low_rows(x.shape[0], self.int4.halves, tile)
        if rows is True:
            return self._call(self._low_bit, x)
        if rows is False:
            return self._call(self._dense, x)
        return rows.combine(self._call(self._low_bit, x.index_select(0, rows.low)),
                            self._call(self._dense, x.index_select(0, rows.dense)))

    def _call(self, kernel: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return kernel(x) if self.row_tiles is None else self.row_tiles(kernel, x)

    def _low_bit(self, x: torch.Tensor) -> torch.Tensor:
        out = self.int4(x)
        return out if self.bias is None else out + self.bias

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        if not self.has_dense:
            # The file's form alone: the rows the gate keeps from it (a long prompt's) take it in a call of
            # their own, so that each row's kernel depends on its own sequence, not on its neighbours' rows
            # (the AMX kernel serves calls of 16 rows or more: `block_linear.py`).
            return self._low_bit(x)
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The parts' outputs, as views of one matmul's result."""
        return self(x).split(self.output_sizes, dim=-1)


def freeze_linears(module: nn.Module, int4: Int4Choice | None = None) -> None:
    """Replaces every `nn.Linear` below `module`, however deeply wrapped, by its `FrozenLinear`."""
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, FrozenLinear.of([child], int4))
        else:
            freeze_linears(child, int4)


def set_int4_max_rows(module: nn.Module, rows: int) -> None:
    """Sets `int4_max_rows` of every frozen linear below `module`: 0 for dense weights at every batch size,
    `sys.maxsize` for the int4 form at every batch size (where a linear has one), `INT4_MAX_ROWS` as
    frozen."""
    for linear in module.modules():
        if isinstance(linear, FrozenLinear):
            linear.int4_max_rows = rows


def low_bit_layout(module: nn.Module) -> str:
    """The layout of the low-bit forms the frozen linears below `module` use ("" where none does)."""
    forms = [m.int4 for m in module.modules() if isinstance(m, FrozenLinear) and m.int4 is not None]
    return forms[0].layout() if forms else ""


def linear_path(module: nn.Module) -> str:
    """The short name of the linears' kernels below `module`, for /metrics: the low-bit form's, if any, then
    the dense weights' (e.g. "blocks-vnni+amx/dense-bfloat16-onednn")."""
    linears = [m for m in module.modules() if isinstance(m, FrozenLinear)]
    dense_ones = [m for m in linears if m.has_dense]
    low_bit = next((m.int4 for m in linears if m.int4 is not None and m.int4_max_rows > 0), None)
    if low_bit is not None and not any(m.has_dense for m in linears if m.int4 is not None):
        return low_bit.path()  # the file's forms alone (`--dense-weights off`), a router's matrix aside
    first = dense_ones[0]
    dense = ("dense-bfloat16-onednn" if first.packed is not None  # oneDNN packs bfloat16 only
             else f"dense-{str(first.weight.dtype).removeprefix('torch.')}")
    return dense if low_bit is None else f"{low_bit.path()}/{dense}"


def long_prompts_differ(module: nn.Module) -> bool:
    """Whether the tokens of a prompt of `SHORT_PROMPT` or more are multiplied by other kernels than decode
    tokens below `module`: a dense copy's (`low_bit_gate.py`), or the tile unit's, which takes calls of 16
    rows or more (`block_linear.amx_rows`). Not where the file's forms alone serve every row without the tile
    unit: a long prompt's rows then take the kernel decode rows take, in a call of their own. Any dense
    matrix counts, a router's of no low-bit form too: oneDNN makes a primitive for each row count it meets."""
    linears = [m for m in module.modules() if isinstance(m, FrozenLinear)]
    low_bit = [m for m in linears if m.int4 is not None and m.int4_max_rows > 0]
    return not low_bit or any(m.has_dense for m in linears) or amx_rows() > 0


def describe_linear_kernels(module: nn.Module) -> str:
    """Which kernels the frozen linears below `module` use, for the log."""
    linears = [m for m in module.modules() if isinstance(m, FrozenLinear)]
    with_int4 = [m for m in linears if m.int4 is not None and m.int4_max_rows > 0]
    dense_ones = [m for m in linears if m.has_dense]
    dense = "" if not dense_ones else ("bfloat16 oneDNN" if dense_ones[0].packed is not None
                                       else f"{dense_ones[0].weight.dtype} F.linear").replace("torch.", "")
    if with_int4 and not any(m.has_dense for m in with_int4):  # the file's forms alone (no dense copy)
        others = len(linears) - len(with_int4)  # matrices of no low-bit form (a router's float32 one)
        return (f"{with_int4[0].int4.describe()} for every row, no dense copy; prompts of >= {SHORT_PROMPT} "
                f"tokens in calls of their own ({len(with_int4)} matmuls)"
                + (f"; {dense} for the {others} of no low-bit form" if others else ""))
    if not with_int4:
        return f"{dense} at every batch size ({len(linears)} matmuls)"

    def rows(halves: bool) -> str:
        forms = [m for m in with_int4 if not halves or m.int4.halves]
        return "/".join(map(str, sorted({m.int4_gate.bound(halves) for m in forms})))

    counts = f"for {len(with_int4)} of {len(linears)} matmuls; {dense} for the others"
    if all(m.int4_max_rows == sys.maxsize for m in with_int4):
        return f"{with_int4[0].int4.describe()} for every step, {counts}"
    halves = any(m.int4.halves for m in with_int4) and rows(True) != rows(False)
    halves_rows = f" (8-bit matrices as 4-bit halves: <= {rows(True)})" if halves else ""
    return (f"{with_int4[0].int4.describe()} for decode tokens and prompts of < {SHORT_PROMPT} tokens, "
            f"<= {rows(False)} rows a step{halves_rows}, {dense} above and for longer prompts, {counts}")


def _stacked(weights: list[torch.Tensor]) -> torch.Tensor:
    """The weights stacked by rows. Meta ones (no dense copy: `loader._dense_copy`) are stacked as a new
    meta tensor: `torch.cat` of meta tensors imports torch's reference ops, seconds of a start."""
    if len(weights) == 1:
        return weights[0]
    if weights[0].is_meta:
        rows = sum(weight.shape[0] for weight in weights)
        return torch.empty((rows, *weights[0].shape[1:]), dtype=weights[0].dtype, device="meta")
    return torch.cat(weights)


def _onednn_packed(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight in oneDNN's own layout (an opaque tensor); None where `F.linear` does not use oneDNN
    (oneDNN refuses to pack bfloat16 on a CPU without native bfloat16 support, or with it masked:
    `F.linear` emulates it)."""
    on_cpu = (weight.device.type == "cpu" and torch.backends.mkldnn.is_available()
              and cpu_features.native_bfloat16())
    if weight.dtype != torch.bfloat16 or not on_cpu:
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, head_dim = config.hidden_size, config.head_dim
        bias = config.attention_bias
        self.head_dim = head_dim
        self.q_proj = nn.Linear(hidden, config.num_attention_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, config.num_key_value_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, config.num_key_value_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(config.num_attention_heads * head_dim, hidden, bias=False)
        if config.qk_norm:
            # Over each head, or (OLMoE) over the whole projection.
            q_width, k_width = ((head_dim, head_dim) if config.qk_norm_per_head
                                else (self.q_proj.out_features, self.k_proj.out_features))
            self.q_norm = RMSNorm(q_width, config.rms_norm_eps)
            self.k_norm = RMSNorm(k_width, config.rms_norm_eps)
        self.qk_norm = config.qk_norm
        self.qk_norm_per_head = config.qk_norm_per_head
        self.qkv_proj: FrozenLinear | None = None
        self.attention: LayerAttention | None = None  # how it attends (None: Llama's, `paged_attention`)

    def fuse_qkv(self, int4: Int4Choice | None = None) -> None:
        self.qkv_proj = FrozenLinear.of([self.q_proj, self.k_proj, self.v_proj], int4)
        del self.q_proj, self.k_proj, self.v_proj

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        if self.qkv_proj is not None and not self.qk_norm:
            q, k, v = self._fused_qkv_with_rope(x, cos, sin)
        else:
            if self.qkv_proj is not None:
                q, k, v = self.qkv_proj.split(x)
            else:
                q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            if self.qk_norm and not self.qk_norm_per_head:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k, v = (t.view(x.shape[0], -1, self.head_dim) for t in (q, k, v))
            if self.qk_norm and self.qk_norm_per_head:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return self.o_proj(paged_attention(q, k, v, kv_cache, meta, self.attention))

    def _fused_qkv_with_rope(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k (rotated) and v [T, heads, head_dim] from one matmul. q and k lie side by side in its
        output, so one rope call rotates both: half the per-layer rope ops, the same elementwise arithmetic.
        """
        q_width, k_width, _ = self.qkv_proj.output_sizes
        qkv = self.qkv_proj(x)
        tokens, head_dim = x.shape[0], self.head_dim
        qk = apply_rope(qkv[:, : q_width + k_width].view(tokens, -1, head_dim), cos, sin)
        q, k = qk.split((q_width // head_dim, k_width // head_dim), dim=1)
        return q, k, qkv[:, q_width + k_width :].view(tokens, -1, head_dim)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, intermediate_size: int | None = None) -> None:
        """`intermediate_size`: the width of an expert's MLP (`moe.py`); the config's by default."""
        super().__init__()
        width = intermediate_size or config.intermediate_size
        self.gate_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.down_proj = nn.Linear(width, config.hidden_size, bias=False)
        self.gate_up_proj: FrozenLinear | None = None

    def fuse_gate_up(self, int4: Int4Choice | None = None) -> None:
        self.gate_up_proj = FrozenLinear.of([self.gate_proj, self.up_proj], int4)
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj.split(x)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self.activation(gate).mul_(up))

    @staticmethod
    def activation(gate: torch.Tensor) -> torch.Tensor:
        """The gate's activation (a family's own MLP overrides it: `gemma.py`)."""
        return F.silu(gate)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int = 0) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config)
        self.mlp = (SparseMoeBlock(config, functools.partial(LlamaMLP, config)) if config.sparse_layer(index)
                    else LlamaMLP(config))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # A weight given, so that `nn.Embedding` skips its random initialisation: built on the `meta` device,
        # its `normal_` goes through torch's Python decompositions, which import torch._dynamo (measured 3-4
        # s of the start); the loaded weight replaces it anyway.
        weight = torch.empty(config.vocab_size, config.hidden_size)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(self.decoder_layer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Not a weight: recomputed from the config (on CPU even under a `meta` device context).
        self.register_buffer("inv_freq", inverse_frequencies(config), persistent=False)
        self.rope_factor = attention_factor(config)
        self.int4_gate: Int4Gate | None = None  # shared by the linears that have 4-bit forms, once frozen
        self.batch_invariant = False  # attend every row alike (`batch_invariant.py`)
        self.decode_graphs: list[DecodeGraph] = []  # compiled decode steps, once loaded (`decode_graph.py`)
        self.decode_graph_failure: str | None = None  # why the graphs were dropped, if they were
        self.compiled_steps = 0  # steps a graph ran
        self.decode_attention = "auto"  # `--decode-attention` (`config.DECODE_ATTENTION_CHOICES`)
        # Why compiled decode steps cannot serve this decoder (None: they can), for the log.
        self.graph_refusal: str | None = GRAPH_REFUSAL if config.num_experts else None
        self.window: int | None = None  # the sliding layers' window, whose masks a step builds (`gemma.py`)

    @staticmethod
    def decoder_layer(config: ModelConfig, index: int) -> nn.Module:
        """Layer `index` of the decoder (a family's own decoder overrides it: `gemma.py`)."""
        return LlamaDecoderLayer(config, index)

    def freeze(self, int4: Int4Choice | None = None) -> None:
        """Fuses q/k/v and gate/up and freezes every linear (`FrozenLinear`), with the 4-bit forms `int4`
        has: after loading, and after sharding if any (the sharded linears may be wrapped: those inside the
        wrappers are frozen)."""
        for layer in self.layers:
            layer.self_attn.fuse_qkv(int4)
            layer.mlp.fuse_gate_up(int4)
            freeze_linears(layer, int4)
            if int4 is not None and isinstance(layer.mlp, SparseMoeBlock):
                layer.mlp.share_gate(int4.gate, [m for m in layer.mlp.experts.modules()
                                                 if isinstance(m, FrozenLinear)])
        self.int4_gate = None if int4 is None else int4.gate

    def forward(self, batch: ForwardBatch, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """Hidden states after the final norm of the rows `batch.logits_indices`."""
        x, cos, sin, meta = self.step_inputs(batch, kv_caches)
        graph = self._graph_for(batch)
        out = None if graph is None else self._run_graph(graph, x, cos, sin, meta, kv_caches)
        if out is not None:
            self.compiled_steps += 1
            hidden = out.index_select(0, batch.logits_indices)
        else:
            x = self.run_layers(x, cos, sin, meta, kv_caches, batch.positions)
            hidden = self.norm(x.index_select(0, batch.logits_indices))
        if self.int4_gate is not None:
            self.int4_gate.select(batch.logits_indices)  # the rows of the logits head, which comes next
        return hidden

    def step_inputs(self, batch: ForwardBatch, kv_caches: list[torch.Tensor]
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
        """What every layer of the step takes: the embedded tokens, rope's cos and sin, the attention
        metadata; and the int4 gate told whether the step has prompt rows."""
        x = self.embed(batch.input_ids)
        cos, sin = rope_cos_sin(self.inv_freq, batch.positions, x.dtype, self.rope_factor)
        meta = AttentionMetadata.build(batch, kv_caches[0], self.batch_invariant, self.decode_attention,
                                       self.window)
        if self.int4_gate is not None:
            self.int4_gate.mark(batch.low_bit_sequences(SHORT_PROMPT), batch.query_lens)
        return x, cos, sin, meta

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings (a family's own decoder scales them: `gemma.py`)."""
        return self.embed_tokens(input_ids)

    def run_layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                   kv_caches: list[torch.Tensor], positions: torch.Tensor) -> torch.Tensor:
        """The decoder layers, eagerly, over the step's rows (a family with a rope of its own for some
        layers overrides it: `gemma.py`)."""
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, kv_cache, meta)
        return x

    def _graph_for(self, batch: ForwardBatch) -> DecodeGraph | None:
        """The compiled decode step that serves this step, if any: a step of decode tokens alone (so one
        row a sequence), every row of which takes the low-bit forms the graphs were traced through."""
        if not self.decode_graphs or self.batch_invariant:
            return None
        graph = next((graph for graph in self.decode_graphs if graph.serves(batch)), None)
        if graph is None or self.int4_gate.low_rows(len(batch.query_lens)) is not True:
            return None
        return graph

    def _run_graph(self, graph: DecodeGraph, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   meta: AttentionMetadata, kv_caches: list[torch.Tensor]) -> torch.Tensor | None:
        """The graph's output, or None where it raised: then every graph is dropped, the step and every
        later one run eagerly (this one rewrites every slot the graph may have written), and
        `decode_graph_failure` says why. A defect of a fast path costs speed, never the server."""
        try:
            return graph(x, cos, sin, meta, kv_caches)
        except Exception as e:
            logger.exception("decode graph of %d to %d sequences raised; serving eagerly from now on",
                             graph.rows.start, graph.rows.stop - 1)
            self.decode_graphs = []
            self.decode_graph_failure = f"a compiled step raised {type(e).__name__}: {e}"
            return None


class LlamaForCausalLM(nn.Module):
    """With tied embeddings there is no `lm_head` module: the logits reuse `model.embed_tokens.weight`,
    so the state dict has exactly the keys a tied HF checkpoint has. Without `head` (an embedding model,
    whose final hidden states are pooled: `model/pooling.py`) there are no logits at all: only `model`
    runs. A family's own decoder (`decoder`, `activations`) subclasses it: `gemma.py`."""

    decoder: type[LlamaModel] = LlamaModel
    activations: tuple[str, ...] = SUPPORTED_ACTIVATIONS

    def __init__(self, config: ModelConfig, head: bool = True) -> None:
        super().__init__()
        if config.hidden_act not in self.activations:
            raise UnsupportedModelError(
                f"unsupported activation {config.hidden_act!r}; supported: {', '.join(self.activations)}"
            )
        self.config = config
        self.model = self.decoder(config)
        self.head = head
        if head and not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.logits_proj: FrozenLinear | None = None

    def freeze(self, int4: Mapping[str, LowBitForm] | None = None, int4_max_rows: int | None = None) -> None:
        """Readies the loaded weights for fast inference: the decoder's (see `LlamaModel.freeze`) and the
        logits projection's, with the low-bit forms `int4` gives by weight name (a GGUF file's, as
        `LoadedModel.int4` holds them) for steps of at most `int4_max_rows` rows (None: the crossover of
        the forms and the model's dtype, `quantized_linear.rows_for`). Their weights leave the state dict:
        load before, never after. (A tensor-parallel wrapper, which has its own logits head, shards first and
        then calls `LlamaModel.freeze`.)"""
        dtype = self.model.embed_tokens.weight.dtype
        if int4_max_rows is None:
            int4_max_rows = rows_for(dtype, type(next(iter(int4.values())))) if int4 else 0
        choice = Int4Choice.of(self, int4, int4_max_rows, dtype) if int4 else None
        self.model.freeze(choice)
        if not self.head:
            return
        # Tied: the embedding keeps its plain matrix for lookups, the logits get their own (packed) copy.
        head = self.model.embed_tokens if self.config.tie_word_embeddings else self.lm_head
        self.logits_proj = FrozenLinear.of([head], choice)
        if not self.config.tie_word_embeddings:
            del self.lm_head

    def output_embedding(self) -> torch.Tensor:
        """The [vocab, hidden] matrix that turns hidden states into logits."""
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.weight
        return self.lm_head.weight

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """Float32 logits [len(batch.logits_indices), vocab]; writes the batch's K/V into `kv_caches`."""
        hidden = self.model(batch, kv_caches)
        if self.logits_proj is not None:
            return self.logits_proj(hidden).float()
        return F.linear(hidden, self.output_embedding()).float()
