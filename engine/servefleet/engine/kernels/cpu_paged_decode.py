"""Loads the gather-free C decode kernel (compiled on first use) and calls it via ctypes.

Why C through ctypes rather than a torch extension: no torch headers means the
kernel compiles in about a second with whatever `cc` the machine has, so the
engine can build it lazily at start-up and fall back to PyTorch when it cannot.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from servefleet.engine.kernels import cbuild
from servefleet.engine.kernels.cbuild import (
    CACHE_DIR_ENV,
    THREADING_CODES,
    THREADING_FLAGS,
    KernelBuildError,
    Threading,
    find_compiler,
    kernel_cache_dir,
    loaded_openmp_runtimes,
)
from servefleet.engine.kernels.validation import INT8_CACHE_DTYPES, validate_decode_inputs

logger = logging.getLogger("servefleet.engine.kernels")

DEFAULT_THREADING: Threading = "openmp"

SOURCE_PATH = Path(__file__).with_name("cpu_paged_decode.c")

# Reassociation lets the dot products and sums vectorise. Full -ffast-math is
# avoided: -ffinite-math-only would let the compiler drop NaN/inf handling.
OPTIMISE_FLAGS = (
    "-O3",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fno-signed-zeros",
    "-fassociative-math",
    "-ffp-contract=fast",
)

CACHE_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.int8: 3}

ERROR_MESSAGES = {
    1: "a context length is < 1 or larger than max_blocks * block_size",
    2: "a block table entry (within a sequence's context) is outside [0, num_blocks)",
    3: "out of memory for the kernel's scratch space",
    4: "unsupported KV-cache dtype",
}


def build_library(threading: Threading) -> Path:
    """Return the path of a compiled kernel, compiling it if no cached build matches."""
    return cbuild.build_library(SOURCE_PATH, OPTIMISE_FLAGS, threading)


_c_int64 = ctypes.c_int64
_ARGTYPES: list[type[ctypes._SimpleCData[Any]]] = [
    ctypes.c_void_p,  # q (float32)
    ctypes.c_void_p,  # k_cache
    ctypes.c_void_p,  # v_cache
    ctypes.c_int,  # cache kind: 0 float32, 1 bfloat16, 2 float16, 3 int8 (+ row scales)
    ctypes.c_void_p,  # block_tables
    ctypes.c_void_p,  # context_lens
    ctypes.c_void_p,  # out (float32)
    _c_int64,  # num_seqs
    _c_int64,  # num_heads
    _c_int64,  # num_kv_heads
    _c_int64,  # head_dim
    _c_int64,  # block_size
    _c_int64,  # num_blocks
    _c_int64,  # max_blocks
    ctypes.c_float,  # scale
    ctypes.c_int,  # num_threads
]


@dataclass(frozen=True)
class CpuPagedDecode:
    """A `DecodeKernel` backed by the compiled C library."""

    library: ctypes.CDLL
    threading: Threading
    path: Path

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        shape = validate_decode_inputs(
            q, k_cache, v_cache, block_tables, context_lens, "cpu", INT8_CACHE_DTYPES
        )
        q32 = q if q.dtype == torch.float32 else q.float()
        out = torch.empty(q.shape, dtype=torch.float32)
        if shape.num_seqs == 0:
            return out.to(q.dtype)
        rc = self.library.sf_paged_decode(
            q32.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            CACHE_KINDS[k_cache.dtype],
            block_tables.data_ptr(),
            context_lens.data_ptr(),
            out.data_ptr(),
            shape.num_seqs,
            shape.num_heads,
            shape.num_kv_heads,
            shape.head_dim,
            shape.block_size,
            shape.num_blocks,
            shape.max_blocks,
            scale,
            torch.get_num_threads(),
        )
        if rc != 0:
            raise ValueError(f"paged decode: {ERROR_MESSAGES.get(rc, f'kernel error {rc}')}")
        return out if q.dtype == torch.float32 else out.to(q.dtype)


def _open_library(path: Path, threading: Threading) -> ctypes.CDLL:
    library = cbuild.open_library(path, threading)
    library.sf_paged_decode.argtypes = _ARGTYPES
    library.sf_paged_decode.restype = ctypes.c_int
    return library


@functools.cache
def load_cpu_paged_decode(threading: Threading = DEFAULT_THREADING) -> CpuPagedDecode | None:
    """The compiled kernel, or None (with the reason logged) when it cannot be built."""
    try:
        path = build_library(threading)
        library = _open_library(path, threading)
    except (KernelBuildError, OSError, subprocess.SubprocessError) as exc:
        logger.warning("CPU paged-decode kernel unavailable, using PyTorch: %s", exc)
        return None
    return CpuPagedDecode(library=library, threading=threading, path=path)


__all__ = [
    "CACHE_DIR_ENV",
    "DEFAULT_THREADING",
    "THREADING_CODES",
    "THREADING_FLAGS",
    "CpuPagedDecode",
    "KernelBuildError",
    "Threading",
    "build_library",
    "find_compiler",
    "kernel_cache_dir",
    "load_cpu_paged_decode",
    "loaded_openmp_runtimes",
]
