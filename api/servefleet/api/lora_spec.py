"""`engine.lora`: a deployment whose engines serve LoRA adapters (declared as `LLMAdapter`s).

Its own section so the engine flags follow from it for every engine kind (ours and vLLM:
`--enable-lora --max-loras --max-lora-rank`; SGLang: `--max-loras-per-batch`) and an adapter
can be checked against the limits its engines start with when it is declared.
"""

from __future__ import annotations

from pydantic import Field

from servefleet.api.api_model import ApiModel


class LoraSpec(ApiModel):
    """Adapter slots and the largest rank each engine replica accepts."""

    max_loras: int = Field(
        default=8,
        ge=1,
        le=256,
        description="Adapters one replica holds at once (--max-loras); the least recently used "
        "one is evicted to load another.",
    )
    max_lora_rank: int = Field(
        default=64,
        ge=1,
        le=512,
        description="Largest LoRA rank r a replica accepts (--max-lora-rank); an LLMAdapter "
        "with a larger one is refused when it is declared.",
    )
