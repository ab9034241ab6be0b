"""Exact prompt token counts at admission, from the model's own tokenizer and chat template.

Optional: a deployment names a model source (`tokenizer:` in its gateway config — a built-in
name, a GGUF file or a Hugging Face folder) and the gateway loads the tokenizer from it in a
worker thread after start, so startup is not held up and torch is never imported
(`servefleet.text` reads the GGUF metadata with `gguf` alone). Until it is loaded, or when the
model is not available on this machine, the fast character estimate (`prompt.PromptReader`)
is used; either way exact usage is settled at the end of the response.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from servefleet.text.chat_template import ChatTemplate, ChatTemplateError
from servefleet.text.messages import template_messages
from servefleet.text.model_text import load_model_text
from servefleet.text.tokenizer import Tokenizer


class PromptTokenCounter:
    """Counts what the engine will count: the rendered chat template, tokenized."""

    def __init__(self, tokenizer: Tokenizer, template: ChatTemplate) -> None:
        self.tokenizer = tokenizer
        self.template = template

    def chat(self, messages: Sequence[Mapping[str, Any]]) -> int | None:
        """Tokens of the rendered conversation (validated messages); None when the template
        refuses them here: the engine will say why."""
        try:
            text = self.template.render(template_messages(messages), add_generation_prompt=True)
        except ChatTemplateError:
            return None
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def completion(self, prompt: Any) -> int | None:
        if isinstance(prompt, str):
            return len(self.tokenizer.encode(prompt))
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            return sum(len(self.tokenizer.encode(p)) for p in prompt)
        return None  # token ids are counted exactly without a tokenizer


def load_token_counter(source: str) -> PromptTokenCounter:
    """The counter for a model source; raises ValueError when it is not available here."""
    text = load_model_text(source)
    return PromptTokenCounter(text.tokenizer, text.chat_template)
