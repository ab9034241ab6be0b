"""A stand-in engine replica with vLLM's LoRA endpoints, for the gateway's adapter tests.

It keeps at most `max_loras` adapters (least recently used out, as engines do), answers a
chat for an adapter it does not hold with 404 `model_not_found` (vLLM's and our engine's
answer), refuses a load whose path starts with `/bad` with 400, and says in each answer
which adapter produced it. The real engine's side is tested on real adapters
(tests/test_lora_engine.py, tests/test_lora_http.py).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

BASE = "base"


@dataclass
class LoraReplicaLog:
    loads: list[tuple[str, str]] = field(default_factory=list)  # (name, path) of each load
    chats: list[str] = field(default_factory=list)  # the model of each chat
    auth: list[str] = field(default_factory=list)  # authorization of each load


def _error(status: int, message: str, code: str) -> JSONResponse:
    body = {"error": {"message": message, "type": "invalid_request_error", "code": code}}
    return JSONResponse(body, status_code=status)


def lora_replica(
    max_loras: int = 2, load_delay_s: float = 0.0
) -> tuple[FastAPI, OrderedDict[str, str], LoraReplicaLog]:
    """(the app, its adapters {name: path} in LRU order, what it was asked)."""
    app = FastAPI()
    held: OrderedDict[str, str] = OrderedDict()
    log = LoraReplicaLog()

    @app.get("/ready")
    async def ready() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        cards = [{"id": BASE, "object": "model"}]
        cards += [{"id": name, "object": "model", "parent": BASE} for name in held]
        return {"object": "list", "data": cards}

    @app.post("/v1/load_lora_adapter", response_model=None)
    async def load(request: Request) -> dict[str, Any] | JSONResponse:
        body = await request.json()
        log.loads.append((body["lora_name"], body["lora_path"]))
        log.auth.append(request.headers.get("authorization", ""))
        await asyncio.sleep(load_delay_s)
        if body["lora_path"].startswith("/bad"):
            return _error(400, "r 128 is above the engine's --max-lora-rank 64", "bad_adapter")
        held[body["lora_name"]] = body["lora_path"]
        held.move_to_end(body["lora_name"])
        while len(held) > max_loras:
            held.popitem(last=False)
        return {"lora_name": body["lora_name"], "loaded": True}

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(request: Request) -> dict[str, Any] | JSONResponse:
        body = await request.json()
        model = body["model"]
        log.chats.append(model)
        if model != BASE and model not in held:
            return _error(404, f"The model `{model}` does not exist.", "model_not_found")
        if model in held:
            held.move_to_end(model)
        message = {"role": "assistant", "content": f"answer of {model}"}
        return {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 0,
            "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6},
        }

    return app, held, log
