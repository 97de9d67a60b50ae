"""What every endpoint applies to a request, from `gracelm serve`'s options: the names the model answers
to, the sampling defaults for fields a request leaves out (`--generation-config`), the logprobs limit
(`--max-logprobs`) and whether requests are logged (`--disable-log-requests`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from gracelm.model.template_budget import TemplateBudget
from gracelm.model.tokenizer import Tokenizer
from gracelm.serving import reasoning_parsers
from gracelm.serving.generation_defaults import load_generation_defaults
from gracelm.serving.reasoning_parsers import ReasoningParser
from gracelm.serving.server_config import ServerConfig


@dataclass(frozen=True)
class ServingOptions:
    model_names: tuple[str, ...]  # every name a request may give as `model`; the first is reported
    defaults: dict[str, float | int] = field(default_factory=dict)  # request field -> its default
    max_logprobs: int = 20
    log_requests: bool = True
    tool_call_parser: str = "auto"  # a name of `tool_parsers.NAMES`
    template_budget: TemplateBudget | None = None  # a request's own chat template's; None: refused
    reasoning: ReasoningParser | None = None  # --reasoning-parser, resolved; None: the thinking is content

    @property
    def model_name(self) -> str:
        return self.model_names[0]


def serving_options(settings: ServerConfig, model_name: str, model_path: Path,
                    tokenizer: Tokenizer) -> ServingOptions:
    """The options of a server serving the model at `model_path` (named `model_name` by itself, read with
    `tokenizer`, whose chat template is the one served); raises `ValueError` when its generation config
    cannot be read or its reasoning parser does not fit it."""
    return ServingOptions(model_names=tuple(settings.served_model_name) or (model_name,),
                          defaults=load_generation_defaults(settings.generation_config, model_path),
                          max_logprobs=settings.max_logprobs, log_requests=not settings.disable_log_requests,
                          tool_call_parser=settings.tool_call_parser,
                          template_budget=TemplateBudget() if settings.trust_request_chat_template else None,
                          reasoning=reasoning_parsers.resolve(settings.reasoning_parser, tokenizer))
