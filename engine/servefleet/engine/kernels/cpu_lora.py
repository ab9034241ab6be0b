"""A step's LoRA deltas in C (`sf_lora_add` in `sf_lora.h`, built into the small-matmul
library): one call per projection for every row and adapter of the step.

The PyTorch path (`lora.batch`) makes small matmuls per adapter, part and projection
(2,640 for 8 adapters over SmolLM2's 30 layers); this groups the rows by adapter in C and
streams each adapter's weights once. It shares the matmul library, so it
has the same instruction set (`SERVEFLEET_MATMUL_ISA` caps both) and the same OpenMP
threads, and the one-call decode program calls the same function through a pointer.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import torch

from servefleet.engine.kernels.cbuild import KernelBuildError
from servefleet.engine.kernels.cpu_small_gemm import CpuSmallGemm
from servefleet.engine.kernels.lora_layout import C_WEIGHT_CODES, FIELDS, LoraStep

_P = ctypes.c_void_p
_I = ctypes.c_int64
LORA_ERRORS = {
    1: "a row's adapter slot is outside the step's table",
    2: "a malformed adapter table entry",
    3: "an unsupported adapter weight dtype",
    4: "out of memory",
}


def declare(library: ctypes.CDLL) -> None:
    """Set `sf_lora_add`'s C signature, and check the table layout is the C side's."""
    library.sf_lora_add.argtypes = [_P, _P, _I, _I, _I, _P, _P, _I, _I, ctypes.c_int, ctypes.c_int]
    library.sf_lora_add.restype = ctypes.c_int
    library.sf_lora_fields.restype = ctypes.c_int
    if library.sf_lora_fields() != FIELDS:
        raise KernelBuildError("sf_lora.h and lora_layout.py disagree on the table layout")


def fits(x: torch.Tensor, out: torch.Tensor, step: LoraStep) -> bool:
    """Everything `sf_lora_add` reads through raw pointers, checked once per call."""
    rows = x.shape[0] if x.dim() == 2 else -1
    return (
        x.dtype == torch.float32
        and out.dtype == torch.float32
        and x.is_cpu
        and out.is_cpu
        and x.is_contiguous()
        and out.is_contiguous()
        and out.dim() == 2
        and out.shape[0] == rows
        and step.weight_dtype in C_WEIGHT_CODES
        and step.row_slots.shape == (rows,)
        and step.row_slots.dtype == torch.int32
        and step.row_slots.is_cpu
        and step.table.dtype == torch.int64
        and step.table.is_cpu
        and step.table.dim() == 4
        and step.table.shape[-1] == FIELDS
        and step.table.is_contiguous()
    )


@dataclass(frozen=True)
class CpuLoraKernel:
    """`LoraKernel` on the C kernel; `calls` counts the projections it added (tests read it
    to know which path ran)."""

    gemm: CpuSmallGemm
    name: str = "cpu-c"
    calls: list[int] = field(default_factory=lambda: [0], compare=False, repr=False)

    def __post_init__(self) -> None:
        declare(self.gemm.library)

    def add(
        self, x: torch.Tensor, out: torch.Tensor, step: LoraStep, layer: int, projection: int
    ) -> bool:
        if not fits(x, out, step):
            return False
        table = step.table
        slots, layers, projections, _ = table.shape
        if not (0 <= layer < layers and 0 <= projection < projections):
            raise ValueError(f"lora: no layer {layer} / projection {projection} in the table")
        status = self.gemm.library.sf_lora_add(
            x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], out.shape[1],
            step.row_slots.data_ptr(),
            table.data_ptr() + ((layer * projections + projection) * FIELDS) * 8,
            slots, layers * projections * FIELDS, C_WEIGHT_CODES[step.weight_dtype],
            torch.get_num_threads(),
        )  # fmt: skip
        if status:
            raise ValueError(f"lora: {LORA_ERRORS.get(status, f'error {status}')}")
        self.calls[0] += 1
        return True
