"""The `gracelm` command: `gracelm serve ...` (the HTTP server), `gracelm generate ...` (one prompt, streamed
to stdout), `gracelm run-batch -i IN -o OUT ...` (a batch input file run offline, resumably), `gracelm
deploy systemd|kubernetes|router ...` (a unit, manifests or a router's command line for `serve` with the
same options, printed), `gracelm fleet ...` (N workers behind a router on this host) and `gracelm tokenizer
[MODEL] --out DIR` (the model's tokenizer as a Hugging Face tokenizer directory). The
engine's options come from `EngineConfig` and the server's from `ServerConfig`, each declared once
(`gracelm.options`); a bad value is a usage error (exit code 2) before anything starts.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Callable

from gracelm import options
from gracelm.config import EngineConfig
from gracelm.lifecycle.exit_codes import ExitCode
from gracelm.lifecycle.faults import FaultsError, faults
from gracelm.serving.server_config import ServerConfig

logger = logging.getLogger("gracelm.cli")


def _add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    options.add_arguments(parser.add_argument_group("model and engine"), EngineConfig)
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument("--chat", action="store_true",
                        help="send the prompt as a user message, through the model's chat template")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (the default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")


def run_generate(args: argparse.Namespace) -> int:
    """Streams the completion of one prompt to stdout, as it is generated."""
    from gracelm.engine.async_engine import AsyncEngine
    from gracelm.sampling_params import SamplingParams

    try:
        config = options.from_args(EngineConfig, args)
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
    async for output in engine.generate(prompt, params, request_id="cli", delta=True):
        sys.stdout.write(output.outputs[0].text if output.outputs else "")
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()


def _add_run_batch_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-i", "--input-file", required=True, help="the batch input file (OpenAI's JSONL)")
    parser.add_argument("-o", "--output-file", required=True, help="where the output JSONL is written")
    parser.add_argument("--state-dir", default=None, help="the journal's directory, kept to resume "
                                                          "(default: OUTPUT_FILE.state)")
    options.add_arguments(parser.add_argument_group("model and engine"), EngineConfig)


def run_batch(args: argparse.Namespace) -> int:
    # The engine and the serving code: imported only to run a batch.
    from gracelm.cli.run_batch import run_batch as run

    return run(args)


def _add_tokenizer_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_path", nargs="?", default=None, metavar="MODEL",
                        help="a Hugging Face model directory or a .gguf file (default: the default model)")
    parser.add_argument("--out", required=True, metavar="DIR", help="the directory to write, new or empty")
    parser.add_argument("--force", action="store_true",
                        help="replace an earlier export in DIR (never a directory holding other files)")
    parser.add_argument("--chat-template", default=None,
                        help="a chat template (a file, or inline Jinja) written instead of the model's, as "
                             "`serve --chat-template` uses it")


def run_tokenizer(args: argparse.Namespace) -> int:
    # transformers, when the tokenizer is not in the cache: imported only to export one.
    from gracelm.cli.tokenizer_export import run

    return run(args)


def run_serve(args: argparse.Namespace) -> int:
    try:
        _merge_model_argument(args)
        engine_config = options.from_args(EngineConfig, args)
        server_config = ServerConfig.from_args(args)
    except ValueError as exc:
        logger.error("invalid options: %s", exc)
        return ExitCode.USAGE
    if engine_config.nnodes > 1 and engine_config.node_rank > 0:
        # A node other than node 0 serves no HTTP: it runs its tensor-parallel worker ranks for node 0.
        from gracelm.parallel.headless import run_headless

        return run_headless(engine_config)
    # The server's module pulls in FastAPI and uvicorn: imported only to serve.
    from gracelm.server.api_server import run_server

    return run_server(engine_config, server_config)


def _merge_model_argument(args: argparse.Namespace) -> None:
    """`gracelm serve MODEL` and `gracelm serve --model MODEL` mean the same; both at once must agree."""
    positional = args.model_path
    if positional is None:
        positional = _trailing_model(args)
    if positional is None:
        return
    given = getattr(args, "model", None)
    if given is not None and given != positional:
        raise ValueError(f"two different models given: {positional!r} and --model {given!r}")
    args.model = positional


def _trailing_model(args: argparse.Namespace) -> str | None:
    """MODEL after a repeatable option's values (`serve --api-key a b MODEL`) is read by argparse as one
    more value. The rule: when no model is named otherwise and the command line ends with an occurrence
    of a repeatable option that took two words or more, its last word is MODEL (so `--api-key KEY MODEL`
    means what it meant when the option took one value); `--api-key a --api-key b` keeps both as keys."""
    last = getattr(args, "last_repeated", None)
    if last is None or getattr(args, "model", None) is not None:
        return None
    dest, words = last
    if len(words) < 2 or getattr(args, "argv", [])[-len(words):] != words:
        return None
    getattr(args, dest).pop()
    return words[-1]


def run_deploy(args: argparse.Namespace) -> int:
    """Prints the unit or the manifests; a value that cannot be deployed is a usage error."""
    from gracelm.deploy.units import render

    try:
        _merge_model_argument(args)
        text = render(args.target, args)
    except ValueError as exc:
        print(f"gracelm deploy {args.target}: {exc}", file=sys.stderr)
        return ExitCode.USAGE
    sys.stdout.write(text)
    return ExitCode.CLEAN_STOP


def run_fleet(args: argparse.Namespace) -> int:
    """Runs N workers behind a router until a signal ends them (`gracelm/deploy/fleet.py`)."""
    from gracelm.deploy.units import fleet

    try:
        _merge_model_argument(args)
        workers = fleet(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"gracelm fleet: {exc}", file=sys.stderr)
        return ExitCode.USAGE
    return workers.run()


def _add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_path", nargs="?", default=None, metavar="MODEL",
                        help="a Hugging Face model directory or a .gguf file (same as --model)")
    options.add_arguments(parser.add_argument_group("model and engine"), EngineConfig)
    options.add_arguments(parser.add_argument_group("HTTP server"), ServerConfig)


def _add_deploy_parsers(deploy: argparse.ArgumentParser) -> None:
    from gracelm.deploy.config import TARGETS

    targets = deploy.add_subparsers(dest="target", required=True)
    for target, config in TARGETS.items():
        parser = targets.add_parser(target, help=f"print the {target} files for `gracelm serve` with these "
                                                 f"options")
        _add_serve_arguments(parser)
        options.add_arguments(parser.add_argument_group(f"{target} deployment"), config)
        parser.set_defaults(handler=run_deploy)


def _add_fleet_arguments(fleet: argparse.ArgumentParser) -> None:
    from gracelm.deploy.config import FleetConfig

    _add_serve_arguments(fleet)
    options.add_arguments(fleet.add_argument_group("fleet"), FleetConfig)


class _SubcommandParser(argparse.ArgumentParser):
    """A subcommand's parser: an unknown argument is its usage error (its usage, exit code 2), not the top
    level's, which would print `gracelm`'s usage instead of the subcommand's."""

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, extras


