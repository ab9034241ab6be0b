"""Engine adapters: what differs between servefleet, vLLM and SGLang, as small tables.

Everything engine-specific the operator, gateway or autoscaler needs lives here:
image, command, how each spec knob is spelled as a flag, port, health paths and the
Prometheus metric names for queued / running requests and KV-cache use. Beyond one
GPU, vLLM and SGLang do the tensor parallelism; we only pass the size through.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from servefleet.api.llmdeployment import EngineKind, EngineSpec

_BINARY_SUFFIX = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
_DECIMAL_SUFFIX = {"K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


@dataclass(frozen=True)
class KvCacheSize:
    """engine.kvCacheMemory normalised: exactly one of bytes or fraction."""

    bytes: int | None = None
    fraction: float | None = None


def parse_kv_cache_memory(value: int | str | None) -> KvCacheSize | None:
    """'0.9' -> fraction, 4294967296 / '4Gi' / '4G' -> bytes (the API model validated the form)."""
    if value is None:
        return None
    if isinstance(value, int):
        return KvCacheSize(bytes=value)
    if "." in value:
        return KvCacheSize(fraction=float(value))
    match = re.fullmatch(r"([0-9]+)(Ki|Mi|Gi|Ti|K|M|G|T)?", value)
    if match is None:
        raise ValueError(f"engine.kvCacheMemory {value!r} is not bytes, a fraction or a size")
    number, suffix = int(match.group(1)), match.group(2)
    if suffix is None:
        return KvCacheSize(bytes=number) if number > 1 else KvCacheSize(fraction=float(number))
    return KvCacheSize(bytes=number * (_BINARY_SUFFIX | _DECIMAL_SUFFIX)[suffix])


@dataclass(frozen=True)
class MetricNames:
    """Prometheus names the autoscaler and gateway read from a replica."""

    requests_waiting: str
    requests_running: str
    kv_cache_usage: str


FlagBuilder = Callable[[EngineSpec, str, str, int], list[str]]


@dataclass(frozen=True)
class EngineAdapter:
    """How to run one engine kind in a pod."""

    kind: EngineKind
    default_image: str | None  # None: the operator's own image (servefleet)
    command: tuple[str, ...]
    port: int
    ready_path: str
    live_path: str
    metrics_path: str
    metrics: MetricNames
    build_flags: FlagBuilder
    needs_shared_memory: bool

    def args(self, engine: EngineSpec, model_path: str, served_name: str) -> list[str]:
        """All engine flags: ours from the spec, then the user's extra args (which win)."""
        return [*self.build_flags(engine, model_path, served_name, self.port), *engine.args]


def _servefleet_flags(engine: EngineSpec, model: str, served: str, port: int) -> list[str]:
    flags = ["--model", model, "--served-model-name", served, "--host", "0.0.0.0"]
    flags += ["--port", str(port), "--block-size", str(engine.block_size), "--dtype", engine.dtype]
    flags += ["--drain-timeout", str(engine.drain_timeout_seconds)]
    kv = parse_kv_cache_memory(engine.kv_cache_memory)
    if kv is not None:
        flags += ["--kv-cache-memory", str(kv.bytes if kv.bytes is not None else kv.fraction)]
    if engine.max_num_seqs is not None:
        flags += ["--max-num-seqs", str(engine.max_num_seqs)]
    if engine.max_num_batched_tokens is not None:
        flags += ["--max-num-batched-tokens", str(engine.max_num_batched_tokens)]
    if not engine.prefix_caching:
        flags.append("--no-prefix-caching")
    return flags


def _vllm_flags(engine: EngineSpec, model: str, served: str, port: int) -> list[str]:
    flags = ["--model", model, "--served-model-name", served, "--host", "0.0.0.0"]
    flags += ["--port", str(port), "--tensor-parallel-size", str(engine.tensor_parallel_size)]
    flags += ["--block-size", str(engine.block_size), "--dtype", engine.dtype]
    kv = parse_kv_cache_memory(engine.kv_cache_memory)
    if kv is not None and kv.fraction is not None:
        flags += ["--gpu-memory-utilization", str(kv.fraction)]
    elif kv is not None:
        flags += ["--kv-cache-memory", str(kv.bytes)]
    if engine.max_num_seqs is not None:
        flags += ["--max-num-seqs", str(engine.max_num_seqs)]
    if engine.max_num_batched_tokens is not None:
        flags += ["--max-num-batched-tokens", str(engine.max_num_batched_tokens)]
    flags.append(
        "--enable-prefix-caching" if engine.prefix_caching else "--no-enable-prefix-caching"
    )
    return flags


def _sglang_flags(engine: EngineSpec, model: str, served: str, port: int) -> list[str]:
    flags = ["--model-path", model, "--served-model-name", served, "--host", "0.0.0.0"]
    flags += ["--port", str(port), "--tp-size", str(engine.tensor_parallel_size)]
    flags += ["--page-size", str(engine.block_size), "--dtype", engine.dtype, "--enable-metrics"]
    kv = parse_kv_cache_memory(engine.kv_cache_memory)
    if kv is not None and kv.fraction is not None:
        flags += ["--mem-fraction-static", str(kv.fraction)]
    if engine.max_num_seqs is not None:
        flags += ["--max-running-requests", str(engine.max_num_seqs)]
    if engine.max_num_batched_tokens is not None:
        flags += ["--chunked-prefill-size", str(engine.max_num_batched_tokens)]
    if not engine.prefix_caching:
        flags.append("--disable-radix-cache")
    return flags


ADAPTERS: dict[EngineKind, EngineAdapter] = {
    "servefleet": EngineAdapter(
        kind="servefleet",
        default_image=None,
        command=("servefleet", "engine"),
        port=8000,
        ready_path="/ready",
        live_path="/health",
        metrics_path="/metrics",
        metrics=MetricNames(
            # Our engine exports vLLM's names on purpose: one row for routers and autoscalers.
            requests_waiting="vllm:num_requests_waiting",
            requests_running="vllm:num_requests_running",
            kv_cache_usage="vllm:kv_cache_usage_perc",
        ),
        build_flags=_servefleet_flags,
        needs_shared_memory=False,
    ),
    "vllm": EngineAdapter(
        kind="vllm",
        default_image="vllm/vllm-openai:v0.10.1.1",
        command=("python3", "-m", "vllm.entrypoints.openai.api_server"),
        port=8000,
        # vLLM binds its port only after the model is loaded, so /health means warm.
        ready_path="/health",
        live_path="/health",
        metrics_path="/metrics",
        metrics=MetricNames(
            requests_waiting="vllm:num_requests_waiting",
            requests_running="vllm:num_requests_running",
            # vLLM V1's name (gpu_cache_usage_perc was the V0 one, removed in V1).
            kv_cache_usage="vllm:kv_cache_usage_perc",
        ),
        build_flags=_vllm_flags,
        needs_shared_memory=True,
    ),
    "sglang": EngineAdapter(
        kind="sglang",
        default_image="lmsysorg/sglang:v0.5.2-cu126",
        command=("python3", "-m", "sglang.launch_server"),
        port=30000,
        # SGLang's /health_generate runs a real decode step: ready only when warm.
        ready_path="/health_generate",
        live_path="/health",
        metrics_path="/metrics",
        metrics=MetricNames(
            requests_waiting="sglang:num_queue_reqs",
            requests_running="sglang:num_running_reqs",
            kv_cache_usage="sglang:token_usage",
        ),
        build_flags=_sglang_flags,
        needs_shared_memory=True,
    ),
}


def adapter_for(kind: EngineKind) -> EngineAdapter:
    return ADAPTERS[kind]
