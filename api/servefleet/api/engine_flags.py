"""Our engine's knobs, one row each: flag, type, default, allowed values, help.

`servefleet engine`'s argparse, the engine's `EngineConfig` (defaults, descriptions and
bounds), the adapter that writes our engine's command line (`servefleet.api.engines`) and
the flag table in the engine's README all read this table, so a new knob is one row here
and one typed field in `EngineConfig` (a test checks the two agree).

Standard library only: the CLI imports it before binding the port, before pydantic or torch
are loaded (`servefleet engine --help` stays instant).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from servefleet.api.kv_cache import KVCacheDtype
from servefleet.api.load_quantization import LoadQuantization
from servefleet.api.matmul_dtype import MatmulDtype
from servefleet.api.rank_place import DEFAULT_DIST_TIMEOUT_S
from servefleet.api.step_cost import AUTO_TARGET_FACTOR

API_KEY_ENV = "SERVEFLEET_API_KEY"
"""The env var our engine reads its key from when `--api-key` is unset (the operator fills it
from a Secret, so the key stays out of `ps` and the pod spec)."""

WeightsDtype = Literal["auto", "float32", "bfloat16"]
DecodeKernelChoice = Literal["auto", "torch", "cpu-c", "triton"]
MatmulChoice = Literal["auto", "torch", "cpu-c"]
BatchInvariantChoice = Literal["auto", "on", "off"]
ToolCallParser = Literal["hermes", "llama3_json"]

Group = Literal["serving", "scheduling", "kernels"]
GROUP_TITLES: dict[Group, str] = {
    "serving": "what is served and where",
    "scheduling": "the KV cache, the batch and speculation",
    "kernels": "how the model runs on this machine",
}


@dataclass(frozen=True)
class EngineFlag:
    """One knob. `kind` is how the command line reads it (a bool is a switch: `switch`, e.g.
    `--no-prefix-caching`, turns a default-on feature off; a default-off one is turned on by
    its own flag, e.g. `--enable-lora`); `minimum` / `above` / `maximum` bound numbers
    (>=, >, <=)."""

    name: str  # the EngineConfig field
    group: Group
    help: str
    kind: type = str
    default: str | int | float | bool | None = None
    choices: tuple[str, ...] = ()
    required: bool = False
    minimum: float | None = None
    above: float | None = None
    maximum: float | None = None
    switch: str | None = None  # a bool's flag, e.g. --no-prefix-caching
    metavar: str | None = None

    @property
    def flag(self) -> str:
        return self.switch or "--" + self.name.replace("_", "-")


def _choices(literal: object) -> tuple[str, ...]:
    return tuple(str(value) for value in get_args(literal))


ENGINE_FLAGS: tuple[EngineFlag, ...] = (
    # ---- what is served and where
    EngineFlag(
        "model",
        "serving",
        "GGUF file, Hugging Face folder, or built-in name (smollm2-135m-instruct)",
        required=True,
    ),
    EngineFlag("served_model_name", "serving", "model name clients use (default: --model)"),
    EngineFlag("host", "serving", "address to listen on", default="127.0.0.1"),
    EngineFlag(
        "port",
        "serving",
        "port to listen on (bound before the model loads)",
        kind=int,
        default=8000,
        minimum=0,
        maximum=65535,
    ),
    EngineFlag(
        "api_key",
        "serving",
        "require `Authorization: Bearer KEY` on every path but /health, /ready, /metrics and "
        f"/version (default: ${API_KEY_ENV}, else no key, as vLLM without --api-key)",
        metavar="KEY",
    ),
    EngineFlag(
        "kv_peer_networks",
        "serving",
        "networks (comma-separated CIDRs) of the engines a request's kv_transfer_params may "
        "name to pull KV blocks from; the engine sends its key there (default: loopback and "
        "the private ranges pod networks use, never a public address)",
        default="127.0.0.0/8,10.0.0.0/8,172.16.0.0/12,192.168.0.0/16,100.64.0.0/10,::1/128,"
        "fc00::/7",
        metavar="CIDRS",
    ),
    EngineFlag(
        "kv_warm_start_seconds",
        "serving",
        "on start, /ready answers 503 kv-warming for at most this long, so the gateway can "
        "have the new replica pull its peers' hottest prefixes first (POST /internal/kv/warm); "
        "0: ready at once (the default for an engine started by hand: nothing warms it; the "
        "operator and local mode pass spec.kvWarmStart.seconds, 10 unless set)",
        kind=float,
        default=0.0,
        minimum=0,
        maximum=60,
    ),
    EngineFlag("dtype", "serving", "weights dtype", default="auto", choices=_choices(WeightsDtype)),
    EngineFlag("device", "serving", "auto, cpu, cuda, cuda:N", default="auto"),
    EngineFlag(
        "tool_call_parser",
        "serving",
        "how tool_choice=auto reads the model's tool calls (default: chosen from the chat "
        "template: llama3_json for Llama 3 templates, else hermes)",
        choices=_choices(ToolCallParser),
    ),
    EngineFlag(
        "enable_lora",
        "serving",
        "serve LoRA adapters beside the model, loaded at run time with POST "
        "/v1/load_lora_adapter (as vLLM)",
        kind=bool,
        default=False,
    ),
    EngineFlag(
        "max_loras",
        "serving",
        "adapters resident at once; loading one more evicts the least recently used idle one",
        kind=int,
        default=8,
        minimum=1,
        maximum=1024,
    ),
    EngineFlag(
        "max_lora_memory",
        "serving",
        "most bytes all resident adapters take (1GiB, 512MB); loading one more evicts least "
        "recently used idle ones until it fits, and one larger than this is refused",
        default="2GiB",
    ),
    EngineFlag(
        "max_lora_rank",
        "serving",
        "highest adapter rank (r) accepted",
        kind=int,
        default=64,
        minimum=1,
        maximum=1024,
    ),
    EngineFlag(
        "drain_timeout",
        "serving",
        "seconds to finish in-flight requests on SIGTERM",
        kind=float,
        default=30.0,
        minimum=0,
    ),
    EngineFlag(
        "stall_timeout",
        "serving",
        "seconds without progress before /health fails",
        kind=float,
        default=120.0,
        above=0,
    ),
    EngineFlag(
        "prepare_timeout",
        "serving",
        "seconds one request may spend in preparation (chat template, tokenizing, grammar "
        "compile) before it is refused with 400 request_too_complex",
        kind=float,
        default=10.0,
        above=0,
    ),
    # ---- the KV cache, the batch and speculation
    EngineFlag(
        "block_size",
        "scheduling",
        "tokens per KV-cache block",
        kind=int,
        default=16,
        minimum=1,
        maximum=256,
    ),
    EngineFlag(
        "kv_cache_memory",
        "scheduling",
        "most KV-cache bytes (2GiB, 512MB) or a fraction of free memory (0.3); the cache "
        "reserves only what max-num-seqs x max-model-len needs when that is less",
        default="384MiB",
    ),
    EngineFlag(
        "kv_cache_dtype",
        "scheduling",
        "auto: the model's dtype; float16 halves what decode attention reads, but greedy "
        "outputs may then differ in the last tokens between batch compositions; int8 stores "
        "quantized keys and values (3.76x the tokens of float32; not with the Triton kernel)",
        default="auto",
        choices=_choices(KVCacheDtype),
    ),
    EngineFlag(
        "max_num_seqs", "scheduling", "sequences running at once", kind=int, default=64, minimum=1
    ),
    EngineFlag(
        "max_num_batched_tokens",
        "scheduling",
        "tokens per engine step",
        kind=int,
        default=512,
        minimum=1,
    ),
    EngineFlag(
        "max_decode_step_ms",
        "scheduling",
        "while sequences decode, a step takes only the prompt tokens the engine's measured "
        "step-cost model predicts fit in this many ms (at least one KV block per step, so "
        f"prompts progress); auto: {AUTO_TARGET_FACTOR:g}x the predicted pure-decode step; "
        "off or 0: prompt chunks up to --max-num-batched-tokens (with no decode running a "
        "prompt always gets the full budget)",
        default="off",
        metavar="MS|auto|off",
    ),
    EngineFlag(
        "max_queue_depth",
        "scheduling",
        "waiting sequences before 503",
        kind=int,
        default=256,
        minimum=0,
    ),
    EngineFlag(
        "max_model_len",
        "scheduling",
        "context length cap (default: the model's)",
        kind=int,
        minimum=16,
    ),
    EngineFlag(
        "enable_prefix_caching",
        "scheduling",
        "turn off the prefix cache (default: on)",
        kind=bool,
        default=True,
        switch="--no-prefix-caching",
    ),
    EngineFlag(
        "speculative_config",
        "scheduling",
        'speculative decoding as vLLM spells it, e.g. \'{"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\' '
        "(default: off)",
        metavar="JSON",
    ),
    # ---- how the model runs on this machine
    EngineFlag(
        "decode_kernel",
        "kernels",
        "decode attention kernel (auto: triton on CUDA, cpu-c on CPU)",
        default="auto",
        choices=_choices(DecodeKernelChoice),
    ),
    EngineFlag(
        "matmul",
        "kernels",
        "projection matmuls: auto uses the C few-row kernels on CPU for decode steps",
        default="auto",
        choices=_choices(MatmulChoice),
    ),
    EngineFlag(
        "matmul_dtype",
        "kernels",
        "bfloat16: projection calls of 8+ rows (prompt chunks, decode steps of 8+ sequences) "
        "in bfloat16 products, ~2.7x prefill and ~1.5x decode matmul speed where the CPU has "
        "AVX512_BF16 or AMX; not batch-invariant",
        default="float32",
        choices=_choices(MatmulDtype),
    ),
    EngineFlag(
        "batch_invariant",
        "kernels",
        "a sequence's logits bitwise independent of how its prompt was chunked, cached or "
        "batched (prompt rows through the decode kernels; auto: on for a float32 CPU model "
        "on the C kernels, off elsewhere; on is refused where no invariant kernels exist)",
        default="auto",
        choices=_choices(BatchInvariantChoice),
    ),
    EngineFlag(
        "packed_weights",
        "kernels",
        "decode matmuls read float32 weights, not the checkpoint's 4/8-bit blocks "
        "(default: packed)",
        kind=bool,
        default=True,
        switch="--no-packed-weights",
    ),
    EngineFlag(
        "quantization",
        "kernels",
        "quantize a float checkpoint's projections at load to packed int8 or int4 blocks "
        "(CPU, float32; default: weights as stored)",
        choices=_choices(LoadQuantization),
    ),
    EngineFlag(
        "tensor_parallel_size",
        "kernels",
        "processes one replica's model is split over by heads (torch.distributed; the "
        "rank, world size and rendezvous come from RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)",
        kind=int,
        default=1,
        minimum=1,
        maximum=64,
    ),
    EngineFlag(
        "pipeline_parallel_size",
        "kernels",
        "processes one replica's layers are split over, in consecutive stages (each of "
        "--tensor-parallel-size processes: TP × PP ranks)",
        kind=int,
        default=1,
        minimum=1,
        maximum=64,
    ),
    EngineFlag(
        "pipeline_micro_batches",
        "kernels",
        "micro-batches (at most) a pipeline step of several sequences is cut into, so stages "
        "overlap; 1: a step goes through the stages whole",
        kind=int,
        default=1,
        minimum=1,
        maximum=64,
    ),
    EngineFlag(
        "dist_timeout",
        "kernels",
        "seconds one collective waits for a peer rank before the group is declared lost",
        kind=float,
        default=DEFAULT_DIST_TIMEOUT_S,
        above=0,
    ),
    EngineFlag(
        "threads",
        "kernels",
        "torch CPU threads (default: torch's choice)",
        kind=int,
        minimum=1,
    ),
)

ENGINE_FLAG_BY_NAME: dict[str, EngineFlag] = {knob.name: knob for knob in ENGINE_FLAGS}


def engine_flag(name: str) -> EngineFlag:
    """The row of knob `name` (an EngineConfig field); KeyError names a knob that is not one."""
    return ENGINE_FLAG_BY_NAME[name]


def flag(name: str) -> str:
    """The command-line spelling of knob `name`: `block_size` → `--block-size`."""
    return engine_flag(name).flag


def markdown_table() -> str:
    """The flag table of the engine's README (a test keeps the two equal)."""
    rows = ["| flag | default | values | what |", "| --- | --- | --- | --- |"]
    for knob in ENGINE_FLAGS:
        rows.append(
            f"| `{knob.flag}` | {_default_cell(knob)} | {_values_cell(knob)} | {knob.help} |"
        )
    return "\n".join(rows)


def _default_cell(knob: EngineFlag) -> str:
    if knob.required:
        return "required"
    if knob.kind is bool or knob.default is None:
        return "—"
    return f"`{knob.default}`"


def _values_cell(knob: EngineFlag) -> str:
    if knob.choices:
        return ", ".join(f"`{choice}`" for choice in knob.choices)
    kind = {bool: "switch", int: "integer", float: "number"}.get(knob.kind, "text")
    if knob.minimum is not None and knob.maximum is not None:
        return f"{kind} {knob.minimum:g}–{knob.maximum:g}"
    if knob.minimum is not None:
        return f"{kind} ≥ {knob.minimum:g}"
    if knob.above is not None:
        return f"{kind} > {knob.above:g}"
    return kind


if __name__ == "__main__":
    print(markdown_table())
