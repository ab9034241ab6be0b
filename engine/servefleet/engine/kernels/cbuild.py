"""Compile a kernel's C file with the system compiler, cache the library, load it.

Shared by the C kernels: each is one .c file (plus the shared headers beside it) without
torch headers, so it compiles in about a second at first use, and the engine falls back
to PyTorch when no compiler is there.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

Threading = Literal["openmp", "pthreads", "single"]
THREADING_FLAGS: dict[Threading, tuple[str, ...]] = {
    "openmp": ("-fopenmp", "-DSF_THREADING=2"),
    "pthreads": ("-pthread", "-DSF_THREADING=1"),
    "single": ("-DSF_THREADING=0",),
}
THREADING_CODES: dict[Threading, int] = {"single": 0, "pthreads": 1, "openmp": 2}
NATIVE_FLAGS = ("-march=native",)
CACHE_DIR_ENV = "SERVEFLEET_CACHE_DIR"
COMPILE_TIMEOUT_S = 120


class KernelBuildError(RuntimeError):
    """A C kernel could not be built or loaded."""


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


def _compile(compiler: str, source: Path, flags: list[str], target: Path) -> None:
    """Compile to a temp file in the cache dir, then rename: concurrent builders never
    see a half-written library."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=target.stem, suffix=".tmp")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        cmd = [compiler, *flags, "-shared", "-fPIC", "-o", str(tmp), str(source)]
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


def build_library(source: Path, optimise_flags: Sequence[str], threading: Threading) -> Path:
    """Path of a compiled `source`, compiling it if no cached build matches.

    The cache key covers the source bytes, compiler path and version, flags and (for
    -march=native builds) the CPU; a portable build is tried when the native one fails.
    """
    compiler = find_compiler()
    if compiler is None:
        raise KernelBuildError("no C compiler found (set CC or install cc/gcc/clang)")
    identity = _compiler_identity(compiler)
    # Shared headers (`#include "x.h"`, found next to the source) are part of the key too.
    headers = sorted(source.parent.glob("*.h"))
    text = b"\0".join([source.read_bytes(), *(h.read_bytes() for h in headers)])
    errors: list[str] = []
    for arch_flags in (NATIVE_FLAGS, ()):
        flags = [*optimise_flags, *arch_flags, *THREADING_FLAGS[threading]]
        key_parts = [text, compiler.encode(), identity.encode(), " ".join(flags).encode()]
        if arch_flags:
            key_parts.append(_cpu_identity().encode())
        digest = hashlib.sha256(b"\0".join(key_parts)).hexdigest()[:20]
        target = kernel_cache_dir() / f"{source.stem}-{threading}-{digest}.so"
        if target.exists():
            return target
        try:
            _compile(compiler, source, flags, target)
            return target
        except (KernelBuildError, OSError, subprocess.SubprocessError) as exc:
            errors.append(str(exc))
    raise KernelBuildError("; ".join(errors))


def loaded_openmp_runtimes() -> set[str]:
    """Distinct libgomp/libiomp files mapped into this process (Linux; empty elsewhere)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return set()
    return {
        line.split()[-1] for line in maps.splitlines() if "/libgomp" in line or "/libiomp" in line
    }


def open_library(path: Path, threading: Threading) -> ctypes.CDLL:
    """Load a built kernel and check it was built for `threading` and shares torch's OpenMP.

    Every kernel exports `int sf_threading_mode(void)`.
    """
    library = ctypes.CDLL(str(path))
    library.sf_threading_mode.restype = ctypes.c_int
    if library.sf_threading_mode() != THREADING_CODES[threading]:
        raise KernelBuildError(f"{path} was not built for {threading} threading")
    if threading == "openmp" and len(runtimes := loaded_openmp_runtimes()) > 1:
        # Our libgomp did not bind to torch's: two thread pools would spin against each other.
        raise KernelBuildError(f"two OpenMP runtimes loaded ({sorted(runtimes)})")
    return library
