"""The engine container's parts that are plain data from the spec: env, probes, and the init
container that seeds the scratch volume (its resources are `servefleet.api.engine_resources`).
Pure; `render` assembles the pod."""

from __future__ import annotations

from typing import Any

from servefleet.api.conventions import ENGINE_PORT_NAME, SCRATCH_VOLUME
from servefleet.api.engines import EngineAdapter
from servefleet.api.llmdeployment import LLMDeployment

PROBE_PERIOD_SECONDS = 5
# Time between SIGKILL and the end of the engine's own drain, for the process to exit.
EXIT_GRACE_SECONDS = 10


def user_env(dep: LLMDeployment) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for var in dep.spec.engine.env:
        if var.secret_key_ref is not None:
            ref = var.secret_key_ref
            out.append(
                {
                    "name": var.name,
                    "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}},
                }
            )
        else:
            out.append({"name": var.name, "value": var.value or ""})
    return out


def lora_env(dep: LLMDeployment, adapter: EngineAdapter) -> list[dict[str, Any]]:
    """What the engine kind needs in its environment to serve adapters (`engine.lora` set),
    e.g. vLLM's switch for its load/unload endpoints; a name the user's env sets is left to it."""
    if dep.spec.engine.lora is None:
        return []
    own = {var.name for var in dep.spec.engine.env}
    return [{"name": k, "value": v} for k, v in adapter.lora_env if k not in own]


def probes(adapter: EngineAdapter, startup_timeout: int) -> dict[str, Any]:
    def http(path: str) -> dict[str, Any]:
        return {"path": path, "port": ENGINE_PORT_NAME}

    return {
        # Slow model loads get the whole startupTimeoutSeconds before liveness counts.
        "startupProbe": {
            "httpGet": http(adapter.live_path),
            "periodSeconds": PROBE_PERIOD_SECONDS,
            "failureThreshold": max(1, -(-startup_timeout // PROBE_PERIOD_SECONDS)),
        },
        # Ready means the model is loaded and warm; a draining engine answers 503 here.
        "readinessProbe": {
            "httpGet": http(adapter.ready_path),
            "periodSeconds": PROBE_PERIOD_SECONDS,
            "failureThreshold": 2,
        },
        "livenessProbe": {
            "httpGet": http(adapter.live_path),
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 6,
        },
    }


def seed_container(adapter: EngineAdapter, image: str, pull_policy: str) -> dict[str, Any]:
    """Copies what the image ships under the scratch mount into the scratch volume, which
    is mounted over it (our engine's prebuilt C kernels): same image, nothing else."""
    seed = "/seed"
    assert adapter.image_scratch is not None
    copy = f"[ ! -d {adapter.image_scratch} ] || cp -a {adapter.image_scratch} {seed}/"
    return {
        "name": "scratch-seed",
        "image": image,
        "imagePullPolicy": pull_policy,
        "command": ["sh", "-c", copy],
        "volumeMounts": [{"name": SCRATCH_VOLUME, "mountPath": seed}],
    }
