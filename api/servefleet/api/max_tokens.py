"""What one choice may generate when a request names no `max_tokens`: decided here, once.

The engine generates at most this and the gateway reserves exactly this against a tenant's
token limits, so the two cannot disagree. Per endpoint, as OpenAI and vLLM do it: a chat may
run to the end of the context; a legacy text completion stops after 16 tokens (OpenAI's
documented default for `/v1/completions`).
"""

from __future__ import annotations

COMPLETIONS_DEFAULT_MAX_TOKENS = 16


def completion_budget(
    requested: int | None, *, chat: bool, prompt_tokens: int, context_length: int
) -> int:
    """Tokens one choice may generate: `requested` when the client set it; else, for a chat,
    what the context leaves after the prompt (0 when nothing is left: the engine refuses
    that request), and for a completion `COMPLETIONS_DEFAULT_MAX_TOKENS`."""
    if requested is not None:
        return requested
    if chat:
        return max(context_length - prompt_tokens, 0)
    return COMPLETIONS_DEFAULT_MAX_TOKENS
