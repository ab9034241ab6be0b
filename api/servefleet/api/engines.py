"""Engine adapters: what differs between servefleet, vLLM and SGLang, as one table.

The operator (pods), local mode (processes) and the autoscaler (scrapes) all read this
table, so an engine runs with the same flags everywhere and is read by the same metric
names: image, command, how each spec knob is spelled as a flag, port, probe paths and the
Prometheus names of queued / running requests and KV-cache use. Beyond one GPU, vLLM and
SGLang do the tensor and pipeline parallelism; we only pass the sizes through (ours reads
the same two flags; `servefleet.api.parallel` says how many pods a replica then spans).

Where the weights are differs per environment (a built-in name, a mounted volume, a local
folder), so callers pass the model path; where the engine listens is passed too (pods
listen on every interface at the adapter's port, local processes on a port of their own).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from servefleet.api.disaggregation import Role
from servefleet.api.disaggregation_flags import role_args, role_extra_args
from servefleet.api.engine_flags import API_KEY_ENV, flag
from servefleet.api.llmdeployment import VLLM_QUANTIZATIONS, EngineKind, LLMDeploymentSpec
from servefleet.api.load_quantization import LOAD_QUANTIZATIONS
from servefleet.api.parallel import PIPELINE_PARALLEL_FLAG, TENSOR_PARALLEL_FLAG

LISTEN_ALL = "0.0.0.0"
"""The host a pod's engine binds: every interface, as probes and the Service reach it."""


@dataclass(frozen=True)
class MetricNames:
    """Prometheus names the autoscaler and dashboards read from a replica."""

    requests_waiting: str
    requests_running: str
    kv_cache_usage: str
    kv_cache_is_percent: bool = False
    """True when the engine reports KV-cache use as 0..100 instead of 0..1."""


@dataclass(frozen=True)
class EngineListen:
    """Where one engine process serves: passed in, since pods and local processes differ."""

    host: str
    port: int


ArgsBuilder = Callable[[LLMDeploymentSpec, str, EngineListen], list[str]]


@dataclass(frozen=True)
class EngineAdapter:
    """How to run and read one engine kind."""

    kind: EngineKind
    default_image: str | None  # None: the operator's own image (servefleet)
    command: tuple[str, ...]
    port: int
    ready_path: str
    live_path: str
    metrics_path: str
    metrics: MetricNames
    build_args: ArgsBuilder
    needs_shared_memory: bool
    api_key_env: str
    """Environment variable the engine reads its API key from (the pod sets it from a Secret)."""
    api_key_flag: str | None
    """Flag for engines that read the key only from their command line: passed
    `$(api_key_env)`, which the kubelet expands, so the key stays out of the pod spec."""
    image_scratch: str | None
    """A folder the image ships inside the pod's scratch mount (`conventions.SCRATCH_MOUNT`,
    mounted over it because root filesystems are read-only) that the engine needs: copied
    into the scratch volume before the engine starts. Ours: the C kernels compiled when the
    image was built (`SERVEFLEET_CACHE_DIR`), so a pod does not compile them again."""
    lora_env: tuple[tuple[str, str], ...] = ()
    """Environment the engine needs when `engine.lora` is set, beyond its flags: vLLM serves
    its load/unload endpoints (the gateway's adapter control path) only with runtime
    updates allowed."""

    def args(
        self,
        spec: LLMDeploymentSpec,
        model_path: str,
        listen: EngineListen,
        *,
        api_key: bool = False,
        role: Role | None = None,
    ) -> list[str]:
        """Every engine flag: ours from the spec (with `api_key`: those requiring the key
        in `api_key_env`; with `role`: a disaggregated pool's, `disaggregation_flags`), then
        the user's extra args (which win), then a prefill replica's own."""
        key = self.api_key_args() if api_key else []
        ours = [*self.build_args(spec, model_path, listen), *role_args(spec, role)]
        return [*ours, *key, *spec.engine.args, *role_extra_args(spec, role)]

    def pod_listen(self) -> EngineListen:
        """Where the engine listens inside a pod."""
        return EngineListen(host=LISTEN_ALL, port=self.port)

    def api_key_args(self) -> list[str]:
        """Flags that make a pod's engine require the key in `api_key_env`."""
        return [] if self.api_key_flag is None else [self.api_key_flag, f"$({self.api_key_env})"]


def _common(
    model_flag: str, spec: LLMDeploymentSpec, model: str, listen: EngineListen
) -> list[str]:
    """vLLM and SGLang: model, served name, host and port, spelled alike but `model_flag`."""
    served = spec.model.name
    return [
        model_flag,
        model,
        "--served-model-name",
        served,
        "--host",
        listen.host,
        "--port",
        str(listen.port),
    ]


