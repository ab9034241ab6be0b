"""The command line of one local engine replica: the engine adapter's arguments (the same
table the operator renders pods from) plus the host, port and model path of this machine.

It starts with the `servefleet` script itself, so `ps` shows `servefleet engine` exactly as a
pod's command line would.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Mapping
from pathlib import Path

from servefleet.api.disaggregation import Role
from servefleet.api.engines import EngineListen, engine_adapter
from servefleet.api.llmdeployment import LLMDeploymentSpec
from servefleet.api.local_volumes import local_pvc_folder

# Local engines listen on loopback only, whatever address the gateway has: nothing on this
# machine's network reaches them, and what runs on it needs the run's engine key.
ENGINE_HOST = "127.0.0.1"


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


def model_argument(spec: LLMDeploymentSpec, volumes: Mapping[str, str] | None = None) -> str:
    """The engine's --model here: a built-in name, or the folder a pvc source names on this
    machine (its claim mapped with `--volume CLAIM=DIR`, `servefleet.api.local_volumes`)."""
    source = spec.model.source
    if source.builtin is not None:
        return source.builtin
    if source.pvc is not None:
        try:
            return local_pvc_folder(source.pvc, volumes or {}, "model.source.pvc")
        except ValueError as exc:  # an unmapped claim, or a relative folder
            raise LocalModeError(str(exc)) from None
    raise LocalModeError(
        f"model.source.{source.kind} is not fetched in local mode; fetch it with "
        "`servefleet model fetch --source JSON --cache DIR` and serve the folder it prints "
        "with model.source.pvc (pvc.path inside a claim mapped by `--volume CLAIM=DIR`) or "
        "use a builtin model"
    )


def engine_command(
    spec: LLMDeploymentSpec,
    host: str,
    port: int,
    *,
    volumes: Mapping[str, str] | None = None,
    role: Role | None = None,
) -> list[str]:
    """The adapter's command and arguments (as a pod gets them), listening on `host:port`;
    `volumes` maps pvc claims to folders of this machine; `role`: a disaggregated pool's."""
    if spec.engine.kind != "servefleet":
        raise LocalModeError(
            f"engine.kind {spec.engine.kind} runs only on Kubernetes; local mode runs servefleet"
        )
    if spec.engine.pods_per_replica() > 1:
        raise LocalModeError(
            "engine.tensorParallelSize x pipelineParallelSize > 1 makes a replica of several "
            "ranks (a LeaderWorkerSet on Kubernetes), which local mode does not start"
        )
    adapter = engine_adapter(spec.engine.kind)
    # The pod's command names the `servefleet` script; here it is this installation's.
    subcommand = list(adapter.command[1:])
    listen = EngineListen(host=host, port=port)
    args = adapter.args(spec, model_argument(spec, volumes), listen, role=role)
    return [*servefleet_executable(), *subcommand, *args]
