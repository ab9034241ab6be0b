"""The tokenizer and chat template of a Hugging Face model folder.

`tokenizer.json` is the vocabulary; the special tokens come from `tokenizer_config.json`,
with end-of-sequence ids also taken from `config.json` and `generation_config.json`, since
instruct models often list their end-of-turn token only there.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from servefleet.text.tokenizer_spec import TokenizerError, TokenizerSpec


def hf_tokenizer_parts(folder: Path) -> tuple[HFTokenizer, TokenizerSpec]:
    """The `tokenizers` backend from `tokenizer.json` and the spec from the config files."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise TokenizerError(f"{folder} has no tokenizer.json")
    backend = HFTokenizer.from_file(str(path))
    config = _read_json(folder / "tokenizer_config.json")
    model_config = _read_json(folder / "config.json")
    generation = _read_json(folder / "generation_config.json")

    def token_text(key: str) -> str | None:
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        return value if isinstance(value, str) else None

    def id_of(text: str | None) -> int | None:
        return None if text is None else backend.token_to_id(text)

    bos, eos, pad = token_text("bos_token"), token_text("eos_token"), token_text("pad_token")
    eos_ids: list[int] = []
    for source in (id_of(eos), model_config.get("eos_token_id"), generation.get("eos_token_id")):
        for value in source if isinstance(source, list) else [source]:
            if value is not None and int(value) not in eos_ids:
                eos_ids.append(int(value))
    bos_id = id_of(bos)
    if bos_id is None and model_config.get("bos_token_id") is not None:
        bos_id = int(model_config["bos_token_id"])
    spec = TokenizerSpec(
        bos_token_id=bos_id,
        eos_token_ids=eos_ids,
        pad_token_id=id_of(pad),
        add_bos_token=bool(config.get("add_bos_token", False)),
        bos_token=bos,
        eos_token=eos,
        pad_token=pad,
        unk_token=token_text("unk_token"),
    )
    return backend, spec


def hf_chat_template(folder: Path) -> str | None:
    """The template from `chat_template.jinja` or `tokenizer_config.json` (default entry)."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = _read_json(folder / "tokenizer_config.json").get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}
