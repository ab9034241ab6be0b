"""Decode-attention and few-row matmul kernels, and the choice between them.

Every attention kernel has the `DecodeKernel` signature of `torch_paged_decode`,
and every matmul backend the `Matmul` interface of `TORCH_MATMUL`, so the engine
can swap them freely; PyTorch is always there as fallback.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Literal, cast

import torch

from servefleet.engine.attention import DecodeKernel, torch_paged_decode
from servefleet.engine.kernels.cpu_fused_ops import CpuFusedOps, load_cpu_fused_ops
from servefleet.engine.kernels.cpu_lora import CpuLoraKernel
from servefleet.engine.kernels.cpu_paged_decode import load_cpu_paged_decode
from servefleet.engine.kernels.cpu_small_gemm import (
    ISA_CAP_ENV,
    ISA_CAP_FLAGS,
    CpuSmallGemm,
    IsaCap,
    load_cpu_small_gemm,
)
from servefleet.engine.kernels.lora_layout import LoraKernel
from servefleet.engine.kernels.matmul import (
    BF16_MIN_ROWS,
    TORCH_MATMUL,
    Matmul,
    SmallRowsMatmul,
    TorchMatmul,
)
from servefleet.engine.kernels.triton_lora import TRITON_LORA
from servefleet.engine.kernels.triton_paged_decode import triton_paged_decode, triton_unavailable

logger = logging.getLogger("servefleet.engine.kernels")

KernelName = Literal["torch", "cpu-c", "triton"]
KERNEL_NAMES: tuple[KernelName, ...] = ("torch", "cpu-c", "triton")
MatmulName = Literal["torch", "cpu-c"]
MATMUL_NAMES: tuple[MatmulName, ...] = ("torch", "cpu-c")

# Largest row count at which the C kernels beat torch (MKL) over a whole decode step's
# matmuls: `bench/small_gemm.py --crossover` (SmolLM2: 30 layers with distinct weights,
# so they stream from DRAM, + lm_head; 2 threads, AVX-512, load ~1.3). torch/C step ms:
# 1: 18.6/19.5, 2: 22.7/19.2, 4: 29.2/21.1, 8: 42.8/24.8, 16: 41.4/30.9, 24: 46.8/39.0,
# 32: 52.5/48.1, 48: 64.3/64.9, 64: 84.3/82.3; then 96: 107.2/116.8, 128: 129.3/153.5.
# 32..64 is parity within noise; one limit for all calls (the lm_head alone flips at ~24
# rows) keeps every decode step of up to 64 sequences batch-invariant. M=1 loses ~0.5 ms
# (Python call overhead) but stays on C for the same reason.
SMALL_MM_MAX_ROWS = 64


class KernelUnavailableError(RuntimeError):
    """A kernel was asked for by name but cannot run here."""


def _forced_kernel(name: str, device_type: str) -> DecodeKernel:
    if name == "torch":
        return torch_paged_decode
    if name == "cpu-c":
        if device_type != "cpu":
            raise KernelUnavailableError(f"cpu-c runs on CPU tensors, not {device_type}")
        kernel = load_cpu_paged_decode()
        if kernel is None:
            raise KernelUnavailableError("cpu-c could not be built (see the warning logged)")
        return kernel
    if name == "triton":
        reason = triton_unavailable(device_type)
        if reason is not None:
            raise KernelUnavailableError(f"triton: {reason}")
        return triton_paged_decode
    raise ValueError(
        f"unknown decode kernel {name!r}; choose one of auto, {', '.join(KERNEL_NAMES)}"
    )


def _auto_kernel(device_type: str) -> tuple[KernelName, DecodeKernel]:
    if device_type == "cuda":
        reason = triton_unavailable(device_type)
        if reason is None:
            return "triton", triton_paged_decode
        logger.info("Triton decode kernel unavailable (%s)", reason)
    elif device_type == "cpu":
        kernel = load_cpu_paged_decode()
        if kernel is not None:
            return "cpu-c", kernel
    return "torch", torch_paged_decode


@functools.cache
def _select(device_type: str, prefer: str) -> tuple[KernelName, DecodeKernel]:
    """Cached so the choice (and its log line) happens once per device type."""
    if prefer == "auto":
        name, kernel = _auto_kernel(device_type)
    else:
        kernel = _forced_kernel(prefer, device_type)
        name = cast(KernelName, prefer)  # _forced_kernel rejected unknown names
    logger.info("decode attention kernel for %s: %s (prefer=%s)", device_type, name, prefer)
    return name, kernel


def select_decode_kernel(
    device: torch.device | str, prefer: str = "auto"
) -> tuple[KernelName, DecodeKernel]:
    """Fastest kernel for `device`: CUDA → Triton, CPU → the C kernel, else PyTorch.

    `prefer` forces one ("torch", "cpu-c", "triton"); a forced kernel that cannot
    run raises KernelUnavailableError instead of silently falling back.
    """
    return _select(torch.device(device).type, prefer)


def select_small_mm(device: torch.device | str) -> CpuSmallGemm | None:
    """The C few-row matmul kernels where they run (CPU with a compiler), else None;
    built for the instruction set `SERVEFLEET_MATMUL_ISA` caps them at (default native)."""
    if torch.device(device).type != "cpu":
        return None
    return load_cpu_small_gemm(isa=_isa_cap())


def _isa_cap() -> IsaCap:
    value = os.environ.get(ISA_CAP_ENV) or "native"
    if value not in ISA_CAP_FLAGS:
        raise KernelUnavailableError(
            f"{ISA_CAP_ENV}={value!r}: choose one of {', '.join(ISA_CAP_FLAGS)}"
        )
    return cast(IsaCap, value)


def select_fused_ops(device: torch.device | str) -> CpuFusedOps | None:
    """The fused C rms_norm / RoPE+KV-write ops where they run (CPU with a compiler)."""
    if torch.device(device).type != "cpu":
        return None
    return load_cpu_fused_ops()


@functools.cache
def _cpu_lora(kernel: CpuSmallGemm) -> CpuLoraKernel:
    return CpuLoraKernel(kernel)


def select_lora_kernel(device: torch.device | str, matmul: Matmul) -> LoraKernel | None:
    """Where a step's LoRA products go: on CPU the C kernel of the C matmuls' library (so
    `--matmul torch` keeps the adapters in PyTorch too, and the one-call decode program can
    call it), on CUDA the Triton kernel where Triton runs, else None (PyTorch)."""
    device_type = torch.device(device).type
    kernel: LoraKernel | None = None
    if isinstance(matmul, SmallRowsMatmul) and device_type == "cpu":
        kernel = _cpu_lora(matmul.kernel)
    elif device_type == "cuda" and triton_unavailable(device_type) is None:
        kernel = TRITON_LORA
    logger.info("LoRA kernel for %s: %s", device_type, "torch" if kernel is None else kernel.name)
    return kernel


@functools.cache
def _select_matmul(device_type: str, prefer: str, dtype: torch.dtype) -> Matmul:
    if prefer not in ("auto", *MATMUL_NAMES):
        raise ValueError(
            f"unknown matmul backend {prefer!r}; choose one of auto, {', '.join(MATMUL_NAMES)}"
        )
    matmul: Matmul = TORCH_MATMUL
    if prefer != "torch":
        kernel = select_small_mm(device_type)
        if kernel is not None:
            bf16_min_rows = BF16_MIN_ROWS if dtype == torch.bfloat16 else None
            matmul = SmallRowsMatmul(kernel, SMALL_MM_MAX_ROWS, bf16_min_rows=bf16_min_rows)
        elif prefer == "cpu-c":
            where = "cpu-c runs on CPU tensors" if device_type != "cpu" else "it could not be built"
            raise KernelUnavailableError(f"cpu-c matmul unavailable: {where}")
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"matmul dtype {dtype} is neither float32 nor bfloat16")
    if dtype != torch.float32 and not isinstance(matmul, SmallRowsMatmul):
        raise KernelUnavailableError(
            "bfloat16 matmuls need the cpu-c matmuls (CPU, a C compiler, --matmul auto or cpu-c)"
        )
    detail = ""
    if isinstance(matmul, SmallRowsMatmul):
        products = "bf16" if matmul.kernel.bf16_products else "f32"
        detail = f" isa={matmul.kernel.isa} bf16_min_rows={matmul.bf16_min_rows} packed={products}"
    logger.info("matmul for %s: %s%s (prefer=%s)", device_type, matmul.name, detail, prefer)
    return matmul


def select_matmul(
    device: torch.device | str,
    prefer: str = "auto",
    dtype: torch.dtype = torch.float32,
) -> Matmul:
    """The model's matmul backend: on CPU the C kernels for decode-sized calls, else torch.

    `prefer="torch"|"cpu-c"` forces one; a forced cpu-c that cannot run raises
    KernelUnavailableError, as does `dtype=torch.bfloat16` (calls of `BF16_MIN_ROWS` rows
    or more in bfloat16 products) without the C kernels.
    """
    return _select_matmul(torch.device(device).type, prefer, dtype)


__all__ = [
    "BF16_MIN_ROWS",
    "KERNEL_NAMES",
    "MATMUL_NAMES",
    "SMALL_MM_MAX_ROWS",
    "TORCH_MATMUL",
    "CpuFusedOps",
    "CpuLoraKernel",
    "CpuSmallGemm",
    "DecodeKernel",
    "KernelName",
    "KernelUnavailableError",
    "LoraKernel",
    "Matmul",
    "MatmulName",
    "SmallRowsMatmul",
    "TorchMatmul",
    "select_decode_kernel",
    "select_fused_ops",
    "select_lora_kernel",
    "select_matmul",
    "select_small_mm",
    "torch_paged_decode",
]
