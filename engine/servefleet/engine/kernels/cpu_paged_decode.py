"""Loads the gather-free C decode kernel (compiled on first use) and calls it via ctypes.

Why C through ctypes rather than a torch extension: no torch headers means the
kernel compiles in about a second with whatever `cc` the machine has, so the
engine can build it lazily at start-up and fall back to PyTorch when it cannot.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from servefleet.engine.kernels.validation import validate_decode_inputs

logger = logging.getLogger("servefleet.engine.kernels")

Threading = Literal["openmp", "pthreads", "single"]
DEFAULT_THREADING: Threading = "openmp"

SOURCE_PATH = Path(__file__).with_name("cpu_paged_decode.c")
CACHE_DIR_ENV = "SERVEFLEET_CACHE_DIR"

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
NATIVE_FLAGS = ("-march=native",)
THREADING_FLAGS: dict[Threading, tuple[str, ...]] = {
    "openmp": ("-fopenmp", "-DSF_THREADING=2"),
    "pthreads": ("-pthread", "-DSF_THREADING=1"),
    "single": ("-DSF_THREADING=0",),
}
THREADING_CODES: dict[Threading, int] = {"single": 0, "pthreads": 1, "openmp": 2}
COMPILE_TIMEOUT_S = 120

ERROR_MESSAGES = {
    1: "a context length is < 1 or larger than max_blocks * block_size",
    2: "a block table entry (within a sequence's context) is outside [0, num_blocks)",
    3: "out of memory for the kernel's scratch space",
}


class KernelBuildError(RuntimeError):
    """The C kernel could not be built or loaded."""


def kernel_cache_dir() -> Path:
    """Where compiled kernels live: $SERVEFLEET_CACHE_DIR/kernels or ~/.cache/servefleet/kernels."""
    root = os.environ.get(CACHE_DIR_ENV)
    base = Path(root) if root else Path.home() / ".cache" / "servefleet"
    return base / "kernels"


def find_compiler() -> str | None:
    """$CC if set, else the first of cc/gcc/clang on PATH."""
    candidates = [os.environ["CC"]] if os.environ.get("CC") else ["cc", "gcc", "clang"]
    for name in candidates:
        path = shutil.which(name)
        if path:
            return path
    return None


def _compiler_identity(compiler: str) -> str:
    result = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, timeout=30, check=False
    )
    return result.stdout.strip()


def _cpu_identity() -> str:
    """-march=native output depends on the CPU, so it is part of the cache key."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features", "model name")):
                flags += line
                if line.startswith(("flags", "Features")):
                    break
    except OSError:
        pass
    return f"{platform.machine()}|{flags}"


def _compile(compiler: str, flags: list[str], target: Path) -> None:
    """Compile to a temp file in the cache dir, then rename: concurrent builders never
    see a half-written library."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=target.stem, suffix=".tmp")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        cmd = [compiler, *flags, "-shared", "-fPIC", "-o", str(tmp), str(SOURCE_PATH)]
        result = subprocess.run(
            cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S, check=False
        )
        if result.returncode != 0:
            raise KernelBuildError(
                f"{' '.join(cmd)} failed ({result.returncode}): {result.stderr.strip()[-2000:]}"
            )
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def build_library(threading: Threading) -> Path:
    """Return the path of a compiled kernel, compiling it if no cached build matches."""
    compiler = find_compiler()
    if compiler is None:
        raise KernelBuildError("no C compiler found (set CC or install cc/gcc/clang)")
    identity = _compiler_identity(compiler)
    source = SOURCE_PATH.read_bytes()
    errors: list[str] = []
    for arch_flags in (NATIVE_FLAGS, ()):
        flags = [*OPTIMISE_FLAGS, *arch_flags, *THREADING_FLAGS[threading]]
        key_parts = [source, compiler.encode(), identity.encode(), " ".join(flags).encode()]
        if arch_flags:
            key_parts.append(_cpu_identity().encode())
        digest = hashlib.sha256(b"\0".join(key_parts)).hexdigest()[:20]
        target = kernel_cache_dir() / f"cpu_paged_decode-{threading}-{digest}.so"
        if target.exists():
            return target
        try:
            _compile(compiler, flags, target)
            return target
        except (KernelBuildError, OSError, subprocess.SubprocessError) as exc:
            errors.append(str(exc))
    raise KernelBuildError("; ".join(errors))


_c_int64 = ctypes.c_int64
_ARGTYPES: list[type[ctypes._SimpleCData[Any]]] = [
    ctypes.c_void_p,  # q (float32)
    ctypes.c_void_p,  # k_cache
    ctypes.c_void_p,  # v_cache
    ctypes.c_int,  # cache_is_bf16
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
        shape = validate_decode_inputs(q, k_cache, v_cache, block_tables, context_lens, "cpu")
        q32 = q if q.dtype == torch.float32 else q.float()
        out = torch.empty(q.shape, dtype=torch.float32)
        if shape.num_seqs == 0:
            return out.to(q.dtype)
        rc = self.library.sf_paged_decode(
            q32.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            int(k_cache.dtype == torch.bfloat16),
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


def loaded_openmp_runtimes() -> set[str]:
    """Distinct libgomp/libiomp files mapped into this process (Linux; empty elsewhere)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return set()
    return {
        line.split()[-1] for line in maps.splitlines() if "/libgomp" in line or "/libiomp" in line
    }


def _open_library(path: Path, threading: Threading) -> ctypes.CDLL:
    library = ctypes.CDLL(str(path))
    library.sf_paged_decode.argtypes = _ARGTYPES
    library.sf_paged_decode.restype = ctypes.c_int
    library.sf_threading_mode.restype = ctypes.c_int
    if library.sf_threading_mode() != THREADING_CODES[threading]:
        raise KernelBuildError(f"{path} was not built for {threading} threading")
    if threading == "openmp" and len(runtimes := loaded_openmp_runtimes()) > 1:
        # Our libgomp did not bind to torch's: two thread pools would spin against each other.
        raise KernelBuildError(f"two OpenMP runtimes loaded ({sorted(runtimes)})")
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
