"""What a request becomes before the engine loop sees it: prompt token ids and a grammar.

Every step is bounded before it runs. The request models cap tools, schemas, choices, regexes
and grammars (`servefleet.api.request_caps`); a text whose UTF-8 length already proves it has
more tokens than the context holds (more than `max_model_len` tokens of at most
`longest_token_bytes` each) is refused before it is rendered or tokenized; the grammar is
compiled last, once the prompt is known to fit. The work itself runs through
`prepare_pool.Preparer`: inline when small, else on a worker thread within the request's
time budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from servefleet.api.openai_errors import OpenAIError
from servefleet.api.openai_messages import content_text
from servefleet.api.openai_requests import ChatCompletionRequest, CompletionRequest
from servefleet.api.request_caps import utf8_len
from servefleet.engine.prepare_pool import Budget
from servefleet.engine.request_checks import check_lengths, prompt_ids
from servefleet.engine.structured.constraint import requested_constraint

if TYPE_CHECKING:
    from xgrammar import CompiledGrammar

    from servefleet.engine.serving_state import ServingState

# Inputs up to this size (and nothing to compile) are prepared on the event loop: ~10 ms of
# tokenizing at most, less than a thread hop costs a typical request in waiting.
INLINE_PREPARE_BYTES = 16 * 1024


@dataclass
class PreparedPrompt:
    ids: list[int]
    max_tokens: int


@dataclass
class Prepared:
    prompts: list[PreparedPrompt]
    grammar: CompiledGrammar | None


def check_fits(state: ServingState, size: int, param: str) -> None:
    """Refuse a text of `size` UTF-8 bytes that has more tokens than the context holds, before
    anything tokenizes it (a 15 MB text took an engine 25 s to tokenize)."""
    per_token = state.tokenizer.longest_token_bytes
    if size > state.max_model_len * per_token:
        raise OpenAIError(
            status=400,
            message=f"This model's maximum context length is {state.max_model_len} tokens; "
            f"the {param} has {size} bytes, more than that many tokens (at most {per_token} "
            f"bytes each) hold. Please reduce the length of the {param}.",
            param=param,
            code="context_length_exceeded",
        )


def check_ids_fit(state: ServingState, count: int, param: str) -> None:
    if count > state.max_model_len:
        raise OpenAIError(
            status=400,
            message=f"This model's maximum context length is {state.max_model_len} tokens; "
            f"the {param} has {count}.",
            param=param,
            code="context_length_exceeded",
        )


def check_inputs_fit(state: ServingState, items: list[str | list[int]], param: str) -> int:
    """Each prompt (text or ids) could fit the context; returns the bytes of text among them."""
    total = 0
    for item in items:
        if isinstance(item, str):
            size = utf8_len(item)
            check_fits(state, size, param)
            total += size
        else:
            check_ids_fit(state, len(item), param)
    return total


# ---- chat ----------------------------------------------------------------------------------
def check_chat(state: ServingState, body: ChatCompletionRequest) -> bool:
    """Refuses messages that cannot fit; True when the request is small enough to prepare
    inline (no tools, little text, no grammar to compile)."""
    size = sum(utf8_len(content_text(m.content)) for m in body.messages)
    check_fits(state, size, "messages")
    return (
        not body.tools
        and size <= INLINE_PREPARE_BYTES
        and state.structured.is_cached(requested_constraint(body))
    )


def prepare_chat(state: ServingState, body: ChatCompletionRequest, budget: Budget) -> Prepared:
    """Template → tokens → lengths → grammar, each stage checked against the budget."""
    plan = state.structured.prepare_chat(body)  # tools, response_format, guided_*
    prompt = state.render_prompt(plan.messages, add_generation_prompt=True, tools=plan.tools)
    budget.check("messages", "chat template")
    check_fits(state, utf8_len(prompt), "messages")
    ids = state.tokenizer.encode(prompt, add_special_tokens=False)
    budget.check("messages", "tokenization")
    max_tokens = check_lengths(state, ids, body.requested_max_tokens, "messages", chat=True)
    grammar = state.structured.compile(plan.constraint, budget)
    return Prepared([PreparedPrompt(ids, max_tokens)], grammar)


# ---- completions ---------------------------------------------------------------------------
def check_completion(state: ServingState, body: CompletionRequest) -> bool:
    """Refuses prompts that cannot fit; True when small enough to prepare inline."""
    size = check_inputs_fit(state, body.prompts(), "prompt")
    spec = state.structured.completion_constraint(body)
    return size <= INLINE_PREPARE_BYTES and state.structured.is_cached(spec)


def prepare_completion(state: ServingState, body: CompletionRequest, budget: Budget) -> Prepared:
    prompts = []
    for prompt in body.prompts():
        ids = prompt_ids(state, prompt, "prompt")
        budget.check("prompt", "tokenization")
        max_tokens = check_lengths(state, ids, body.max_tokens, "prompt", chat=False)
        prompts.append(PreparedPrompt(ids, max_tokens))
    spec = state.structured.completion_constraint(body)
    return Prepared(prompts, state.structured.compile(spec, budget))
