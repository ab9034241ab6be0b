"""Batch-invariant mode: a sequence's logits as a pure function of its tokens.

A seeded answer is a function of (seed, position) and of the logits; those logits must
then not depend on whether the prompt was computed cold, from the prefix cache, in
chunks of any size, alone or next to other sequences. Decode steps already are: their
rows go through row-wise C kernels (matmuls with one accumulator per output, summed in
a fixed order; the paged decode kernel; fused norm / RoPE / SwiGLU). Prompt rows
otherwise take MKL's blocked GEMM and SDPA, whose sums depend on the chunk. In this mode
they take the decode kernels too: matmuls in `max_rows`-row calls
(`SmallRowsMatmul.invariant`), attention per row through the decode kernel
(`PagedAttention.per_row_prefill`), the lm_head in the decode steps' weight form.
"""

from __future__ import annotations

import dataclasses

import torch

from servefleet.api.engine_flags import BatchInvariantChoice
from servefleet.engine.config import EngineSettingsError
from servefleet.engine.kernels.cpu_paged_decode import CpuPagedDecode
from servefleet.engine.kernels.matmul import SmallRowsMatmul
from servefleet.engine.model.llama import LlamaForCausalLM


def invariance_blocker(model: LlamaForCausalLM) -> str | None:
    """Why this model cannot run batch-invariant (None: it can)."""
    device, dtype = model.norm.device, model.norm.dtype
    matmul = model.matmul
    if device.type != "cpu":
        return f"no batch-invariant kernels on {device.type} yet"
    if dtype != torch.float32:
        return f"the invariant kernels are float32; the model runs in {dtype}"
    if not isinstance(matmul, SmallRowsMatmul):
        return "it needs the cpu-c matmuls (--matmul auto or cpu-c, a C compiler)"
    if matmul.bf16_min_rows is not None:
        return "--matmul-dtype bfloat16 rounds by a call's row count"
    if model.fused_ops is None:
        return "the fused C ops did not build"
    if not isinstance(model.attn_impl.decode_kernel, CpuPagedDecode):
        return "it needs the cpu-c decode kernel (--decode-kernel auto or cpu-c)"
    return None


def resolve_batch_invariant(choice: BatchInvariantChoice, model: LlamaForCausalLM) -> bool:
    """`auto`: on wherever the model can run invariant; `on` where it cannot is refused."""
    if choice == "off":
        return False
    blocker = invariance_blocker(model)
    if choice == "on" and blocker is not None:
        raise EngineSettingsError(f"--batch-invariant on: {blocker}")
    return blocker is None


def apply_batch_invariance(model: LlamaForCausalLM, on: bool) -> None:
    """Switch the model's kernels into (or out of) batch-invariant mode; a model shared by
    several engines takes the last engine's setting."""
    model.attn_impl.per_row_prefill = on
    matmul = model.matmul
    if isinstance(matmul, SmallRowsMatmul) and matmul.invariant != on:
        model.set_matmul(dataclasses.replace(matmul, invariant=on))
