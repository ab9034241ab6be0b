"""The engine's structured-output service: request -> prompt inputs and compiled grammar.

One per engine process. `prepare_chat` turns `response_format`, `guided_*` and `tools` /
`tool_choice` into what the chat template is given and the constraint the sequences decode
under; `compile` turns a constraint into a grammar within the request's time budget (in a
child process, `compile_worker`). Anything that cannot be honoured is an OpenAI 400 naming
the field. The grammar library's view of the vocabulary is built on the first constrained
request (about a second for 49k tokens), so free-text serving pays nothing.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from servefleet.api.openai_errors import OpenAIError
from servefleet.api.openai_requests import ChatCompletionRequest, SamplingRequest
from servefleet.engine.prepare_pool import Budget, TooComplex
from servefleet.engine.structured.constraint import (
    ConstraintError,
    ConstraintSpec,
    requested_constraint,
)
from servefleet.engine.structured.tool_calls import ToolPlan, tool_constraint, tool_plan
from servefleet.engine.structured.tool_parsers import TOOL_CALL_PARSERS, parser_for_template
from servefleet.engine.structured.tool_prompt import template_inputs
from servefleet.text.chat_template import ChatTemplate
from servefleet.text.tokenizer import Tokenizer

if TYPE_CHECKING:  # the grammar library loads with the first grammar: seconds off start-up
    from xgrammar import CompiledGrammar

    from servefleet.engine.structured.grammars import GrammarCache


@dataclass
class ChatPreparation:
    """What a chat request becomes before it is tokenized."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None  # for the template's `tools`; None when folded in
    tool_plan: ToolPlan | None
    constraint: ConstraintSpec | None  # compiled last, once the prompt is known to fit


class StructuredOutputs:
    def __init__(
        self, tokenizer: Tokenizer, chat_template: ChatTemplate, tool_call_parser: str | None = None
    ) -> None:
        if tool_call_parser is not None and tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"unknown tool-call parser {tool_call_parser!r}; one of {TOOL_CALL_PARSERS}"
            )
        self.tokenizer = tokenizer
        self.template_source = chat_template.source
        self.tool_call_parser = tool_call_parser or parser_for_template(chat_template.source)
        self._grammars: GrammarCache | None = None
        self._lock = threading.Lock()

    @property
    def grammars(self) -> GrammarCache:
        from servefleet.engine.structured.grammars import GrammarCache

        with self._lock:
            if self._grammars is None:
                self._grammars = GrammarCache(self.tokenizer)
            return self._grammars

    def warm_up(self) -> None:
        """Start the compile processes now, not at the first constrained request."""
        self.grammars.pool.warm_up()

    def is_cached(self, spec: ConstraintSpec | None) -> bool:
        return spec is None or self.grammars.cached(spec) is not None

    def compile(
        self, spec: ConstraintSpec | None, budget: Budget | None = None
    ) -> CompiledGrammar | None:
        """The grammar, from the cache or compiled within `budget` (TooComplex past it)."""
        if spec is None:
            return None
        from servefleet.engine.structured.compile_worker import CompilerUnavailable, CompileTimeout

        try:
            return self.grammars.compile(spec, budget)
        except ConstraintError as exc:
            raise OpenAIError(status=400, message=str(exc), param=exc.param) from exc
        except CompileTimeout:
            raise TooComplex(spec.param, "grammar compilation") from None
        except CompilerUnavailable as exc:
            raise OpenAIError(
                status=503,
                message=str(exc),
                type="service_unavailable",
                headers={"Retry-After": "5"},
            ) from exc

    @staticmethod
    def completion_constraint(body: SamplingRequest) -> ConstraintSpec | None:
        return requested_constraint(body)

    def prepare_chat(self, body: ChatCompletionRequest) -> ChatPreparation:
        try:
            plan = tool_plan(body)
        except ConstraintError as exc:
            raise OpenAIError(status=400, message=str(exc), param=exc.param) from exc
        spec = requested_constraint(body)
        forced = tool_constraint(plan) if plan is not None else None
        if spec is not None and forced is not None:
            raise OpenAIError(
                status=400,
                message=f"{spec.param} and a required or named tool_choice both constrain the "
                "output; send one of them",
                param="tool_choice",
            )
        messages, tools = template_inputs(
            body.messages, plan.tools if plan is not None else None, self.template_source
        )
        return ChatPreparation(messages, tools, plan, spec or forced)
