"""What the engine's routes share: the engine, its tokenizer and template, its limits.

Below every route module (`server`, `request_checks`, `preparation`, `responses`,
`extra_routes`), which all read it, so none of them imports another that imports it back.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from servefleet.api.engine_flags import engine_flag
from servefleet.api.openai_errors import OpenAIError
from servefleet.api.replica_endpoints import IPNetwork
from servefleet.engine.kv_store import KVStore
from servefleet.engine.kv_warm_gate import WarmGate
from servefleet.engine.loop import Engine
from servefleet.engine.lora.registry import LoraRegistry
from servefleet.engine.prepare_pool import Preparer
from servefleet.engine.structured.service import StructuredOutputs
from servefleet.text.chat_template import ChatTemplate, ChatTemplateError
from servefleet.text.tokenizer import Tokenizer


@dataclass
class ServingState:
    """What the routes need; owned by the process that runs the server."""

    engine: Engine
    tokenizer: Tokenizer
    chat_template: ChatTemplate
    served_model_name: str
    max_model_len: int
    block_size: int
    num_kv_blocks: int
    max_queue_depth: int
    ready: bool = False
    draining: bool = False
    started_at: float = field(default_factory=time.time)
    api_key: str | None = field(default=None, repr=False)  # --api-key: all but probes need it
    tool_call_parser: str | None = None  # --tool-call-parser; None: from the chat template
    loras: LoraRegistry | None = None  # --enable-lora: the adapters served beside the model
    kv_store: KVStore | None = None  # the cache's storage and fingerprint: KV transfer
    kv_peer_networks: tuple[IPNetwork, ...] = ()  # --kv-peer-networks
    kv_warm: WarmGate | None = None  # while set and warming, /ready answers 503 kv-warming
    # --prepare-timeout: one request's preparation budget
    prepare_timeout_s: float = engine_flag("prepare_timeout").default  # type: ignore[assignment]

    def __post_init__(self) -> None:
        self.structured = StructuredOutputs(
            self.tokenizer, self.chat_template, self.tool_call_parser
        )
        self.preparer = Preparer(self.prepare_timeout_s)

    def render_prompt(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """The chat template's prompt; a template that fails (its `raise_exception`, a jinja
        error) fails on what the client sent, so it is a 400 on `messages`."""
        try:
            return self.chat_template.render(
                messages, add_generation_prompt=add_generation_prompt, tools=tools
            )
        except Exception as exc:
            message = str(exc) if isinstance(exc, ChatTemplateError) else f"chat template: {exc}"
            raise OpenAIError(status=400, message=message, param="messages") from exc

    def retry_after(self) -> int:
        """Seconds until the queue ahead has likely drained, from measured step times."""
        waiting = self.engine.num_waiting
        hist = self.engine.metrics.e2e
        count = _hist_value(hist, "_count")
        mean = _hist_value(hist, "_sum") / count if count else 5.0
        slots = max(1, len(self.engine.scheduler.running))
        return max(1, math.ceil(mean * (waiting + 1) / slots))


def _hist_value(hist: Any, suffix: str) -> float:
    for metric in hist.collect():
        for sample in metric.samples:
            if sample.name.endswith(suffix):
                return float(sample.value)
    return 0.0
