"""Text <-> token ids with a model's own vocabulary and special tokens.

A thin layer over the `tokenizers` library. A GGUF file's vocabulary is rebuilt from its
metadata (`gguf_metadata`) and a Hugging Face folder's is read from `tokenizer.json`
(`hf_folder`); either way the result serialises to `tokenizer.json` plus our spec, so the
engine's conversion cache can store it and warm starts skip the rebuild.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders

from servefleet.text.gguf_metadata import GGUFFields, gguf_tokenizer_parts
from servefleet.text.hf_folder import hf_tokenizer_parts
from servefleet.text.tokenizer_spec import TokenizerSpec

# We encode one text per call, so the library's thread pool buys nothing; set, it also keeps
# the library from warning in every child process forked after a batch call (local mode's
# engines, subprocesses), which it does when the variable is unset.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# A normalizer may shrink text (NFKC turns a 4-byte letter into a 1-byte one), so one token
# may then stand for more input bytes than its own spelling has.
_NORMALIZED_SHRINK = 4


class Tokenizer:
    """Encode/decode with the model's own vocabulary and special tokens."""

    def __init__(self, backend: HFTokenizer, spec: TokenizerSpec) -> None:
        self.backend = backend
        self.spec = spec

    # -- construction ------------------------------------------------------------------
    @classmethod
    def from_gguf_fields(cls, fields: GGUFFields) -> Tokenizer:
        """Build from GGUF metadata (`reader.fields` or a plain dict of decoded values)."""
        return cls(*gguf_tokenizer_parts(fields))

    @classmethod
    def from_hf_folder(cls, folder: str | Path) -> Tokenizer:
        """Build from `tokenizer.json` (+ `tokenizer_config.json` for the special tokens)."""
        return cls(*hf_tokenizer_parts(Path(folder)))

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
        """Token ids; special-token text (e.g. `<|im_start|>`) maps to its single id.

        Through the library's batch call, which releases the GIL while it works (the single
        call holds it: a 5 MB text kept every other thread of the process waiting ~6 s), so a
        long text tokenized on a worker thread leaves the event loop answering.
        """
        (encoding,) = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)
        return list(encoding.ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    @cached_property
    def longest_token_bytes(self) -> int:
        """At most how many input bytes one token stands for (computed once).

        So a text of more than `n * longest_token_bytes` UTF-8 bytes has more than n tokens,
        known before tokenizing it. Byte-level vocabularies spell each byte as one character;
        other spellings (SentencePiece's `▁`, `<0x0A>`) only overcount, which loosens the bound.
        """
        byte_level = isinstance(self.backend.decoder, decoders.ByteLevel)
        added = {t.content for t in self.backend.get_added_tokens_decoder().values()}
        longest = 1
        for token in self.backend.get_vocab(with_added_tokens=True):
            spelled = len(token) if byte_level and token not in added else len(token.encode())
            longest = max(longest, spelled)
        shrink = 1 if self.backend.normalizer is None else _NORMALIZED_SHRINK
        return longest * shrink

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
