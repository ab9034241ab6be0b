"""Quantizations servefleet's engine applies at load (`--quantization`), one definition.

int8 and int4 quantize a float checkpoint's projections into the engine's packed
8-bit and 4-bit block formats; GGUF, AWQ and GPTQ checkpoints carry their own.
"""

from __future__ import annotations

from typing import Literal, get_args

LoadQuantization = Literal["int8", "int4"]
LOAD_QUANTIZATIONS: tuple[str, ...] = get_args(LoadQuantization)
