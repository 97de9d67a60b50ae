"""gracelm: an LLM inference server with a clean lifecycle."""

from gracelm.sampling_params import SamplingParams

__all__ = ["AsyncEngine", "Engine", "SamplingParams", "RequestOutput", "CompletionOutput"]


def __getattr__(name: str):
    # The engines pull in zmq, tokenizers and the engine's machinery; import them only when asked, so
    # `import gracelm` (for `SamplingParams`) stays light.
    if name == "Engine":
        from gracelm.engine.engine import Engine

        return Engine
    if name == "AsyncEngine":
        from gracelm.engine.async_engine import AsyncEngine

        return AsyncEngine
    if name in ("RequestOutput", "CompletionOutput"):
        from gracelm.engine import output_processor

        return getattr(output_processor, name)
    raise AttributeError(f"module 'gracelm' has no attribute {name!r}")
