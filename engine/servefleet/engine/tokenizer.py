"""Text <-> token ids, built from GGUF metadata or a Hugging Face `tokenizer.json`.

A thin layer over the `tokenizers` library: the GGUF path rebuilds the byte-level BPE that
llama.cpp describes (vocabulary, merges, control tokens, pre-tokenizer regex chosen by
`tokenizer.ggml.pre`) or a SentencePiece BPE from pieces and scores (`sentencepiece_bpe`),
and the result is serialisable to `tokenizer.json`, so the weight
cache can store it and warm starts skip the rebuild.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from functools import cache
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from servefleet.engine.sentencepiece_bpe import sentencepiece_bpe

# llama.cpp token types (tokenizer.ggml.token_type).
_CONTROL = 3
_USER_DEFINED = 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# `tokenizer.ggml.pre` -> split regex, following llama.cpp's llama-vocab.cpp.
_PRE_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# Pre-tokenizers that split digits one by one before the GPT-2 regex.
_DIGIT_SPLIT_PRES = frozenset({"smollm", "starcoder", "refact", "codeshell", "command-r"})


class TokenizerError(ValueError):
    """The tokenizer description is missing or of an unsupported kind."""


class TokenizerSpec(BaseModel):
    """What the engine needs besides the vocabulary; stored next to `tokenizer.json`."""

    bos_token_id: int | None = None
    eos_token_ids: list[int] = []
    pad_token_id: int | None = None
    add_bos_token: bool = False
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    unk_token: str | None = None


@cache
def _byte_spelling() -> dict[int, str]:
    """GPT-2's byte -> character table that byte-level BPE vocabularies are spelled in."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    spelling = {b: chr(b) for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in spelling):
        spelling[b] = chr(256 + n)
    return spelling


