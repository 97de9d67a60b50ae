"""Structured-output constraints checked where a crash costs that request only: a helper process.

A constraint (a JSON schema, a regular expression, a choice, a grammar; or the schema a forced tool choice
makes) is compiled as the engine core will compile it (llguidance, with the model's tokenizer) before the
request is admitted, so that one the engine could not follow is a 400 naming its field. llguidance is
native code: a 58 KB grammar of 3,000 chained Lark rules overflowed its stack and took the server down
(SIGSEGV) when the check ran in the server's own process, and a large choice stalled the event loop for
seconds. So the check runs in `gracelm::grammar-check`, a child process started at the first constrained
request (`start_process`: it dies with the server, ignores the stop signals, stopped through the ledger),
one check at a time, with its memory (`_MEMORY_BYTES`) and each check's time (`TIMEOUT_S`) bounded. A check
that crashes the helper, or outlasts its time, is that request's 400; the next check starts a new helper.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from multiprocessing.connection import Connection

import msgspec

from gracelm.engine.async_engine import AsyncEngine
from gracelm.lifecycle.ledger import Ledger, ResourceKind
from gracelm.lifecycle.processes import ChildProcess, exit_process, start_process
from gracelm.serving.api_errors import APIError
from gracelm.structured_output import StructuredOutputs

logger = logging.getLogger(__name__)

ENTRY = "gracelm.serving.grammar_checker:serve_checks"
TIMEOUT_S = 10.0
_MEMORY_BYTES = 4 << 30  # address space: the interpreter and llguidance take a few hundred MB of it
_STOP_TIMEOUT_S = 2.0


class GrammarChecker:
    """The helper, as the server's routes use it (`check`); released through the server's ledger."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int], ledger: Ledger
                 ) -> None:
        self._tokenizer = (tokenizer_json, vocab_size, eos_token_ids)
        self._child: ChildProcess | None = None
        self._conns: tuple[Connection, Connection] | None = None  # its requests' and its replies' pipes
        self._lock = asyncio.Lock()
        ledger.acquire(ResourceKind.PROCESS, "grammar checker", self.close, timeout=_STOP_TIMEOUT_S + 6)

    @classmethod
    def for_engine(cls, engine: AsyncEngine, ledger: Ledger) -> GrammarChecker:
        """The checker of the engine's model: its tokenizer, as the engine core hands it to llguidance."""
        tokenizer = engine.tokenizer
        return cls(tokenizer.backend_json(), engine.model_config.vocab_size,
                   list(tokenizer.eos_token_ids), ledger)

    async def check(self, constraint: StructuredOutputs, field: str, allowed_token_ids: list[int] | None
                    ) -> None:
        """Raises a 400 naming `field` (or `allowed_token_ids`) when `constraint` cannot be followed: it does
        not compile, its first token fails, `allowed_token_ids` allow none of its first tokens, or its
        check crashed or outlasted `TIMEOUT_S`."""
        async with self._lock:
            requests, replies = self._pipes()
            message = msgspec.msgpack.encode((constraint, allowed_token_ids))
            try:
                await asyncio.to_thread(requests.send_bytes, message)  # a large one waits for the helper
                error = await asyncio.wait_for(_reply(replies), TIMEOUT_S)
            except TimeoutError:
                self._restart("outlasted its time")
                raise APIError(400, f"{field}: checking this constraint took more than {TIMEOUT_S:g} s; make "
                                    f"it smaller", param=field, code="invalid_value") from None
            except (EOFError, OSError):
                # Its pipe closed as it died: its end, once reaped, says how (a signal, an exit code).
                await asyncio.to_thread(self._child.join, _STOP_TIMEOUT_S)
                how = self._restart("crashed")
                raise APIError(400, f"{field}: the grammar library failed on this constraint ({how}); make "
                                    f"it smaller or simpler", param=field, code="invalid_value") from None
        if error is not None:
            param = "allowed_token_ids" if error.startswith(_DISJOINT) else field
            raise APIError(400, f"{param}: {error}", param=param, code="invalid_value")

    def close(self) -> str:
        if self._child is None:
            return "never started"
        self._child.process.kill()  # it keeps nothing
        outcome = self._child.stop(_STOP_TIMEOUT_S)
        assert self._conns is not None
        for conn in self._conns:
            conn.close()
        self._child = self._conns = None
        return outcome

    def _pipes(self) -> tuple[Connection, Connection]:
        """Two one-way pipes to the helper, started if need be: the event loop watches the replies' (its
        watch makes the descriptor non-blocking) and never writes to it."""
        if self._child is None:
            import multiprocessing

            context = multiprocessing.get_context("spawn")
            requests_in, requests_out = context.Pipe(duplex=False)
            replies_in, replies_out = context.Pipe(duplex=False)
            self._child = start_process("grammar checker", "gracelm::grammar-check", ENTRY,
                                        (requests_in, replies_out, *self._tokenizer))
            requests_in.close()
            replies_out.close()
            self._conns = (requests_out, replies_in)
        assert self._conns is not None
        return self._conns

    def _restart(self, what: str) -> str:
        """Ends the helper that `what` (logged); the next check starts another. Returns how it ended."""
        assert self._child is not None
        exit_described = self._child.describe_exit() if self._child.exitcode is not None else "killed"
        logger.warning("grammar checker pid %d %s (%s); the next check starts another", self._child.pid, what,
                       exit_described)
        self.close()
        return exit_described


