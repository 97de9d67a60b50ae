"""How a tensor-parallel group is laid out, checked before anything starts: the ranks over the nodes, and
whether the model's heads and MLP width divide by the group's size. Reads only the model's config
(`model_files`), never a weight, and imports no torch, so the frontend can refuse a layout that cannot work
before any process starts.
"""

from __future__ import annotations

import dataclasses

from gracelm.config import EngineConfig, ModelConfig
from gracelm.model.model_files import read_model_config


class LayoutError(ValueError):
    """The tensor-parallel size and the number of nodes do not fit together."""


@dataclasses.dataclass(frozen=True)
class Layout:
    world_size: int
    nnodes: int

    @classmethod
    def from_config(cls, config: EngineConfig) -> Layout:
        if config.tensor_parallel_size % config.nnodes:
            raise LayoutError(f"tensor_parallel_size={config.tensor_parallel_size} must be a multiple of "
                              f"nnodes={config.nnodes}: every node holds the same number of ranks")
        return cls(config.tensor_parallel_size, config.nnodes)

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    def node_ranks(self, node_rank: int) -> range:
        return range(node_rank * self.ranks_per_node, (node_rank + 1) * self.ranks_per_node)

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node


class ShardingError(ValueError):
    """The model cannot be split across this many ranks."""


def check_shardable(config: ModelConfig, world_size: int) -> None:
    """Raises `ShardingError` naming every dimension that does not divide by `world_size`, or a mixture of
    experts (its experts are not split across ranks)."""
    if config.num_experts:
        raise ShardingError(f"tensor_parallel_size={world_size}: {config.architecture} is a "
                            f"mixture-of-experts model, which gracelm does not split across ranks; serve it "
                            f"with tensor_parallel_size 1")
    dims = {"num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": config.num_key_value_heads,
            "intermediate_size": config.intermediate_size}
    bad = [f"{name}={value}" for name, value in dims.items() if value % world_size]
    if bad:
        raise ShardingError(
            f"tensor_parallel_size={world_size} does not divide the model's {', '.join(bad)}; choose a "
            f"size that divides the attention heads, the KV heads and the MLP width")


def shard_config(config: ModelConfig, world_size: int) -> ModelConfig:
    """The config one rank's shard has: its heads (what the KV cache of a rank is sized by)."""
    return dataclasses.replace(config, num_attention_heads=config.num_attention_heads // world_size,
                               num_key_value_heads=config.num_key_value_heads // world_size,
                               intermediate_size=config.intermediate_size // world_size)


def check_parallel_config(config: EngineConfig) -> None:
    """Refuses a tensor-parallel size that the nodes or the model cannot split, reading only the model's
    config: callable before any process starts."""
    if config.tensor_parallel_size > 1:
        Layout.from_config(config)
        check_shardable(read_model_config(config.model), config.tensor_parallel_size)
