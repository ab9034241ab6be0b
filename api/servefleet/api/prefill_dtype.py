"""The dtypes servefleet's engine runs prefill-sized matmuls in (`--prefill-dtype`), one definition.

float32 is exact against the model's float weights; bfloat16 is ~2.7x faster on CPUs that
multiply it natively (AVX512_BF16, AMX) at +0.1 % perplexity. Pass it to an
LLMDeployment's engine through `engine.args`.
"""

from __future__ import annotations

from typing import Literal, get_args

PrefillDtype = Literal["float32", "bfloat16"]
PREFILL_DTYPES: tuple[str, ...] = get_args(PrefillDtype)
PREFILL_DTYPE_FLAG = "--prefill-dtype"