class Tokenizer:
    """Encode/decode with the model's own vocabulary and special tokens."""

    def __init__(self, backend: HFTokenizer, spec: TokenizerSpec) -> None:
        self.backend = backend
        self.spec = spec

    # -- construction ------------------------------------------------------------------
    @classmethod
    def from_gguf_fields(cls, fields: dict[str, Any]) -> Tokenizer:
        """Build from GGUF metadata (`reader.fields` or a plain dict of decoded values)."""

        def get(key: str, default: Any = None) -> Any:
            value = fields.get(key, default)
            return value.contents() if hasattr(value, "contents") else value

        kind = get("tokenizer.ggml.model")
        if kind not in ("gpt2", "llama"):
            raise TokenizerError(
                f"GGUF tokenizer model {kind!r} is not supported (byte-level BPE 'gpt2' and "
                "SentencePiece BPE 'llama' are); serve the Hugging Face folder with "
                "tokenizer.json instead"
            )
        tokens: list[str] = list(get("tokenizer.ggml.tokens") or [])
        token_types: list[int] = list(get("tokenizer.ggml.token_type") or [])
        if not tokens:
            raise TokenizerError("GGUF metadata has no tokenizer.ggml.tokens")
        if kind == "gpt2":
            merges: list[str] = list(get("tokenizer.ggml.merges") or [])
            backend = _byte_level_bpe(tokens, merges, token_types, get("tokenizer.ggml.pre"))
        else:
            scores: list[float] = list(get("tokenizer.ggml.scores") or [])
            if len(scores) != len(tokens):
                raise TokenizerError(
                    "a SentencePiece ('llama') GGUF tokenizer needs one tokenizer.ggml.scores "
                    f"entry per token ({len(tokens)} tokens, {len(scores)} scores)"
                )
            add_prefix = bool(get("tokenizer.ggml.add_space_prefix", True))
            backend = sentencepiece_bpe(tokens, scores, token_types, add_prefix)

        def token_id(key: str) -> int | None:
            value = get(f"tokenizer.ggml.{key}")
            return None if value is None else int(value)

        bos, eos, pad = (
            token_id("bos_token_id"),
            token_id("eos_token_id"),
            token_id("padding_token_id"),
        )
        candidates = (eos, token_id("eot_token_id"), token_id("eom_token_id"))
        eos_ids = list(dict.fromkeys(i for i in candidates if i is not None))
        unk = token_id("unknown_token_id")
        spec = TokenizerSpec(
            bos_token_id=bos,
            eos_token_ids=eos_ids,
            pad_token_id=pad,
            # llama.cpp's default: SentencePiece models start with BOS unless told otherwise.
            add_bos_token=bool(get("tokenizer.ggml.add_bos_token", kind == "llama")),
            bos_token=None if bos is None else tokens[bos],
            eos_token=None if eos is None else tokens[eos],
            pad_token=None if pad is None else tokens[pad],
            unk_token=None if unk is None else tokens[unk],
        )
        if spec.add_bos_token and bos is not None:
            backend.post_processor = processors.TemplateProcessing(
                single=f"{tokens[bos]} $A",
                pair=f"{tokens[bos]} $A {tokens[bos]} $B",
                special_tokens=[(tokens[bos], bos)],
            )
        return cls(backend, spec)

    @classmethod
    def from_hf_folder(cls, folder: str | Path) -> Tokenizer:
        """Build from `tokenizer.json` (+ `tokenizer_config.json` for the special tokens)."""
        folder = Path(folder)
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
        for source in (
            id_of(eos),
            model_config.get("eos_token_id"),
            generation.get("eos_token_id"),
        ):
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
        return cls(backend, spec)

    def save(self, folder: str | Path) -> None:
        """Write `tokenizer.json` and our spec, so `load` can rebuild this exactly."""
        folder = Path(folder)
        self.backend.save(str(folder / "tokenizer.json"))
        (folder / "tokenizer_spec.json").write_text(self.spec.model_dump_json())

    @classmethod
    def load(cls, folder: str | Path) -> Tokenizer:
        folder = Path(folder)
        backend = HFTokenizer.from_file(str(folder / "tokenizer.json"))
        spec = TokenizerSpec.model_validate_json((folder / "tokenizer_spec.json").read_text())
        return cls(backend, spec)

    # -- use ---------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids; special-token text (e.g. `<|im_start|>`) maps to its single id."""
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self.spec.eos_token_ids)

    @property
    def bos_token_id(self) -> int | None:
        return self.spec.bos_token_id

    @property
    def vocab_size(self) -> int:
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def special_tokens_map(self) -> dict[str, str]:
        """bos/eos/pad/unk token strings, as chat templates expect them."""
        spec = self.spec
        pairs = {
            "bos_token": spec.bos_token,
            "eos_token": spec.eos_token,
            "pad_token": spec.pad_token,
            "unk_token": spec.unk_token,
        }
        return {k: v for k, v in pairs.items() if v is not None}


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _byte_level_bpe(
    tokens: list[str], merges: list[str], token_types: list[int], pre: str | None
) -> HFTokenizer:
    spelling = _byte_spelling()
    alphabet = set(spelling.values())
    # A token outside the byte alphabet is respelled so BPE can reach it (as transformers does).
    vocab = {
        (tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode("utf-8"))): i
        for i, tok in enumerate(tokens)
    }
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = HFTokenizer(
        models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False)  # type: ignore[arg-type]
    )
    backend.pre_tokenizer = _pre_tokenizer(pre)
    backend.decoder = decoders.ByteLevel()
    control = [
        AddedToken(tok, normalized=False, special=True)
        for tok, kind in zip(tokens, token_types, strict=False)
        if kind == _CONTROL and set(tok) <= alphabet
    ]
    backend.add_special_tokens(control)
    user_defined = [
        AddedToken(tok, normalized=False, special=False)
        for tok, kind in zip(tokens, token_types, strict=False)
        if kind == _USER_DEFINED and tok in vocab
    ]
    backend.add_tokens(user_defined)
    return backend


def _pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    split = _PRE_SPLITS.get(pre or "")
    if split is not None:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLIT_PRES:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level


class IncrementalDetokenizer:
    """Turns a growing token stream into text deltas without splitting UTF-8 characters.

    Decodes a short window of recent tokens twice (up to the last emitted token and up to the
    newest) and emits the difference, holding back while the window ends in an incomplete
    character (decoded as U+FFFD). Windowing keeps cost per token constant and keeps
    tokenizers that add or drop leading spaces at token boundaries correct.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Iterable[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids)[-6:]
        # Start the window inside the prompt so the first token decodes with its context.
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def feed(self, token_id: int) -> str:
        """Add one token; return the newly completed text (possibly empty)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return delta
        return ""

    def flush(self) -> str:
        """Whatever is still held back (e.g. a stream that ended mid-character)."""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix) :] if len(full) > len(prefix) else ""
