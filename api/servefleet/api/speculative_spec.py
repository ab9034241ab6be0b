"""`spec.engine.speculative`: speculative decoding as a deployment asks for it.

camelCase like the rest of the spec; `to_config` turns it into the engine flag's JSON
(`--speculative-config`, spelled as vLLM spells it), so our engine and vLLM get the same
object. Unset knobs stay unset, so each engine keeps its own default for them. Only the
n-gram proposer is offered here: a draft model would need a second model source mounted
in every pod, which the spec cannot say yet (refused by the enum rather than ignored).
"""

from __future__ import annotations

from typing import Literal, Self

from pydantic import Field, model_validator

from servefleet.api.api_model import ApiModel
from servefleet.api.speculative import SpeculativeConfig

OURS_ONLY_KEYS = ("min_acceptance_rate",)
"""Keys of the flag's JSON only our engine reads; vLLM would refuse the whole object."""


LOOKUP_RANGE_MESSAGE = "engine.speculative.promptLookupMin must not exceed promptLookupMax"


class SpeculativeSpec(ApiModel):
    """Speculative decoding in each replica (engine.kind servefleet or vllm)."""

    method: Literal["ngram"] = Field(
        description="ngram: prompt lookup, proposals copied from the sequence's own tokens."
    )
    num_speculative_tokens: int = Field(ge=1, le=16, description="Tokens proposed per step.")
    prompt_lookup_max: int | None = Field(
        default=None, ge=1, description="Longest suffix n-gram looked up (engine default if unset)."
    )
    prompt_lookup_min: int | None = Field(
        default=None,
        ge=1,
        description="Shortest suffix n-gram worth a proposal (engine default if unset).",
    )
    disable_by_batch_size: int | None = Field(
        default=None,
        ge=1,
        description="No speculation in a step with more running sequences than this "
        "(engine default if unset).",
    )
    min_acceptance_rate: float | None = Field(
        default=None,
        ge=0.0,
        le=1.0,
        description="servefleet only: a request whose measured acceptance falls below this "
        "stops proposing for a while (engine default if unset).",
    )

    @model_validator(mode="after")
    def _lookup_range(self) -> Self:
        """A bound set here may also cross the engine's default for the other one."""
        try:
            self.to_config()  # the flag's own model checks the range
        except ValueError:
            raise ValueError(f"{LOOKUP_RANGE_MESSAGE} (engine defaults: min 2, max 4)") from None
        return self

    def to_config(self) -> SpeculativeConfig:
        """The engine flag's object; validated by the same model the engine parses it with."""
        keys = self.model_dump(exclude_none=True, by_alias=False)
        return SpeculativeConfig.model_validate(keys)

    def flag_value(self, *, ours: bool) -> str:
        """`--speculative-config`'s JSON; without `ours`, only the keys vLLM knows."""
        exclude = set() if ours else set(OURS_ONLY_KEYS)
        fields = set(self.model_dump(exclude_none=True)) - exclude
        return self.to_config().model_dump_json(include=fields)
