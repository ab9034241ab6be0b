"""The tokenizer and chat template a GGUF file describes in its metadata.

llama.cpp stores the vocabulary as `tokenizer.ggml.*` fields: byte-level BPE (`gpt2`) with
merges, or SentencePiece BPE (`llama`) with scores. The fields come from a `GGUFReader`
(values read through `.contents()`) or from a plain dict of decoded values, which is how
tests describe a variant without writing a file.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import processors

from servefleet.text.byte_level_bpe import byte_level_bpe
from servefleet.text.sentencepiece_bpe import sentencepiece_bpe
from servefleet.text.tokenizer_spec import TokenizerError, TokenizerSpec

GGUFFields = Mapping[str, Any]


def read_gguf_fields(path: Path) -> GGUFFields:
    """The metadata of a GGUF file; `gguf` is imported here, on use, for its start-up cost."""
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path)).fields
    except (OSError, ValueError) as exc:
        raise TokenizerError(f"cannot read GGUF file {path}: {exc}") from exc


def field_value(fields: GGUFFields, key: str, default: Any = None) -> Any:
    value = fields.get(key, default)
    return value.contents() if hasattr(value, "contents") else value


def gguf_chat_template(fields: GGUFFields) -> str | None:
    template = field_value(fields, "tokenizer.chat_template")
    return None if template is None else str(template)


def gguf_tokenizer_parts(fields: GGUFFields) -> tuple[HFTokenizer, TokenizerSpec]:
    """The `tokenizers` backend and the special-token spec the metadata describes."""
    kind = field_value(fields, "tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise TokenizerError(
            f"GGUF tokenizer model {kind!r} is not supported (byte-level BPE 'gpt2' and "
            "SentencePiece BPE 'llama' are); serve the Hugging Face folder with "
            "tokenizer.json instead"
        )
    tokens: list[str] = list(field_value(fields, "tokenizer.ggml.tokens") or [])
    if not tokens:
        raise TokenizerError("GGUF metadata has no tokenizer.ggml.tokens")
    backend = _vocabulary(fields, kind, tokens)
    spec = _spec(fields, kind, tokens)
    bos = spec.bos_token_id
    if spec.add_bos_token and bos is not None:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A",
            pair=f"{tokens[bos]} $A {tokens[bos]} $B",
            special_tokens=[(tokens[bos], bos)],
        )
    return backend, spec


def _vocabulary(fields: GGUFFields, kind: str, tokens: list[str]) -> HFTokenizer:
    token_types: list[int] = list(field_value(fields, "tokenizer.ggml.token_type") or [])
    if kind == "gpt2":
        merges: list[str] = list(field_value(fields, "tokenizer.ggml.merges") or [])
        pre = field_value(fields, "tokenizer.ggml.pre")
        return byte_level_bpe(tokens, merges, token_types, pre)
    scores: list[float] = list(field_value(fields, "tokenizer.ggml.scores") or [])
    if len(scores) != len(tokens):
        raise TokenizerError(
            "a SentencePiece ('llama') GGUF tokenizer needs one tokenizer.ggml.scores "
            f"entry per token ({len(tokens)} tokens, {len(scores)} scores)"
        )
    add_prefix = bool(field_value(fields, "tokenizer.ggml.add_space_prefix", True))
    return sentencepiece_bpe(tokens, scores, token_types, add_prefix)


def _spec(fields: GGUFFields, kind: str, tokens: list[str]) -> TokenizerSpec:
    def token_id(key: str) -> int | None:
        value = field_value(fields, f"tokenizer.ggml.{key}")
        return None if value is None else int(value)

    def text_of(token: int | None) -> str | None:
        return None if token is None else tokens[token]

    bos, eos, pad = token_id("bos_token_id"), token_id("eos_token_id"), token_id("padding_token_id")
    candidates = (eos, token_id("eot_token_id"), token_id("eom_token_id"))
    return TokenizerSpec(
        bos_token_id=bos,
        eos_token_ids=list(dict.fromkeys(i for i in candidates if i is not None)),
        pad_token_id=pad,
        # llama.cpp's default: SentencePiece models start with BOS unless told otherwise.
        add_bos_token=bool(field_value(fields, "tokenizer.ggml.add_bos_token", kind == "llama")),
        bos_token=text_of(bos),
        eos_token=text_of(eos),
        pad_token=text_of(pad),
        unk_token=text_of(token_id("unknown_token_id")),
    )
