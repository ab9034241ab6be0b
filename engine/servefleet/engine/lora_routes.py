"""LoRA adapters over HTTP: vLLM's load and unload endpoints, and the model cards they add.

`POST /v1/load_lora_adapter {"lora_name", "lora_path"}` reads a PEFT directory on the
engine's filesystem (off the event loop) and serves it as model `lora_name`; a path
`hf://repo@revision` or `s3://bucket/prefix/` (`servefleet.api.lora_source`, how the gateway
names an adapter on Kubernetes) is fetched into the engine's cache first (`lora.remote`);
`POST /v1/unload_lora_adapter {"lora_name"}` forgets it. Like every engine path but the
probes they need the engine key: only the gateway and the operator call them, never a
tenant. Without `--enable-lora` both answer 400 naming the flag.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request

from servefleet.api.lora import LoadLoraAdapterRequest, LoraConfigError, UnloadLoraAdapterRequest
from servefleet.api.lora_source import parse_remote_lora_path
from servefleet.api.model_source import ModelSource
from servefleet.api.openai_errors import OpenAIError
from servefleet.engine.fetch import FetchError
from servefleet.engine.lora.registry import AdapterNotFound, AdapterSlotsBusy, LoraRegistry
from servefleet.engine.lora.remote import adapter_cache_root, fetch_adapter, fetched_directory
from servefleet.engine.request_checks import model_not_found, parse

if TYPE_CHECKING:
    from servefleet.engine.serving_state import ServingState

log = logging.getLogger("servefleet.engine.lora")


def model_card(state: ServingState) -> dict[str, Any]:
    return {
        "id": state.served_model_name,
        "object": "model",
        "created": int(state.started_at),
        "owned_by": "servefleet",
        "max_model_len": state.max_model_len,
    }


def adapter_card(state: ServingState, name: str) -> dict[str, Any]:
    """An adapter as vLLM lists one: its base model is its `parent`."""
    return model_card(state) | {"id": name, "parent": state.served_model_name, "root": name}


def model_cards(state: ServingState) -> list[dict[str, Any]]:
    names = state.loras.names() if state.loras is not None else []
    return [model_card(state), *(adapter_card(state, name) for name in names)]


def _registry(state: ServingState) -> LoraRegistry:
    if state.loras is None:
        raise OpenAIError(
            status=400, message="LoRA adapters are off: start the engine with --enable-lora"
        )
    return state.loras


def add_lora_routes(app: FastAPI, state: ServingState) -> None:
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> dict[str, Any]:
        body = await parse(request, LoadLoraAdapterRequest)
        registry = _registry(state)
        if body.lora_name == state.served_model_name:
            raise OpenAIError(
                status=400, message="lora_name is the base model's name", param="lora_name"
            )
        directory, remote = _where(body.lora_path)
        current = registry.get(body.lora_name)
        if current is not None and not body.load_inplace and current.path != str(directory):
            raise OpenAIError(
                status=400,
                message=f"adapter {body.lora_name!r} is loaded from {current.path}; "
                "set load_inplace to replace it",
                param="lora_name",
            )
        if remote is not None and (current is None or body.load_inplace):
            directory = await _fetch(remote)
        try:
            adapter, loaded = await asyncio.to_thread(
                registry.load, body.lora_name, directory, body.load_inplace
            )
        except LoraConfigError as exc:
            raise OpenAIError(status=400, message=str(exc), param="lora_path") from exc
        except AdapterSlotsBusy as exc:
            raise OpenAIError(
                status=503, message=str(exc), type="service_unavailable",
                code="adapter_slots_busy", headers={"Retry-After": "1"},
            ) from exc  # fmt: skip
        if loaded:
            log.info("lora_loaded name=%s rank=%d", adapter.name, adapter.config.r)
        return {
            "lora_name": adapter.name,
            "loaded": loaded,
            "rank": adapter.config.r,
            "target_modules": list(adapter.config.target_modules),
            "bytes": adapter.nbytes,
        }

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> dict[str, Any]:
        body = await parse(request, UnloadLoraAdapterRequest)
        registry = _registry(state)
        try:
            registry.unload(body.lora_name)
        except AdapterNotFound as exc:
            raise model_not_found(body.lora_name) from exc
        log.info("lora_unloaded name=%s", body.lora_name)
        return {"lora_name": body.lora_name, "unloaded": True}


def _where(path: str) -> tuple[Path, ModelSource | None]:
    """The folder `path` names, and the source to fetch into it first (None: a folder
    already on the engine's disk)."""
    try:
        remote = parse_remote_lora_path(path)
    except ValueError as exc:
        message = str(exc).splitlines()[0]
        raise OpenAIError(status=400, message=message, param="lora_path") from exc
    if remote is None:
        return _directory(path), None
    return fetched_directory(remote, adapter_cache_root()), remote


async def _fetch(source: ModelSource) -> Path:
    """Download the adapter (a cache hit when another load did); a failure is a 400 when
    asking again cannot help (not found, no access), else a 503 to retry."""
    try:
        return await asyncio.to_thread(fetch_adapter, source, adapter_cache_root())
    except FetchError as exc:
        if exc.permanent:
            raise OpenAIError(
                status=400, message=f"lora_path: {exc.message}", param="lora_path",
                code="adapter_fetch_failed",
            ) from exc  # fmt: skip
        raise OpenAIError(
            status=503, message=f"lora_path: {exc.message}", type="service_unavailable",
            code="adapter_fetch_failed", headers={"Retry-After": "5"},
        ) from exc  # fmt: skip


def _directory(path: str) -> Path:
    """An absolute directory: adapters are files the platform put on the engine's disk."""
    directory = Path(path)
    if not directory.is_absolute() or ".." in directory.parts:
        raise OpenAIError(
            status=400, message="lora_path: an absolute path without '..'", param="lora_path"
        )
    if not directory.is_dir():
        raise OpenAIError(
            status=400, message=f"lora_path: {path} is not a directory", param="lora_path"
        )
    return directory
