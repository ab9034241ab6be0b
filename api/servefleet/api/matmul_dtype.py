"""The dtypes servefleet's engine multiplies projections in (`--matmul-dtype`), one definition.

float32 is exact against the model's float weights and batch-invariant. bfloat16 rounds x
and W to bfloat16 and sums in float32 in every projection call of 8 or more rows (prompt
chunks through oneDNN, decode steps of 8+ sequences through the packed C kernels where the
CPU has AVX512_BF16): ~2.7x the prefill rate and ~1.5x the decode matmul rate at 16 rows on
such CPUs, at ~+0.1-0.3 % perplexity. Pass it to an LLMDeployment's engine through
`engine.args`.
"""

from __future__ import annotations

from typing import Literal, get_args

MatmulDtype = Literal["float32", "bfloat16"]
MATMUL_DTYPES: tuple[str, ...] = get_args(MatmulDtype)
