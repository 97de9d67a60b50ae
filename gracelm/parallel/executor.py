"""What the engine core calls to run the model: one worker in-process now, a group of ranks later.

With tensor parallelism, rank 0 stays in the engine core and the executor broadcasts each step to worker
processes for ranks 1..N-1; the engine core's view — load, size the cache, execute, release, shut down —
does not change.
"""

from __future__ import annotations

from gracelm.config import EngineConfig, ModelConfig
from gracelm.engine.scheduler import SchedulerOutput
from gracelm.model.loader import LoadedModel
from gracelm.parallel.worker import SampledToken, Worker


class Executor:
    def __init__(self, config: EngineConfig) -> None:
        if config.tensor_parallel_size != 1:
            raise NotImplementedError(
                f"tensor_parallel_size={config.tensor_parallel_size}: only 1 is supported so far")
        self.config = config
        self._driver = Worker(config, rank=0)

    def load_model(self) -> LoadedModel:
        return self._driver.load_model()

    @property
    def model_config(self) -> ModelConfig:
        return self._driver.model_config

    def available_kv_blocks(self) -> int:
        return self._driver.available_kv_blocks()

    def init_kv_cache(self, num_blocks: int) -> None:
        self._driver.init_kv_cache(num_blocks)

    def execute_model(self, step: SchedulerOutput) -> dict[str, SampledToken]:
        return self._driver.execute_model(step)

    def release_requests(self, request_ids: list[str]) -> None:
        self._driver.release_requests(request_ids)

    def shutdown(self) -> None:
        self._driver.shutdown()
