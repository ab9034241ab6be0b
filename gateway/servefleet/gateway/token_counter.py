"""Exact prompt token counts at admission, from the model's own tokenizer and chat template.

Optional: a deployment names a model source (`tokenizer:` in its gateway config — a built-in
name, a GGUF file or a Hugging Face folder) and the gateway loads the tokenizer from it in a
worker thread after start, so startup is not held up and torch is never imported (the GGUF
metadata is read with `gguf` alone). Until it is loaded, or when the model is not available on
this machine, the fast character estimate (`prompt.PromptReader`) is used; either way exact
usage is settled at the end of the response.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from servefleet.engine.chat_template import ChatTemplate
from servefleet.engine.model.builtin import is_builtin, resolve_builtin
from servefleet.engine.tokenizer import Tokenizer

log = logging.getLogger("servefleet.gateway.tokens")


class PromptTokenCounter:
    """Counts what the engine will count: the rendered chat template, tokenized."""

    def __init__(self, tokenizer: Tokenizer, template: ChatTemplate) -> None:
        self.tokenizer = tokenizer
        self.template = template

    def chat(self, messages: Sequence[Mapping[str, Any]]) -> int | None:
        """Tokens of the rendered conversation; None when it cannot be rendered here."""
        try:
            plain = [{"role": m.get("role"), "content": _text(m.get("content"))} for m in messages]
            text = self.template.render(plain, add_generation_prompt=True)
        except Exception:  # a template that refuses these messages: the engine will say why
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
    path = resolve_builtin(source) if is_builtin(source) else Path(source).expanduser()
    if path.is_dir():
        tokenizer = Tokenizer.from_hf_folder(path)
        return PromptTokenCounter(tokenizer, _template(_hf_template(path), tokenizer))
    if path.is_file():
        from gguf import GGUFReader

        try:
            reader = GGUFReader(str(path))
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read GGUF file {path}: {exc}") from exc
        tokenizer = Tokenizer.from_gguf_fields(reader.fields)
        field = reader.fields.get("tokenizer.chat_template")
        source_text = None if field is None else str(field.contents())
        return PromptTokenCounter(tokenizer, _template(source_text, tokenizer))
    raise ValueError(f"model source {source!r} is not a built-in, a file or a folder here")


def _template(source: str | None, tokenizer: Tokenizer) -> ChatTemplate:
    return ChatTemplate(source, tokenizer.special_tokens_map())


def _hf_template(folder: Path) -> str | None:
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    config = folder / "tokenizer_config.json"
    if not config.is_file():
        return None
    template = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return str(content)
