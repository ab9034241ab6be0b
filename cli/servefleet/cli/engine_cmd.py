"""`servefleet engine`: the model server.

The CPU probe runs before torch is imported (see servefleet.engine.cpu_isa), so
everything torch-related is imported inside `run`.
"""

from __future__ import annotations

import argparse
import logging

from pydantic import ValidationError

from servefleet.cli.logs import setup_logging


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a(
        "--model",
        required=True,
        help="GGUF file, Hugging Face folder, or built-in name (smollm2-135m-instruct)",
    )
    a("--served-model-name", default=None, help="model name clients use (default: --model)")
    a("--host", default="127.0.0.1")
    a("--port", type=int, default=8000)
    a("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    a("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    a("--block-size", type=int, default=16, help="tokens per KV-cache block")
    a(
        "--kv-cache-memory",
        default="1GiB",
        help="KV-cache bytes (2GiB, 512MB) or a fraction of free memory (0.3)",
    )
    a(
        "--kv-cache-dtype",
        choices=["auto", "float32", "float16", "bfloat16"],
        default="auto",
        help="auto: the model's dtype; float16 halves what decode attention reads, but greedy "
        "outputs may then differ in the last tokens between batch compositions",
    )
    a("--max-num-seqs", type=int, default=64, help="sequences running at once")
    a("--max-num-batched-tokens", type=int, default=512, help="tokens per engine step")
    a("--max-queue-depth", type=int, default=256, help="waiting requests before 503")
    a("--max-model-len", type=int, default=None, help="context length cap")
    a("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
    a("--drain-timeout", type=float, default=30.0, help="seconds to finish in-flight on SIGTERM")
    a(
        "--stall-timeout",
        type=float,
        default=120.0,
        help="seconds without progress before /health fails",
    )
    a("--decode-kernel", choices=["auto", "torch", "cpu-c", "triton"], default="auto")
    a(
        "--matmul",
        choices=["auto", "torch", "cpu-c"],
        default="auto",
        help="projection matmuls: auto uses the C few-row kernels on CPU for decode steps",
    )
    a(
        "--no-packed-weights",
        dest="packed_weights",
        action="store_false",
        help="decode matmuls read float32 weights, not the checkpoint's 4/8-bit blocks",
    )
    a("--threads", type=int, default=None, help="torch CPU threads")
    a("--log-level", default="info")


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    log = logging.getLogger("servefleet.engine")
    from servefleet.engine.config import EngineConfig
    from servefleet.engine.cpu_isa import ensure_safe_cpu_isa

    try:
        config = EngineConfig(**vars(args))
    except ValidationError as exc:
        log.error("invalid engine settings: %s", exc)
        return 2
    log.info("cpu_isa=%r", ensure_safe_cpu_isa())
    from servefleet.engine.process import serve

    return serve(config)
