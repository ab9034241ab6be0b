"""llama.cpp's token types (`tokenizer.ggml.token_type`), read by both GGUF vocabularies."""

from __future__ import annotations

from enum import IntEnum


class TokenType(IntEnum):
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6