def _when_set(*flags: tuple[str, object | None]) -> list[str]:
    """`flag value` for each knob the spec sets; an unset one keeps the engine's default."""
    return [part for name, value in flags if value is not None for part in (name, str(value))]


def _servefleet_args(spec: LLMDeploymentSpec, model: str, listen: EngineListen) -> list[str]:
    """Our engine's flags, each spelled as its knob table (`engine_flags`) spells it."""
    engine, concurrency = spec.engine, spec.pool.per_replica_concurrency
    kv = engine.kv_cache_size()
    # The gateway sends a replica at most perReplicaConcurrency requests at once (it holds
    # the real queue), so the engine batches that many and queues no more than that.
    flags = _ours(
        ("model", model),
        ("served_model_name", spec.model.name),
        ("host", listen.host),
        ("port", listen.port),
        ("block_size", engine.block_size),
        ("dtype", engine.dtype),
        ("drain_timeout", engine.drain_timeout_seconds),
        ("kv_cache_memory", kv and kv.flag_value()),
        ("max_num_seqs", engine.max_num_seqs or concurrency),
        ("max_queue_depth", concurrency),
        ("max_num_batched_tokens", engine.max_num_batched_tokens),
    )
    if not engine.prefix_caching:
        flags.append(flag("enable_prefix_caching"))
    else:  # the gateway warms a new replica from its peers' caches (`kv_warm`)
        flags += _ours(("kv_warm_start_seconds", spec.kv_warm_start.seconds))
    speculative = engine.speculative
    if speculative is not None:
        flags += [flag("speculative_config"), speculative.flag_value(ours=True)]
    if spec.model.quantization in LOAD_QUANTIZATIONS:  # quantized at load; others: as stored
        flags += _ours(("quantization", spec.model.quantization))
    lora = engine.lora
    if lora is not None:
        flags.append(flag("enable_lora"))
        flags += _ours(("max_loras", lora.max_loras), ("max_lora_rank", lora.max_lora_rank))
    flags += _ours(("max_model_len", engine.max_model_len))
    tp, pp = engine.tensor_parallel_size, engine.pipeline_parallel_size
    if tp * pp > 1:  # one rank per process; ranks meet through torch's env (`rank_place`)
        flags += _ours(("tensor_parallel_size", tp), ("pipeline_parallel_size", pp))
    return flags


def _ours(*knobs: tuple[str, object | None]) -> list[str]:
    """`--flag value` for each of our knobs the spec sets; unset ones keep the default."""
    return _when_set(*((flag(name), value) for name, value in knobs))


def _speculative(spec: LLMDeploymentSpec) -> list[str]:
    """vLLM reads our flag's JSON, without our adaptive keys (its parser refuses them)."""
    speculative = spec.engine.speculative
    if speculative is None:
        return []
    return ["--speculative-config", speculative.flag_value(ours=False)]


def _quantization(spec: LLMDeploymentSpec) -> list[str]:
    """vLLM and SGLang spell it alike; GGUF kinds and 'none' are read from the weights."""
    kind = spec.model.quantization
    return ["--quantization", kind] if kind in VLLM_QUANTIZATIONS else []


VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)
"""The only --max-lora-rank values vLLM starts with (its LoRAConfig refuses any other)."""


def _vllm_lora(spec: LLMDeploymentSpec) -> list[str]:
    """vLLM's adapter flags. Its rank is rounded up to one vLLM accepts: adapters are still
    checked against the spec's own limit when they are declared, so none above it arrives."""
    lora = spec.engine.lora
    if lora is None:
        return []
    rank = next(r for r in VLLM_LORA_RANKS if r >= lora.max_lora_rank)
    return ["--enable-lora", "--max-loras", str(lora.max_loras), "--max-lora-rank", str(rank)]


def _sglang_lora(spec: LLMDeploymentSpec) -> list[str]:
    """SGLang's adapter flags: its GPU slots are per batch; adapters load at run time, so it
    is told the largest rank and every target module up front (it cannot infer them from
    adapters given at start, as there are none)."""
    lora = spec.engine.lora
    if lora is None:
        return []
    return [
        "--enable-lora",
        "--max-loras-per-batch",
        str(lora.max_loras),
        "--max-lora-rank",
        str(lora.max_lora_rank),
        "--lora-target-modules",
        "all",
    ]


