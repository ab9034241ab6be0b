"""`servefleet engine`: the model server.

The port is bound first, before pydantic, torch or the model are imported, so a busy port
fails in a fraction of a second; the CPU probe runs before torch is imported too (see
servefleet.engine.cpu_isa), so everything else is imported inside `run`.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import TYPE_CHECKING, Any

from servefleet.cli.listen import bind_listener
from servefleet.cli.logs import add_logging_arguments, setup_logging

if TYPE_CHECKING:
    import socket

    from pydantic import ValidationError

    from servefleet.engine.config import EngineConfig

# The env var the operator fills from the deployment's Secret; the adapter table
# (servefleet.api.engines) names the same one, which a test checks. Not imported from there:
# that costs seconds before the port is bound.
API_KEY_ENV = "SERVEFLEET_API_KEY"


# Spelled as `servefleet.api.speculative.SPECULATIVE_CONFIG_FLAG` (a test checks it); not
# imported for the same reason as the key's env var.
SPECULATIVE_CONFIG_FLAG = "--speculative-config"

# `servefleet.api.kv_cache.KV_CACHE_DTYPES` (a test checks it); not imported, as above.
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16", "int8")

# Spelled as `servefleet.api.load_quantization` (a test checks it); not imported, as above.
QUANTIZATION_FLAG = "--quantization"
LOAD_QUANTIZATIONS = ("int8", "int4")

# Spelled as `servefleet.api.matmul_dtype` (a test checks it); not imported, as above.
MATMUL_DTYPE_FLAG = "--matmul-dtype"
MATMUL_DTYPES = ("float32", "bfloat16")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _add_serving_arguments(parser)
    _add_scheduling_arguments(parser)
    _add_kernel_arguments(parser)
    add_logging_arguments(parser)


def _add_serving_arguments(parser: argparse.ArgumentParser) -> None:
    """What is served and where."""
    a = parser.add_argument
    a(
        "--model",
        required=True,
        help="GGUF file, Hugging Face folder, or built-in name (smollm2-135m-instruct)",
    )
    a("--served-model-name", default=None, help="model name clients use (default: --model)")
    a("--host", default="127.0.0.1", help="address to listen on")
    a("--port", type=int, default=8000, help="port to listen on (bound before the model loads)")
    a(
        "--api-key",
        default=None,
        help=f"require `Authorization: Bearer KEY` on every path but /health, /ready, "
        f"/metrics and /version (default: ${API_KEY_ENV}, else no key)",
    )
    a("--dtype", choices=["auto", "float32", "bfloat16"], default="auto", help="weights dtype")
    a("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    a(
        "--tool-call-parser",
        choices=["hermes", "llama3_json"],
        default=None,
        help="how tool_choice=auto reads the model's tool calls (default: chosen from the "
        "chat template: llama3_json for Llama 3 templates, else hermes)",
    )
    a("--drain-timeout", type=float, default=30.0, help="seconds to finish in-flight on SIGTERM")
    a(
        "--stall-timeout",
        type=float,
        default=120.0,
        help="seconds without progress before /health fails",
    )
    a(
        "--prepare-timeout",
        type=float,
        default=10.0,
        help="seconds one request may spend in preparation (chat template, tokenizing, grammar "
        "compile) before it is refused with 400 request_too_complex",
    )


def _add_scheduling_arguments(parser: argparse.ArgumentParser) -> None:
    """The KV cache, the batch and speculation."""
    a = parser.add_argument
    a("--block-size", type=int, default=16, help="tokens per KV-cache block")
    a(
        "--kv-cache-memory",
        default="384MiB",
        help="most KV-cache bytes (2GiB, 512MB) or a fraction of free memory (0.3); the cache "
        "reserves only what max-num-seqs x max-model-len needs when that is less",
    )
    a(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="auto: the model's dtype; float16 halves what decode attention reads, but greedy "
        "outputs may then differ in the last tokens between batch compositions; int8 stores "
        "quantized keys and values (3.76x the tokens of float32; not with the Triton kernel)",
    )
    a("--max-num-seqs", type=int, default=64, help="sequences running at once")
    a("--max-num-batched-tokens", type=int, default=512, help="tokens per engine step")
    a("--max-queue-depth", type=int, default=256, help="waiting requests before 503")
    a("--max-model-len", type=int, default=None, help="context length cap (default: the model's)")
    a(
        "--no-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        help="turn off the prefix cache (default: on)",
    )
    a(
        SPECULATIVE_CONFIG_FLAG,
        default=None,
        help='speculative decoding as vLLM spells it, e.g. \'{"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\' '
        "(default: off)",
    )


def _add_kernel_arguments(parser: argparse.ArgumentParser) -> None:
    """How the model runs on this machine."""
    a = parser.add_argument
    a(
        "--decode-kernel",
        choices=["auto", "torch", "cpu-c", "triton"],
        default="auto",
        help="decode attention kernel (auto: triton on CUDA, cpu-c on CPU)",
    )
    a(
        "--matmul",
        choices=["auto", "torch", "cpu-c"],
        default="auto",
        help="projection matmuls: auto uses the C few-row kernels on CPU for decode steps",
    )
    a(
        MATMUL_DTYPE_FLAG,
        choices=MATMUL_DTYPES,
        default="float32",
        help="bfloat16: projection calls of 8+ rows (prompt chunks, decode steps of 8+ "
        "sequences) in bfloat16 products, ~2.7x prefill and ~1.5x decode matmul speed where the "
        "CPU has AVX512_BF16 or AMX; not batch-invariant (default: float32)",
    )
    a(
        "--no-packed-weights",
        dest="packed_weights",
        action="store_false",
        help="decode matmuls read float32 weights, not the checkpoint's 4/8-bit blocks "
        "(default: packed)",
    )
    a(
        QUANTIZATION_FLAG,
        choices=LOAD_QUANTIZATIONS,
        default=None,
        help="quantize a float checkpoint's projections at load to packed int8 or int4 blocks "
        "(CPU, float32; default: weights as stored)",
    )
    a("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")


def _settings_error(exc: ValidationError) -> str:
    """Pydantic's errors as one line, in flag spelling: `--block-size: Input should be …`."""
    parts = []
    for err in exc.errors():
        field = str(err["loc"][0]) if err["loc"] else "settings"
        parts.append(f"--{field.replace('_', '-')}: {err['msg']}")
    return "; ".join(parts)


def engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig fields from the flags; the API key from the env when no flag has it
    (a Secret-backed env var keeps the key out of `ps` and the pod spec)."""
    return vars(args) | {"api_key": args.api_key or os.environ.get(API_KEY_ENV) or None}


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level, args.log_format)
    log = logging.getLogger("servefleet.engine")
    # First thing: a busy port ends here as one line (servefleet.cli.main reports ListenError).
    listener = bind_listener(args.host, args.port)
    from pydantic import ValidationError

    from servefleet.engine.config import EngineConfig

    try:
        config = EngineConfig(**engine_settings(args))
    except ValidationError as exc:
        listener.close()
        log.error("invalid engine settings: %s", _settings_error(exc))
        return 2
    return run_engine(config, listener)


def run_engine(config: EngineConfig, listener: socket.socket) -> int:
    """Serve "loading" on the bound port at once, then probe the CPU, import torch and load
    the model behind it; a signal before the engine is built ends the process with 0."""
    from servefleet.engine.http_server import start_http_server

    http_server = start_http_server(config, listener)
    from servefleet.engine.cpu_isa import ensure_safe_cpu_isa

    logging.getLogger("servefleet.engine").info("cpu_isa=%r", ensure_safe_cpu_isa())
    from servefleet.engine.process import serve

    return serve(config, http_server)
