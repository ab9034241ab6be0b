"""The command line of one local engine replica, derived from the LLMDeployment spec.

It starts with the `servefleet` script itself, so `ps` shows `servefleet engine` exactly as a
pod's command line would.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from servefleet.api.llmdeployment import LLMDeploymentSpec


class LocalModeError(ValueError):
    """A spec that local mode cannot run; the message says what to change."""


def servefleet_executable() -> list[str]:
    beside = Path(sys.executable).parent / "servefleet"
    if beside.exists():
        return [str(beside)]
    found = shutil.which("servefleet")
    if found:
        return [found]
    return [sys.executable, "-m", "servefleet.cli.main"]


def model_argument(spec: LLMDeploymentSpec) -> str:
    source = spec.model.source
    if source.builtin is not None:
        return source.builtin
    if source.pvc is not None:
        folder = Path(source.pvc.path)
        if not folder.is_absolute():
            raise LocalModeError(
                "model.source.pvc in local mode: set pvc.path to an absolute folder on this machine"
            )
        return str(folder)
    raise LocalModeError(
        "model.source.url is not downloaded in local mode; download it and use "
        "model.source.pvc.path (an absolute folder) or a builtin model"
    )


def engine_command(spec: LLMDeploymentSpec, host: str, port: int) -> list[str]:
    if spec.engine.kind != "servefleet":
        raise LocalModeError(
            f"engine.kind {spec.engine.kind} runs only on Kubernetes; local mode runs servefleet"
        )
    engine = spec.engine
    argv = [
        *servefleet_executable(),
        "engine",
        "--model",
        model_argument(spec),
        "--served-model-name",
        spec.model.name,
        "--host",
        host,
        "--port",
        str(port),
        "--max-num-seqs",
        str(engine.max_num_seqs or spec.pool.per_replica_concurrency),
        "--max-queue-depth",
        str(max(1, spec.pool.per_replica_concurrency)),
        "--drain-timeout",
        str(engine.drain_timeout_seconds),
        "--block-size",
        str(engine.block_size),
        "--dtype",
        engine.dtype,
    ]
    if engine.kv_cache_memory is not None:
        argv += ["--kv-cache-memory", str(engine.kv_cache_memory)]
    if engine.max_num_batched_tokens is not None:
        argv += ["--max-num-batched-tokens", str(engine.max_num_batched_tokens)]
    if not engine.prefix_caching:
        argv.append("--no-prefix-caching")
    return argv + list(engine.args)
