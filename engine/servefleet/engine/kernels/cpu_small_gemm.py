"""Few-row float32 matmuls in C (`cpu_small_gemm.c`) for CPU decode steps.

A decode step multiplies a handful of rows by every weight of the model, so it is
bound by streaming the weights from memory, and MKL's small-M paths stream them well
below gemv bandwidth. These kernels read each weight once per call while doing all the
rows' FMAs on it, and give every row the same bits whatever else is in the batch.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from servefleet.engine.kernels import cbuild
from servefleet.engine.kernels.cbuild import KernelBuildError
from servefleet.engine.kernels.packed_weights import PACKED_BLOCK_BYTES, PackedWeight

logger = logging.getLogger("servefleet.engine.kernels")

GemmThreading = Literal["openmp", "single"]
DEFAULT_THREADING: GemmThreading = "openmp"
# Caps on the instruction set (x86 compilers only), so tests can run the AVX2 and plain-C
# paths on a machine that has AVX-512: explicit -mno-* flags win over -march=native.
IsaCap = Literal["native", "avx2", "plain"]
ISA_CAP_FLAGS: dict[IsaCap, tuple[str, ...]] = {
    "native": (),
    "avx2": ("-mno-avx512f",),
    "plain": ("-mno-avx512f", "-mno-avx2", "-mno-fma"),
}
SOURCE_PATH = Path(__file__).with_name("cpu_small_gemm.c")
# The engine's cap (default native): `avx2` measures the AVX2 paths on an AVX-512 machine.
ISA_CAP_ENV = "SERVEFLEET_MATMUL_ISA"


# No -fassociative-math: the per-element summation order over K must stay fixed, which
# is what makes a row's result independent of the batch it is in.
OPTIMISE_FLAGS = ("-O3", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=fast")

ISA_NAMES = {1: "plain-c", 2: "avx2-fma", 3: "avx512f"}

_ARGTYPES = [
    ctypes.c_void_p,  # x [M, K]
    ctypes.c_void_p,  # w [K, N] or [N, K]
    ctypes.c_void_p,  # out [M, N]
    ctypes.c_int64,  # M
    ctypes.c_int64,  # K
    ctypes.c_int64,  # N
    ctypes.c_int,  # num_threads
]
_PACKED_ARGTYPES: list[type[ctypes._SimpleCData[Any]]] = [
    ctypes.c_void_p,  # x [M, K]
    ctypes.c_void_p,  # packed W [K, N]: bytes
    ctypes.c_void_p,  # its group formats
    ctypes.c_void_p,  # its group offsets
    ctypes.c_void_p,  # out [M, N]
    ctypes.c_int64,  # M
    ctypes.c_int64,  # K
    ctypes.c_int64,  # N
    ctypes.c_int,  # num_threads
]
_UNPACK_ARGTYPES: list[type[ctypes._SimpleCData[Any]]] = [
    ctypes.c_void_p,  # packed W [K, N]: bytes
    ctypes.c_void_p,  # its group formats
    ctypes.c_void_p,  # its group offsets
    ctypes.c_void_p,  # out [K, N]
    ctypes.c_int,  # out is bfloat16 (else float32)
    ctypes.c_int64,  # K
    ctypes.c_int64,  # N
    ctypes.c_int,  # num_threads
]


def _check(x: torch.Tensor, w: torch.Tensor, k_dim: int, what: str) -> None:
    """Raise on anything the C code would misread; messages built only on failure."""
    if (
        x.dim() == 2
        and w.dim() == 2
        and x.dtype == torch.float32
        and w.dtype == torch.float32
        and x.is_cpu
        and w.is_cpu
        and x.is_contiguous()
        and w.is_contiguous()
        and x.shape[1] == w.shape[k_dim]
    ):
        return
    for name, t in (("x", x), ("weight", w)):
        if t.dim() != 2:
            raise ValueError(f"{what}: {name} must be 2-D, got shape {tuple(t.shape)}")
        if t.dtype != torch.float32:
            raise ValueError(f"{what}: {name} must be float32, got {t.dtype}")
        if t.device.type != "cpu":
            raise ValueError(f"{what}: {name} must be on the CPU, got {t.device}")
        if not t.is_contiguous():
            raise ValueError(f"{what}: {name} must be contiguous (strides {t.stride()})")
    raise ValueError(
        f"{what}: x {tuple(x.shape)} and weight {tuple(w.shape)} disagree on the inner size"
    )


@dataclass(frozen=True)
class CpuSmallGemm:
    """The compiled kernels. Threads: `torch.get_num_threads()` at each call."""

    library: ctypes.CDLL
    threading: GemmThreading
    isa: str
    path: Path

    def mm(
        self, x: torch.Tensor, weight_in_out: torch.Tensor, blocked: bool = False
    ) -> torch.Tensor:
        """x [M, K] @ weight [K, N] -> [M, N] (what `torch.mm` computes). `blocked`: the
        many-row kernel (`sf_big_gemm.h`), bitwise the same rows."""
        _check(x, weight_in_out, 0, "small_mm")
        return self.mm_unchecked(x, weight_in_out, blocked)

    def linear(
        self, x: torch.Tensor, weight_out_in: torch.Tensor, blocked: bool = False
    ) -> torch.Tensor:
        """x [M, K] @ weight[N, K].T -> [M, N] (what `F.linear` computes, no bias)."""
        _check(x, weight_out_in, 1, "small_linear")
        return self.linear_unchecked(x, weight_out_in, blocked)

    @functools.cached_property
    def bf16_products(self) -> bool:
        """Whether `packed_mm(..., bf16=True)` runs here (AVX-512 with AVX512_BF16); asked of
        the library once, not on each of a decode step's ~120 matmul calls."""
        return bool(self.library.sf_packed_bf16_available())

    def packed_mm(
        self, x: torch.Tensor, weight: PackedWeight, bf16: bool = False, blocked: bool = False
    ) -> torch.Tensor:
        """x [M, K] @ W [K, N] with W packed (`packed_weights.pack`); `bf16`: x and W
        rounded to bfloat16, products summed in float32 (`bf16_products` builds only);
        `blocked`: the many-row kernel (float32, bitwise the same rows)."""
        if not (
            x.dim() == 2
            and x.dtype == torch.float32
            and x.is_cpu
            and x.is_contiguous()
            and x.shape[1] == weight.k
        ):
            raise ValueError(
                f"packed_mm: x must be contiguous float32 [M, {weight.k}] on the CPU, "
                f"got {x.dtype} {tuple(x.shape)} on {x.device}"
            )
        return self.packed_mm_unchecked(x, weight, bf16, blocked)

    # The unchecked forms are for callers that already checked dtype, device, contiguity
    # and shapes (see matmul.SmallRowsMatmul): a decode step makes ~120 of these calls.

    def mm_unchecked(
        self, x: torch.Tensor, weight_in_out: torch.Tensor, blocked: bool = False
    ) -> torch.Tensor:
        m, k = x.shape
        n = weight_in_out.shape[1]
        out = torch.empty(m, n)
        if not blocked:
            self.library.sf_small_mm(
                x.data_ptr(), weight_in_out.data_ptr(), out.data_ptr(), m, k, n, _threads()
            )
        elif self.library.sf_big_mm(
            x.data_ptr(), weight_in_out.data_ptr(), out.data_ptr(), m, k, n, _threads()
        ):
            raise MemoryError("big_mm: no memory for the weight panels")
        return out

    def linear_unchecked(
        self, x: torch.Tensor, weight_out_in: torch.Tensor, blocked: bool = False
    ) -> torch.Tensor:
        m, k = x.shape
        n = weight_out_in.shape[0]
        out = torch.empty(m, n)
        function = self.library.sf_big_linear if blocked else self.library.sf_small_linear
        function(x.data_ptr(), weight_out_in.data_ptr(), out.data_ptr(), m, k, n, _threads())
        return out

    def packed_mm_unchecked(
        self, x: torch.Tensor, weight: PackedWeight, bf16: bool = False, blocked: bool = False
    ) -> torch.Tensor:
        m = x.shape[0]
        out = torch.empty(m, weight.n)
        if blocked and bf16:
            raise ValueError("packed_mm: the blocked kernel computes in float32 only")
        function = self.library.sf_packed_mm_bf16 if bf16 else self.library.sf_packed_mm
        if blocked:
            function = self.library.sf_big_packed_mm
        status = function(
            x.data_ptr(),
            weight.data.data_ptr(),
            weight.formats.data_ptr(),
            weight.offsets.data_ptr(),
            out.data_ptr(),
            m,
            weight.k,
            weight.n,
            _threads(),
        )
        if status == 5:
            raise ValueError("packed_mm: bfloat16 products need AVX-512 with AVX512_BF16")
        if status == 4:
            raise MemoryError("packed_mm: no memory for scratch")
        if status:
            raise ValueError(f"packed_mm: packed weight with k={weight.k} rejected ({status})")
        return out

    def unpack(self, weight: PackedWeight, out: torch.Tensor | None = None) -> torch.Tensor:
        """The W [K, N] a packed weight holds (what `packed_weights.unpack` computes,
        multi-threaded), into `out` when given: contiguous [K, N], float32 (bitwise the
        checkpoint's values) or bfloat16 (those values rounded to nearest even, as
        `Tensor.bfloat16()` rounds)."""
        if out is None:
            out = torch.empty(weight.k, weight.n)
        elif not (
            out.dtype in (torch.float32, torch.bfloat16)
            and out.is_cpu
            and out.is_contiguous()
            and tuple(out.shape) == (weight.k, weight.n)
        ):
            raise ValueError(
                f"unpack: out must be contiguous float32 or bfloat16 [{weight.k}, {weight.n}]"
            )
        status = self.library.sf_packed_unpack(
            weight.data.data_ptr(),
            weight.formats.data_ptr(),
            weight.offsets.data_ptr(),
            out.data_ptr(),
            int(out.dtype == torch.bfloat16),
            weight.k,
            weight.n,
            _threads(),
        )
        if status:
            raise ValueError(f"unpack: packed weight with k={weight.k} rejected ({status})")
        return out