async def _reply(conn: Connection) -> str | None:
    """The helper's answer, read once its pipe is readable (not on the event loop's time)."""
    loop = asyncio.get_running_loop()
    readable = loop.create_future()
    loop.add_reader(conn.fileno(), lambda: readable.done() or readable.set_result(None))
    try:
        await readable
    finally:
        loop.remove_reader(conn.fileno())
    return msgspec.msgpack.decode(conn.recv_bytes())


def serve_checks(requests: Connection, replies: Connection, tokenizer_json: str, vocab_size: int,
                 eos_token_ids: list[int]) -> None:
    """The helper: checks each constraint it is sent (`_error`) and answers None or the error; ends when
    its pipe closes."""
    from llguidance import LLTokenizer

    resource.setrlimit(resource.RLIMIT_AS, (_MEMORY_BYTES, _MEMORY_BYTES))
    tokenizer = LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos_token_ids)
    while True:
        try:
            raw = requests.recv_bytes()
        except EOFError:
            exit_process(0)
        constraint, allowed = msgspec.msgpack.decode(raw, type=tuple[StructuredOutputs, list[int] | None])
        replies.send_bytes(msgspec.msgpack.encode(_error(tokenizer, constraint, allowed)))


_DISJOINT = "none of the allowed tokens"


def _error(tokenizer: object, constraint: StructuredOutputs, allowed: list[int] | None) -> str | None:
    """What keeps the engine from following `constraint`, if anything: its JSON schema's integers beyond 64
    bits (llguidance would clamp them), a grammar that does not compile, a first token that no token of
    `allowed` is, or the first token it allows failing (a parser limit met at once)."""
    from llguidance import LLMatcher

    beyond = _integer_beyond_64_bits(constraint)
    if beyond is not None:
        return f"{beyond} is beyond 64-bit integers, which the constraint cannot keep to"
    try:
        matcher = LLMatcher(tokenizer, constraint.grammar_text(), log_level=0)
    except (ValueError, TypeError) as exc:
        return f"not a valid constraint: {_first_line(str(exc))}"
    if matcher.is_error():
        return f"not a valid constraint: {_first_line(matcher.get_error())}"
    first = _tokens(matcher.compute_bitmask())
    if allowed is not None:
        first = sorted(set(first) & set(allowed))
        if not first:
            return f"{_DISJOINT} can start the structured output"
    if first and not matcher.consume_token(first[0]):
        return f"the constraint fails at its first token: {_first_line(matcher.get_error() or 'refused')}"
    return None


def _tokens(bitmask: bytes) -> list[int]:
    return [8 * i + bit for i, byte in enumerate(bitmask) if byte for bit in range(8) if byte >> bit & 1]


def _integer_beyond_64_bits(constraint: StructuredOutputs) -> int | None:
    """A bound of a JSON schema (`minimum`, `maximum`, ...) that no 64-bit integer reaches, if any."""
    if constraint.json is None:
        return None
    pending = [msgspec.json.decode(constraint.json)]
    while pending:
        node = pending.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                if key in _BOUNDS and isinstance(value, int) and not -(2**63) <= value < 2**63:
                    return value
                pending.append(value)
        elif isinstance(node, list):
            pending.extend(node)
    return None


_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else text