_AddArguments = Callable[[argparse.ArgumentParser], None]
_Handler = Callable[[argparse.Namespace], int]
# Each command: its help line, what declares its arguments and what runs it.
_COMMANDS: dict[str, tuple[str, _AddArguments, _Handler]] = {
    "serve": ("serve the OpenAI-compatible HTTP API", _add_serve_arguments, run_serve),
    "generate": ("generate from one prompt, streamed to stdout", _add_generate_arguments, run_generate),
    "run-batch": ("run an OpenAI batch input file offline, resumably", _add_run_batch_arguments, run_batch),
    "deploy": ("print a systemd unit or Kubernetes manifests for `serve`", _add_deploy_parsers, run_deploy),
    "fleet": ("serve with N local workers behind vllm-router (or sglang-router); SIGHUP restarts them one by "
              "one", _add_fleet_arguments, run_fleet),
    "tokenizer": ("write the model's tokenizer as a Hugging Face tokenizer directory (for guidellm, lm-eval)",
                  _add_tokenizer_arguments, run_tokenizer),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The command line's parser. Given the `command` the arguments name, only that command's arguments are
    declared (every command's otherwise): declaring them all would delay each start, the server's included."""
    parser = argparse.ArgumentParser(prog="gracelm", description="An LLM inference server.")
    parser.add_argument("--version", action=_VersionAction)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_SubcommandParser)
    for name, (text, add_arguments, handler) in _COMMANDS.items():
        subparser = commands.add_parser(name, help=text)
        if command in (None, name):
            add_arguments(subparser)
            subparser.set_defaults(handler=handler)
    return parser


class _VersionAction(argparse.Action):
    """`--version`: the installed version is looked up only when asked, since importlib.metadata's import
    would delay every command's start."""

    def __init__(self, option_strings: list[str], dest: str) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="show program's version number and exit")

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        print(f"gracelm {_installed_version()}")
        parser.exit()


def _installed_version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("gracelm")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv[0] if argv and argv[0] in _COMMANDS else None).parse_args(argv)
    args.argv = argv  # read by `_trailing_model`
    level = logging.INFO if args.command in ("serve", "fleet") else logging.WARNING
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        faults()  # a misspelled test fault refuses the start, before anything loads
    except FaultsError as e:
        print(f"gracelm: error: {e}", file=sys.stderr)
        return ExitCode.USAGE
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
