"""A finished or streaming answer under a tool plan -> OpenAI's message and deltas.

Whole responses carry `message.tool_calls` and `finish_reason: "tool_calls"`. Streams use
OpenAI's delta format: per call, a first delta with `index`, `id`, `type` and
`function.name` (arguments ""), then `function.arguments` pieces. A named choice streams its
arguments as they are generated (the constrained text is the arguments object); `required`
and `auto` need the whole answer to know where calls begin and end, so their deltas come when
the sequence finishes, content first. Concatenating the pieces gives the same calls as the
whole response.
"""

from __future__ import annotations

from typing import Any

from servefleet.engine.structured.tool_calls import (
    ToolPlan,
    new_call_id,
    parse_tool_output,
    tool_call_dicts,
)
from servefleet.engine.structured.tool_parsers import ParsedOutput

ARGUMENT_PIECE_CHARS = 32  # buffered arguments are streamed in pieces of this size


def _finish_reason(parsed: ParsedOutput, engine_reason: str | None) -> str | None:
    return "tool_calls" if parsed.calls and engine_reason == "stop" else engine_reason


def assistant_message(
    plan: ToolPlan, parser: str, text: str, engine_reason: str | None
) -> tuple[dict[str, Any], str | None]:
    """(message, finish_reason) of a whole chat response."""
    parsed = parse_tool_output(plan, text, parser)
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.calls:
        message["tool_calls"] = tool_call_dicts(parsed.calls)
    return message, _finish_reason(parsed, engine_reason)


def _call_delta(index: int, **function: str) -> dict[str, Any]:
    return {"tool_calls": [{"index": index, "function": function}]}


class ToolCallStream:
    """One choice's stream: text pieces in, delta objects out."""

    def __init__(self, plan: ToolPlan, parser: str) -> None:
        self.plan = plan
        self.parser = parser
        self.text = ""
        self.started = False

    def feed(self, piece: str) -> list[dict[str, Any]]:
        self.text += piece
        if self.plan.mode != "named":
            return []
        deltas = []
        if not self.started:
            self.started = True
            header = {
                "index": 0,
                "id": new_call_id(),
                "type": "function",
                "function": {"name": self.plan.function, "arguments": ""},
            }
            deltas.append({"tool_calls": [header]})
        if piece:
            deltas.append(_call_delta(0, arguments=piece))
        return deltas

    def finish(self, engine_reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """Deltas still owed at the end, and the choice's finish_reason."""
        parsed = parse_tool_output(self.plan, self.text, self.parser)
        if self.plan.mode == "named":
            return [], _finish_reason(parsed, engine_reason)
        deltas: list[dict[str, Any]] = []
        if parsed.content:
            deltas.append({"content": parsed.content})
        for index, call in enumerate(tool_call_dicts(parsed.calls)):
            header = {**call, "index": index, "function": {**call["function"], "arguments": ""}}
            deltas.append({"tool_calls": [header]})
            args = call["function"]["arguments"]
            for start in range(0, len(args), ARGUMENT_PIECE_CHARS):
                piece = args[start : start + ARGUMENT_PIECE_CHARS]
                deltas.append(_call_delta(index, arguments=piece))
        return deltas, _finish_reason(parsed, engine_reason)

    def choices(
        self, index: int, piece: str, finished: bool, engine_reason: str | None
    ) -> list[dict[str, Any]]:
        """Stream-chunk choices for one step's output of this choice."""
        deltas = self.feed(piece)
        reason = None
        if finished:
            tail, reason = self.finish(engine_reason)
            deltas += tail
        out: list[dict[str, Any]] = [
            {"index": index, "delta": d, "logprobs": None, "finish_reason": None} for d in deltas
        ]
        if finished:
            out.append({"index": index, "delta": {}, "logprobs": None, "finish_reason": reason})
        return out