_threads = torch.get_num_threads


def build_library(threading: GemmThreading = DEFAULT_THREADING, isa: IsaCap = "native") -> Path:
    """Path of the compiled kernels, compiling them if no cached build matches."""
    return cbuild.build_library(SOURCE_PATH, (*OPTIMISE_FLAGS, *ISA_CAP_FLAGS[isa]), threading)


def _open(path: Path, threading: GemmThreading) -> ctypes.CDLL:
    library = cbuild.open_library(path, threading)
    for name in ("sf_small_mm", "sf_small_linear", "sf_big_linear", "sf_big_mm"):
        function = getattr(library, name)
        function.argtypes = _ARGTYPES
        function.restype = ctypes.c_int if name == "sf_big_mm" else None
    for name in ("sf_packed_mm", "sf_packed_mm_bf16", "sf_big_packed_mm"):
        function = getattr(library, name)
        function.argtypes = _PACKED_ARGTYPES
        function.restype = ctypes.c_int
    library.sf_packed_bf16_available.restype = ctypes.c_int
    library.sf_packed_unpack.argtypes = _UNPACK_ARGTYPES
    library.sf_packed_unpack.restype = ctypes.c_int
    library.sf_packed_block_bytes.argtypes = [ctypes.c_int]
    library.sf_packed_block_bytes.restype = ctypes.c_int
    for fmt, size in PACKED_BLOCK_BYTES.items():  # one layout, described twice: keep them one
        if library.sf_packed_block_bytes(int(fmt)) != size:
            raise KernelBuildError(f"{path}: {fmt.name} blocks disagree with packed_weights.py")
    library.sf_gemm_isa.restype = ctypes.c_int
    return library


