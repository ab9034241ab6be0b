"""The engine's side of the OpenAI API: ids, usage, and request -> sampling params.

The request bodies themselves are shared with the gateway (`servefleet.api.openai_requests`);
what only the engine knows (the vocabulary, its `SamplingParams`) is applied here.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from servefleet.api.openai_errors import OpenAIError
from servefleet.api.openai_requests import SamplingRequest
from servefleet.engine.sampling_params import SamplingParams
from servefleet.engine.sequence import Priority


def priority_value(body: SamplingRequest) -> int:
    if isinstance(body.priority, str):
        return Priority.INTERACTIVE if body.priority == "interactive" else Priority.BATCH
    return body.priority


def sampling_params(
    body: SamplingRequest, max_tokens: int, logprobs: int | None, vocab_size: int
) -> SamplingParams:
    """The engine's settings for a validated request; token ids are checked against the vocab."""
    bias = body.token_bias
    for name, ids in (("logit_bias", list(bias)), ("stop_token_ids", body.stop_token_ids or [])):
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise OpenAIError(
                status=400,
                message=f"{name}: token ids out of range [0, {vocab_size}): {bad[:5]}",
                param=name,
            )
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=max(body.top_k, 0),
        seed=body.seed,
        stop=tuple(body.stop_strings),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        logprobs=logprobs,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        ignore_eos=body.ignore_eos,
        include_stop_str_in_output=body.include_stop_str_in_output,
        logit_bias=tuple(sorted(bias.items())),
    )


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
