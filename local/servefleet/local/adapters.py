"""LLMAdapters in local mode: each one in the YAML is checked when `servefleet up` starts.

What the operator judges when an adapter is declared on Kubernetes is judged here before
anything runs, each failure one line naming the adapter (exit status 2): its deployment is in
the file and sets `engine.lora`; a folder on this machine (a pvc source, the claim mapped
with `--volume`) holds a PEFT adapter the engines can serve (`PeftLoraConfig.check_servable`
under the deployment's `maxLoraRank`) trained on the deployment's model
(`lora.base_model_problem`); a remote source (huggingface, s3, oci, url) is one the
deployment's engines fetch themselves (`lora_source.kube_lora_path`: no credentials, our
engine for s3, oci and url); its tenants are the deployment's; its model name is its own.

A remote adapter's own config is read by the engine when it first loads it (local mode makes
no network calls at start, as it fetches no model before its engines do): a rank or target
the engine cannot serve is then a 400 `adapter_load_failed` naming the field, remembered by
the gateway so it is asked once.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from pydantic import ValidationError

from servefleet.api.gateway_render import adapter_path
from servefleet.api.llmadapter import LLMAdapter
from servefleet.api.llmdeployment import LLMDeployment
from servefleet.api.lora import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    MAX_ADAPTER_CONFIG_BYTES,
    LoraConfigError,
    PeftLoraConfig,
    base_model_problem,
)
from servefleet.api.lora_source import AdapterSourceRefused, kube_lora_path, model_names

from .engine_command import LocalModeError


def check_local_adapters(
    adapters: Sequence[LLMAdapter],
    deployments: Sequence[LLMDeployment],
    volumes: Mapping[str, str],
) -> None:
    """LocalModeError, naming the adapter, for the first adapter local mode cannot serve."""
    by_key = {(dep.namespace, dep.name): dep for dep in deployments}
    names: dict[tuple[str, str, str], str] = {}  # (namespace, deployment, model) -> adapter
    for adapter in adapters:
        deployment = by_key.get((adapter.namespace, adapter.spec.deployment))
        try:
            deployment = _deployment(adapter, deployment)
            _check_folder(adapter, deployment, volumes)
            _check_tenants(adapter, deployment)
        except LocalModeError:
            raise
        except (LoraConfigError, ValueError) as exc:
            raise LocalModeError(f"LLMAdapter {adapter.name}: {exc}") from None
        served = adapter.served_name
        if served == deployment.spec.model.name:
            raise LocalModeError(
                f"LLMAdapter {adapter.name}: model name {served} is deployment "
                f"{deployment.name}'s base model; give the adapter a name of its own"
            )
        twin = names.setdefault((adapter.namespace, deployment.name, served), adapter.name)
        if twin != adapter.name:
            raise LocalModeError(
                f"LLMAdapter {adapter.name}: model name {served} is served by LLMAdapter "
                f"{twin} already on deployment {deployment.name}"
            )


def _deployment(adapter: LLMAdapter, found: LLMDeployment | None) -> LLMDeployment:
    if found is None:
        raise ValueError(
            f"deployment {adapter.spec.deployment} is not in the file (namespace "
            f"{adapter.namespace})"
        )
    if found.spec.engine.lora is None:
        raise ValueError(
            f"deployment {found.name} does not set engine.lora (adapter slots and the largest "
            "rank its engines accept): its engines would refuse every adapter"
        )
    return found


def _check_folder(
    adapter: LLMAdapter, deployment: LLMDeployment, volumes: Mapping[str, str]
) -> None:
    """A pvc folder holds a servable PEFT adapter trained on the deployment's model; any
    other source is one the deployment's engines can fetch."""
    if adapter.spec.source.pvc is None:
        spec = deployment.spec
        try:
            kube_lora_path(adapter.spec.source, spec.model, spec.engine)
        except AdapterSourceRefused as exc:
            raise LocalModeError(f"LLMAdapter {adapter.name}: {exc.message}") from None
        return
    try:
        folder = Path(adapter_path(adapter, deployment, True, volumes))
    except ValueError as exc:  # its message names the adapter already
        raise LocalModeError(str(exc)) from None
    if not folder.is_dir():
        raise ValueError(f"source.pvc: {folder} is not a folder")
    weights = folder / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise ValueError(f"source.pvc: {folder} has no {ADAPTER_WEIGHTS}")
    config = read_adapter_config(folder)
    lora = deployment.spec.engine.lora
    assert lora is not None  # _deployment checked it
    config.check_servable(lora.max_lora_rank)
    model = deployment.spec.model
    problem = base_model_problem(
        config.base_model_name_or_path, model_names(model.name, model.source)
    )
    if problem is not None:
        raise ValueError(problem)


def read_adapter_config(folder: Path) -> PeftLoraConfig:
    """`folder`'s adapter_config.json, size-capped; LoraConfigError naming the file and the
    field at fault."""
    path = folder / ADAPTER_CONFIG
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_ADAPTER_CONFIG_BYTES + 1)
    except OSError as exc:
        raise LoraConfigError(f"cannot read {path}: {exc.strerror or exc}") from None
    if len(raw) > MAX_ADAPTER_CONFIG_BYTES:
        raise LoraConfigError(f"{path} is over {MAX_ADAPTER_CONFIG_BYTES} bytes: not an adapter")
    try:
        return PeftLoraConfig.model_validate(json.loads(raw))
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "(document)"
        raise LoraConfigError(f"{path}: {where}: {first['msg']}") from None
    except ValueError as exc:  # not JSON, or not UTF-8
        raise LoraConfigError(f"{path} is not JSON: {exc}") from None


def _check_tenants(adapter: LLMAdapter, deployment: LLMDeployment) -> None:
    unknown = sorted(set(adapter.spec.tenants) - {t.name for t in deployment.spec.tenants})
    if unknown:
        raise ValueError(
            f"tenants {', '.join(unknown)} are not tenants of deployment {deployment.name}"
        )
