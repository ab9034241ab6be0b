"""`--speculative-config`: one JSON object, spelled as vLLM spells it.

The same flag and keys work for our engine and vLLM's (`method`, `num_speculative_tokens`,
`prompt_lookup_max`, `prompt_lookup_min`, `disable_by_batch_size`), so a deployment can
switch engines without rewriting it. `min_acceptance_rate` is ours: the per-request switch
of the adaptive policy (see the engine's `spec/` package). `method: "draft_model"` with
`model` (any source `--model` takes) proposes with a smaller model of the same vocabulary;
as in vLLM, a `model` without a `method` means a draft model.
"""

from __future__ import annotations

from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator


class SpeculativeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Literal["ngram", "draft_model"] = Field(
        description="ngram: prompt lookup, proposals copied from the sequence's own tokens; "
        "draft_model: proposals of the smaller model `model`."
    )
    model: str | None = Field(
        default=None,
        description="draft_model: the draft's source, as `--model` takes it (a GGUF file, a "
        "Hugging Face folder, a built-in name); it must share the target's vocabulary.",
    )
    num_speculative_tokens: int = Field(ge=1, le=16, description="Tokens proposed per step.")
    prompt_lookup_max: int = Field(
        default=4, ge=1, description="Longest suffix n-gram looked up in the earlier tokens."
    )
    prompt_lookup_min: int = Field(
        default=2, ge=1, description="Shortest suffix n-gram worth a proposal."
    )
    disable_by_batch_size: int | None = Field(
        default=4,
        ge=1,
        description="No speculation in a step with more running sequences than this: the "
        "weights are read once per step anyway, so extra rows are not free there.",
    )
    draft_proposals: Literal["argmax", "sampled"] = Field(
        default="argmax",
        description="draft_model, sampled requests: argmax keeps every sampled token a pure "
        "function of (seed, position), so a seeded answer is the same alone or batched, with "
        "or without speculation, and after a mid-stream continuation; sampled proposals (from "
        "the draft's own distribution, verified by speculative sampling) are accepted more "
        "often, but a seeded answer then depends on where the speculation windows fell.",
    )
    min_acceptance_rate: float = Field(
        default=0.1,
        ge=0.0,
        le=1.0,
        description="A request whose measured acceptance falls below this stops proposing "
        "(it retries after a cool-down, as its text may turn repetitive later).",
    )

    @model_validator(mode="before")
    @classmethod
    def _model_implies_draft(cls, data: Any) -> Any:
        if isinstance(data, dict) and "method" not in data and data.get("model") is not None:
            return {**data, "method": "draft_model"}
        return data

    @model_validator(mode="after")
    def _draft_model_source(self) -> Self:
        if self.method == "draft_model" and not self.model:
            raise ValueError("method draft_model needs `model`, the draft's source")
        if self.method != "draft_model" and self.model is not None:
            raise ValueError(f"`model` applies to method draft_model, not {self.method}")
        return self

    @model_validator(mode="after")
    def _lookup_range(self) -> Self:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min must not exceed prompt_lookup_max")
        return self