def _vllm_args(spec: LLMDeploymentSpec, model: str, listen: EngineListen) -> list[str]:
    engine = spec.engine
    kv = engine.kv_cache_size()
    flags = _common("--model", spec, model, listen)
    flags += [TENSOR_PARALLEL_FLAG, str(engine.tensor_parallel_size)]
    if engine.pipeline_parallel_size > 1:
        flags += [PIPELINE_PARALLEL_FLAG, str(engine.pipeline_parallel_size)]
    flags += ["--block-size", str(engine.block_size), "--dtype", engine.dtype]
    flags += _when_set(
        ("--gpu-memory-utilization", kv and kv.fraction),
        ("--kv-cache-memory", kv and kv.bytes),  # a size is a fraction or bytes, never both
        ("--max-num-seqs", engine.max_num_seqs),
        ("--max-num-batched-tokens", engine.max_num_batched_tokens),
    )
    flags.append(
        "--enable-prefix-caching" if engine.prefix_caching else "--no-enable-prefix-caching"
    )
    flags += _when_set(("--max-model-len", engine.max_model_len))
    # SIGTERM drains in-flight requests for this long; vLLM's default (0) aborts them.
    flags += ["--shutdown-timeout", str(engine.drain_timeout_seconds)]
    return flags + _speculative(spec) + _quantization(spec) + _vllm_lora(spec)


def _sglang_args(spec: LLMDeploymentSpec, model: str, listen: EngineListen) -> list[str]:
    engine = spec.engine
    kv = engine.kv_cache_size()
    flags = _common("--model-path", spec, model, listen)
    flags += ["--tp-size", str(engine.tensor_parallel_size)]
    if engine.pipeline_parallel_size > 1:
        flags += ["--pp-size", str(engine.pipeline_parallel_size)]
    flags += ["--page-size", str(engine.block_size), "--dtype", engine.dtype, "--enable-metrics"]
    flags += _when_set(
        ("--mem-fraction-static", kv and kv.fraction),  # SGLang takes no size in bytes
        ("--max-running-requests", engine.max_num_seqs),
        ("--chunked-prefill-size", engine.max_num_batched_tokens),
    )
    if not engine.prefix_caching:
        flags.append("--disable-radix-cache")
    flags += _when_set(("--context-length", engine.max_model_len))
    return flags + _quantization(spec) + _sglang_lora(spec)


# Our engine exports vLLM's names on purpose: one row for routers and autoscalers.
_VLLM_METRICS = MetricNames(
    requests_waiting="vllm:num_requests_waiting",
    requests_running="vllm:num_requests_running",
    # vLLM V1's name (gpu_cache_usage_perc was the V0 one, removed in V1).
    kv_cache_usage="vllm:kv_cache_usage_perc",
)

ENGINE_ADAPTERS: dict[str, EngineAdapter] = {
    "servefleet": EngineAdapter(
        kind="servefleet",
        default_image=None,
        command=("servefleet", "engine"),
        port=8000,
        ready_path="/ready",
        live_path="/health",
        metrics_path="/metrics",
        metrics=_VLLM_METRICS,
        build_args=_servefleet_args,
        needs_shared_memory=False,
        api_key_env=API_KEY_ENV,
        api_key_flag=None,
        image_scratch="/tmp/servefleet",  # the Dockerfile's SERVEFLEET_CACHE_DIR
    ),
    "vllm": EngineAdapter(
        kind="vllm",
        # The release e2e/test_vllm_node.py runs (its CPU build): older ones lack
        # --shutdown-timeout and --kv-cache-memory.
        default_image="vllm/vllm-openai:v0.32.0",
        command=("python3", "-m", "vllm.entrypoints.openai.api_server"),
        port=8000,
        # vLLM binds its port only after the model is loaded, so /health means warm.
        ready_path="/health",
        live_path="/health",
        metrics_path="/metrics",
        metrics=_VLLM_METRICS,
        build_args=_vllm_args,
        needs_shared_memory=True,
        api_key_env="VLLM_API_KEY",  # vLLM's own fallback for --api-key
        api_key_flag=None,
        image_scratch=None,
        lora_env=(("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True"),),
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
        build_args=_sglang_args,
        needs_shared_memory=True,
        api_key_env=API_KEY_ENV,
        api_key_flag="--api-key",
        image_scratch=None,
    ),
}


def engine_adapter(kind: str) -> EngineAdapter:
    """The adapter of an engine kind; ValueError names the known kinds."""
    adapter = ENGINE_ADAPTERS.get(kind)
    if adapter is None:
        raise ValueError(f"unknown engine kind {kind!r}; known: {sorted(ENGINE_ADAPTERS)}")
    return adapter
