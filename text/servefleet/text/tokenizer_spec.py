"""What a tokenizer needs besides its vocabulary, and the error for one that cannot be built."""

from __future__ import annotations

from pydantic import BaseModel


class TokenizerError(ValueError):
    """The tokenizer description is missing or of an unsupported kind."""


class TokenizerSpec(BaseModel):
    """Special tokens and BOS policy; stored next to `tokenizer.json` so a reload is exact."""

    bos_token_id: int | None = None
    eos_token_ids: list[int] = []
    pad_token_id: int | None = None
    add_bos_token: bool = False
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    unk_token: str | None = None
