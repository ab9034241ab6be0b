"""Keep oneDNN off AMX on CPUs that advertise it but fault when it runs.

Some virtual machines report AMX in /proc/cpuinfo while the instructions raise
SIGILL; oneDNN's bf16 matmuls then kill the process. This must run before torch
is imported: it tries a bf16 matmul in a child process and, if that dies, caps
oneDNN's instruction set through ONEDNN_MAX_CPU_ISA for this process.
Nothing here imports torch.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

log = logging.getLogger("servefleet.engine.cpu")

SAFE_ISA = "AVX512_CORE_BF16"
PROBE_CODE = (
    "import torch\n"
    "a = torch.randn(64, 64, dtype=torch.bfloat16)\n"
    "torch.nn.functional.linear(a, a).float().sum().item()\n"
    "(a @ a).float().sum().item()\n"
)


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def native_bf16(flags: set[str]) -> bool:
    """Whether the CPU multiplies bfloat16 in hardware (else oneDNN emulates it, slowly)."""
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def _cache_file(flags: set[str]) -> Path:
    root = Path(os.environ.get("SERVEFLEET_CACHE_DIR") or Path.home() / ".cache" / "servefleet")
    key = hashlib.sha256((" ".join(sorted(flags)) + sys.version).encode()).hexdigest()[:16]
    return root / "cpu-probe" / f"{key}.json"


def probe_bf16(python: str = sys.executable, code: str = PROBE_CODE, timeout: float = 120) -> str:
    """Run a bf16 matmul in a child; 'ok', 'sigill', or 'failed: ...'."""
    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_MAX_CPU_ISA"}
    try:
        proc = subprocess.run(
            [python, "-c", code], env=env, capture_output=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        return "failed: probe timed out"
    if proc.returncode == 0:
        return "ok"
    if proc.returncode == -signal.SIGILL:
        return "sigill"
    return f"failed: exit {proc.returncode}: {proc.stderr.decode(errors='replace')[-200:]}"


def ensure_safe_cpu_isa(
    cpuinfo: Path = Path("/proc/cpuinfo"), python: str = sys.executable, code: str = PROBE_CODE
) -> str:
    """Decide, before torch loads, whether oneDNN must be kept off AMX; returns what was done."""
    if "torch" in sys.modules:
        return "skipped: torch already imported"
    if os.environ.get("ONEDNN_MAX_CPU_ISA"):
        return f"kept ONEDNN_MAX_CPU_ISA={os.environ['ONEDNN_MAX_CPU_ISA']}"
    flags = cpu_flags(cpuinfo)
    if not any(f.startswith("amx") for f in flags):
        return "no AMX advertised"
    cache = _cache_file(flags)
    result = None
    try:
        result = json.loads(cache.read_text())["result"]
    except (OSError, ValueError, KeyError):
        result = probe_bf16(python, code)
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"result": result}))
            tmp.replace(cache)
        except OSError:
            pass
    if result == "ok":
        return "AMX bf16 probe passed"
    os.environ["ONEDNN_MAX_CPU_ISA"] = SAFE_ISA
    log.warning(
        "this CPU advertises AMX but a bf16 matmul probe failed (%s); capping oneDNN at %s",
        result,
        SAFE_ISA,
    )
    return f"capped oneDNN at {SAFE_ISA} ({result})"
