"""Splicing the streams of several replicas into one client stream (mid-stream failover).

A resumable stream is sent upstream with `return_token_ids` and a seed
(`servefleet.api.stream_resume`). Each event passes through `StreamSplice.rewrite`, which
takes the token ids out (they are the gateway's, not the client's), remembers them as
delivered, and gives every event the first replica's `id` and `created`. When the replica
breaks, `continuation_body` asks the next one for the rest: exactly, from the delivered token
ids, on our engine; from the delivered text on engines that cannot resume from ids (vLLM,
SGLang), whose usage is then stitched here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from servefleet.api.seeds import new_seed
from servefleet.api.stream_resume import RESUME_TOKEN_IDS, RETURN_TOKEN_IDS


@dataclass(slots=True)
class StreamSplice:
    """What a stream keeps across replicas: one id, the delivered tokens, how often it moved."""

    chat: bool
    exact: bool  # the engines resume from token ids; else from the delivered text
    seed: int | None = None  # what every replica samples with (sent back as SEED_HEADER)
    delivered_ids: list[int] = field(default_factory=list)
    delivered_text: str = ""
    delivered_events: int = 0  # token-carrying events: the token count where ids are not sent
    resumed_after: int = 0  # tokens the client had when the current replica took over
    continuations: int = 0
    stream_id: Any = None
    created: Any = None
    broken: bool = False  # the replica sent an error event instead of the rest

    @property
    def delivered(self) -> int:
        return len(self.delivered_ids) if self.exact else self.delivered_events

    def rewrite(self, payload: dict[str, Any]) -> dict[str, Any] | None:
        """The event the client gets, or None when it has nothing for the client."""
        if "error" in payload and "choices" not in payload:
            self.broken = True  # the engine failed mid-stream: the next replica continues
            return None
        choices = payload.get("choices") or []
        for choice in choices:
            self.delivered_ids.extend(choice.pop("token_ids", None) or ())
            text = _text_of(choice)
            self.delivered_text += text
            self.delivered_events += bool(text)
        if self.stream_id is None:
            self.stream_id, self.created = payload.get("id"), payload.get("created")
        else:
            payload["id"], payload["created"] = self.stream_id, self.created
            if self.chat and choices and all(_is_role_only(c) for c in choices):
                return None  # a continuation's opening chunk: the client has had one
        usage = payload.get("usage")
        if not self.exact and self.resumed_after and isinstance(usage, dict):
            _stitch_usage(usage, self.resumed_after)
        return payload


def _text_of(choice: dict[str, Any]) -> str:
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return str(delta.get("content") or "")
    return str(choice.get("text") or "")


def _is_role_only(choice: dict[str, Any]) -> bool:
    delta = choice.get("delta") or {}
    return not delta.get("content") and not choice.get("finish_reason") and "role" in delta


def _stitch_usage(usage: dict[str, Any], resumed_after: int) -> None:
    """An approximate continuation's usage counts the text it was given as prompt: move it."""
    usage["prompt_tokens"] = max(0, int(usage.get("prompt_tokens") or 0) - resumed_after)
    usage["completion_tokens"] = int(usage.get("completion_tokens") or 0) + resumed_after
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]


def resumable(parsed: dict[str, Any], *, stream: bool) -> bool:
    """A stream of one choice whose every token the gateway can follow (no tool-call deltas)."""
    return stream and int(parsed.get("n") or 1) == 1 and not parsed.get("tools")


def first_body(parsed: dict[str, Any], *, exact: bool) -> dict[str, Any]:
    """The first replica's request: token ids reported, and a seed so a continuation is exact."""
    body = dict(parsed)
    if exact:
        body[RETURN_TOKEN_IDS] = True
    if body.get("seed") is None:
        body["seed"] = new_seed()
    return body


def continuation_body(first: dict[str, Any], splice: StreamSplice) -> dict[str, Any]:
    """The next replica's request: the first one plus everything the client already has."""
    splice.resumed_after = splice.delivered
    if splice.exact:
        return {**first, RESUME_TOKEN_IDS: list(splice.delivered_ids)}
    body = dict(first)
    for name in ("max_tokens", "max_completion_tokens"):
        if body.get(name) is not None:
            body[name] = max(1, int(body[name]) - splice.delivered)
    if splice.chat:  # vLLM/SGLang: the delivered text as the assistant's unfinished message
        prefix = {"role": "assistant", "content": splice.delivered_text}
        body["messages"] = [*body["messages"], prefix]
        body["continue_final_message"] = True
        body["add_generation_prompt"] = False
    else:
        body["prompt"] = str(body["prompt"]) + splice.delivered_text
    return body


def encode(body: dict[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()
