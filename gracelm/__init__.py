"""gracelm: an LLM inference server with a clean lifecycle."""

from gracelm.sampling_params import SamplingParams

__all__ = ["AsyncEngine", "Engine", "SamplingParams", "RequestOutput", "CompletionOutput"]


def __getattr__(name: str):
    # The engines pull in torch and zmq; import them only when asked, so `import gracelm` stays light.
    if name in ("Engine", "AsyncEngine"):
        from gracelm.engine import engine

        return getattr(engine, name)
    if name in ("RequestOutput", "CompletionOutput"):
        from gracelm.engine import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module 'gracelm' has no attribute {name!r}")
