"""A model source -> its tokenizer and chat template, without loading any weights.

The gateway counts prompt tokens with exactly what the engine will use, so it needs the
model's tokenizer and template but must not need torch: this reads them from a built-in
name, a GGUF file (metadata only) or a Hugging Face folder.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from servefleet.text.builtin import is_builtin, resolve_builtin
from servefleet.text.chat_template import ChatTemplate
from servefleet.text.gguf_metadata import field_value, gguf_chat_template, read_gguf_fields
from servefleet.text.hf_folder import hf_chat_template
from servefleet.text.tokenizer import Tokenizer


@dataclass(frozen=True)
class ModelText:
    """What turns a model's messages into token ids and back."""

    tokenizer: Tokenizer
    chat_template: ChatTemplate
    context_length: int | None = None  # the model's own (positions), when its files say it


def load_model_text(source: str) -> ModelText:
    """Tokenizer and template of a built-in name, GGUF file or Hugging Face folder.

    Raises ValueError (`TokenizerError`, `UnknownModelError`, `ChatTemplateError` among
    them) when the source is not on this machine or cannot be read.
    """
    path = Path(source).expanduser()
    if is_builtin(source) and not path.exists():
        path = resolve_builtin(source)
    if path.is_dir():
        tokenizer = Tokenizer.from_hf_folder(path)
        template_source = hf_chat_template(path)
        context = _positive_int(_json_field(path / "config.json", "max_position_embeddings"))
    elif path.is_file():
        fields = read_gguf_fields(path)
        tokenizer = Tokenizer.from_gguf_fields(fields)
        template_source = gguf_chat_template(fields)
        arch = field_value(fields, "general.architecture")
        context = _positive_int(field_value(fields, f"{arch}.context_length"))
    else:
        raise ValueError(f"model source {source!r} is not a built-in, a file or a folder here")
    template = ChatTemplate(template_source, tokenizer.special_tokens_map())
    return ModelText(tokenizer, template, context)


def _json_field(path: Path, key: str) -> Any:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data.get(key) if isinstance(data, dict) else None


def _positive_int(value: Any) -> int | None:
    try:
        number = int(value)
    except (TypeError, ValueError):
        return None
    return number if number > 0 else None