@functools.cache
def load_cpu_small_gemm(
    threading: GemmThreading = DEFAULT_THREADING, isa: IsaCap = "native"
) -> CpuSmallGemm | None:
    """The compiled kernels, or None (with the reason logged) when they cannot be built."""
    try:
        path = build_library(threading, isa)
        library = _open(path, threading)
    except (KernelBuildError, OSError, subprocess.SubprocessError) as exc:
        logger.warning("CPU small-matmul kernel unavailable, using torch.mm: %s", exc)
        return None
    built_isa = ISA_NAMES.get(library.sf_gemm_isa(), "unknown")
    return CpuSmallGemm(library=library, threading=threading, isa=built_isa, path=path)


def small_mm(x: torch.Tensor, weight_in_out: torch.Tensor) -> torch.Tensor:
    """x @ weight_in_out with the C kernel; raises KernelBuildError if it cannot be built."""
    return _required().mm(x, weight_in_out)


def small_linear(x: torch.Tensor, weight_out_in: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight_out_in) with the C kernel; raises KernelBuildError if unbuildable."""
    return _required().linear(x, weight_out_in)


def _required() -> CpuSmallGemm:
    gemm = load_cpu_small_gemm()
    if gemm is None:
        raise KernelBuildError("the CPU small-matmul kernel could not be built (see the log)")
    return gemm
