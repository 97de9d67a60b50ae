"""The `gracelm` command: `gracelm serve ...` (the HTTP server) and `gracelm generate ...` (one prompt,
streamed to stdout). Engine options are shared by both and map one to one onto `EngineConfig`."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys

from gracelm.config import EngineConfig
from gracelm.lifecycle.exit_codes import ExitCode

# TEST-ONLY: a JSON object merged into `EngineConfig.extra`, for the lifecycle tests to inject failures into a
# real server (`test_slow_load_s`, `test_raise_after_steps`, `test_hang_after_steps`; see engine/core.py).
# Never set it in production.
TEST_HOOKS_ENV = "GRACELM_TEST_HOOKS"


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = EngineConfig()
    group = parser.add_argument_group("model and engine")
    group.add_argument("--model", default=None,
                       help="a Hugging Face model directory or a .gguf file (default: SmolLM2-135M-Instruct)")
    group.add_argument("--dtype", default=defaults.dtype, choices=["auto", "float32", "bfloat16", "float16"])
    group.add_argument("--tensor-parallel-size", type=int, default=defaults.tensor_parallel_size)
    group.add_argument("--max-model-len", type=int, default=None,
                       help="prompt plus output tokens of one request (default: the model's limit)")
    group.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs,
                       help="requests run together at most")
    group.add_argument("--max-num-batched-tokens", type=int, default=defaults.max_num_batched_tokens,
                       help="tokens computed per step at most (longer prefills are chunked)")
    group.add_argument("--block-size", type=int, default=defaults.block_size,
                       help="tokens per KV-cache block")
    group.add_argument("--kv-cache-memory", default=None,
                       help="KV-cache size, e.g. 2GiB (default: a share of the available memory)")
    group.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                       help="do not reuse the KV cache of identical prompt prefixes")
    group.add_argument("--shutdown-timeout", type=float, default=defaults.shutdown_timeout,
                       help="seconds running requests may take to finish at a stop (0: abort at once)")
    group.add_argument("--drain-grace-period", type=float, default=defaults.drain_grace_period,
                       help="seconds to keep accepting new requests after readiness turns 503 at a stop")
    group.add_argument("--engine-hang-timeout", type=float, default=defaults.engine_hang_timeout,
                       help="seconds without step progress, with work pending, before a fatal stop (0: off)")
    group.add_argument("--shutdown-report", default=None, help="write the shutdown report as JSON here")
    group.add_argument("--nnodes", type=int, default=defaults.nnodes, help="machines in the parallel group")
    group.add_argument("--node-rank", type=int, default=defaults.node_rank, help="this machine's rank")
    group.add_argument("--dist-init-addr", default=None,
                       help="HOST:PORT of the torch.distributed rendezvous (needed when nnodes > 1)")
    group.add_argument("--seed", type=int, default=defaults.seed, help="seed of requests that have none")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Raises `ValueError` on invalid values."""
    return EngineConfig(
        model=args.model, dtype=args.dtype, tensor_parallel_size=args.tensor_parallel_size,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory, enable_prefix_caching=args.enable_prefix_caching,
        shutdown_timeout=args.shutdown_timeout, drain_grace_period=args.drain_grace_period,
        engine_hang_timeout=args.engine_hang_timeout, shutdown_report=args.shutdown_report,
        nnodes=args.nnodes, node_rank=args.node_rank, dist_init_addr=args.dist_init_addr, seed=args.seed,
        extra=_test_hooks(),
    )


def _test_hooks() -> dict:
    text = os.environ.get(TEST_HOOKS_ENV)
    if not text:
        return {}
    try:
        hooks = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{TEST_HOOKS_ENV} is not valid JSON: {e}") from None
    if not isinstance(hooks, dict):
        raise ValueError(f"{TEST_HOOKS_ENV} must be a JSON object")
    logging.getLogger(__name__).warning("test-only hooks active: %s", hooks)
    return hooks


def _add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument("--chat", action="store_true",
                        help="send the prompt as a user message, through the model's chat template")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (the default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")


def run_generate(args: argparse.Namespace) -> int:
    """Streams the completion of one prompt to stdout, as it is generated."""
    from gracelm.engine.engine import AsyncEngine
    from gracelm.sampling_params import SamplingParams

    try:
        config = engine_config_from_args(args)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                stop=args.stop)
    except ValueError as e:
        print(f"gracelm generate: {e}", file=sys.stderr)
        return ExitCode.USAGE
    try:
        engine = AsyncEngine.from_config(config)
    except Exception as e:
        print(f"gracelm generate: the engine failed to start: {e}", file=sys.stderr)
        return ExitCode.STARTUP_FAILURE
    try:
        prompt = (engine.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
                  if args.chat else args.prompt)
        asyncio.run(_stream(engine, prompt, params))
    except ValueError as e:
        print(f"gracelm generate: {e}", file=sys.stderr)
        return ExitCode.USAGE
    finally:
        engine.shutdown(timeout=0)
    return ExitCode.CLEAN_STOP


async def _stream(engine, prompt: str | list[int], params) -> None:
    printed = 0
    async for output in engine.generate(prompt, params, request_id="cli"):
        text = output.outputs[0].text
        sys.stdout.write(text[printed:])
        sys.stdout.flush()
        printed = len(text)
    sys.stdout.write("\n")
    sys.stdout.flush()


def _run_serve(args: argparse.Namespace) -> int:
    if args.nnodes > 1 and args.node_rank > 0:
        return _run_headless(args)
    from gracelm.entrypoints.api_server import run_server

    return run_server(args)


def _run_headless(args: argparse.Namespace) -> int:
    """A node other than node 0 serves no HTTP: it runs its tensor-parallel worker ranks for node 0."""
    from gracelm.parallel.headless import run_headless

    try:
        config = engine_config_from_args(args)
    except ValueError as e:
        print(f"gracelm serve: {e}", file=sys.stderr)
        return ExitCode.USAGE
    return run_headless(config)


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gracelm", description="An LLM inference server.")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    add_engine_arguments(serve)
    # The server's module pulls in FastAPI and uvicorn: imported only when the command is `serve`.
    if argv[:1] == ["serve"]:
        from gracelm.entrypoints.api_server import add_serve_arguments

        add_serve_arguments(serve)
    serve.set_defaults(handler=_run_serve)
    generate = commands.add_parser("generate", help="generate from one prompt, streamed to stdout")
    add_engine_arguments(generate)
    _add_generate_arguments(generate)
    generate.set_defaults(handler=run_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    level = logging.INFO if args.command == "serve" else logging.WARNING
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
