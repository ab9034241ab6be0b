"""The scaling knobs the policy needs, independent of where they came from (CR, YAML, sim)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class ScalingTargets(BaseModel):
    """Pool bounds and service targets of one deployment, in plain seconds and counts."""

    model_config = ConfigDict(frozen=True)

    min_replicas: int = Field(ge=0, description="warm pool; 0 enables scale-to-zero")
    max_replicas: int = Field(ge=1)
    target_per_replica: float = Field(gt=0, description="in-flight requests per replica")
    batch_slots_per_replica: int | None = Field(
        default=None,
        ge=1,
        description="slots of a replica batch requests may hold (its concurrency less the "
        "interactive reserve); None: no batch signal is acted on",
    )
    scale_down_delay_s: float = Field(default=300.0, ge=0)
    queue_wait_target_s: float | None = Field(default=None, gt=0)
    ttft_target_s: float | None = Field(default=None, gt=0)
    default_cold_start_s: float = Field(
        default=60.0, gt=0, description="used until a cold start has been measured"
    )
    pending_patience_s: float = Field(
        default=300.0,
        gt=0,
        description="how long a replica not yet placed counts as coming; after that it is "
        "unavailable and no more are asked for",
    )
    signal_max_age_s: float = Field(
        default=60.0, gt=0, description="older observations are unknown, not zero"
    )
    replica_cost_per_hour: float | None = Field(
        default=None,
        gt=0,
        description="price of one replica-hour (with the spill price: rent or buy)",
    )
    spill_cost_per_million_tokens: float | None = Field(
        default=None, gt=0, description="hosted-API price of spilled prompt + completion tokens"
    )
    spill_patience: float = Field(
        default=1.0,
        gt=0,
        description="how many times the least that replicas would cost the spill-over may cost "
        "before replicas are bought: 1 is the classic rent-or-buy; more spills longer (cheaper "
        "where bursts are shorter than a cold start), less buys sooner",
    )

    @property
    def prices_spill(self) -> bool:
        """Both prices known: spill-over is weighed against buying replicas."""
        return self.replica_cost_per_hour is not None and (
            self.spill_cost_per_million_tokens is not None
        )

    @model_validator(mode="after")
    def _bounds_ordered(self) -> ScalingTargets:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"minReplicas ({self.min_replicas}) must not exceed "
                f"maxReplicas ({self.max_replicas})"
            )
        return self
