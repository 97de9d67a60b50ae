"""gracelm: an LLM inference server with a clean lifecycle."""

__all__ = ["AsyncEngine", "Engine", "SamplingParams", "RequestOutput", "CompletionOutput"]


def __getattr__(name: str):
    # Each name is imported when first asked for: the engines pull in zmq, tokenizers and the engine's
    # machinery, `SamplingParams` msgspec. `import gracelm`, which every import of a submodule runs first,
    # stays light, so that the server's command starts its engine core sooner.
    if name == "SamplingParams":
        from gracelm.sampling_params import SamplingParams

        return SamplingParams
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
