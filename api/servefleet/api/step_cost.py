"""The engine's step-cost model and decode-step target: the flag's grammar and the
Prometheus names, shared by the engine (which exports them) and whatever reads them.

Standard library only: the CLI's flag table imports this before pydantic or torch load.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

STEP_COST_TERMS = ("fixed", "decode_row", "prompt_token", "prompt_attention", "prompt_step")
"""The model's terms: step seconds = fixed + decode_row x decode rows + prompt_token x prompt
tokens + prompt_attention x (prompt tokens x mean context / 1024) + prompt_step x (1 when the
step has prompt tokens)."""

StepCostTerm = Literal["fixed", "decode_row", "prompt_token", "prompt_attention", "prompt_step"]

STEP_COST_METRIC = "servefleet_engine_step_cost_seconds"
"""Gauge, one series per term: the fitted coefficient (seconds per unit of the term)."""
STEP_COST_TERM_LABEL = "term"
PROMPT_CHUNK_METRIC = "servefleet_engine_prompt_chunk_tokens"
"""Gauge: prompt tokens the last step with decodes running took (the chosen chunk size)."""
DECODE_STEP_TARGET_METRIC = "servefleet_engine_decode_step_target_seconds"
"""Gauge: the step-time target of the last step with decodes running (0: off)."""

AUTO_TARGET_FACTOR = 2.0
"""`--max-decode-step-ms auto`: a step with decodes running may take this many times the
predicted pure-decode step, so a long prompt at most doubles the decoding streams' ITL."""

OFF = "off"
AUTO = "auto"


@dataclass(frozen=True)
class DecodeStepTarget:
    """What `--max-decode-step-ms` asks: a fixed step time, or a factor of the predicted
    pure-decode step (auto). Neither: off, every step may take a full token budget."""

    seconds: float | None = None
    factor: float | None = None

    @property
    def is_off(self) -> bool:
        return self.seconds is None and self.factor is None

    def for_decode_step(self, decode_step_seconds: float) -> float:
        """The step time a step with decodes running may take (inf when off)."""
        if self.seconds is not None:
            return self.seconds
        if self.factor is not None:
            return self.factor * decode_step_seconds
        return math.inf


def parse_decode_step_target(value: str) -> DecodeStepTarget:
    """`--max-decode-step-ms`: off (or 0), auto, or milliseconds; ValueError names the flag."""
    text = value.strip().lower()
    if text == AUTO:
        return DecodeStepTarget(factor=AUTO_TARGET_FACTOR)
    if text == OFF:
        return DecodeStepTarget()
    try:
        ms = float(text)
    except ValueError:
        ms = math.nan
    if ms == 0:
        return DecodeStepTarget()
    if not 0 < ms <= 600_000:  # also refuses nan and inf
        raise ValueError(
            f"--max-decode-step-ms {value!r}: off, 0, auto, or milliseconds in (0, 600000]"
        )
    return DecodeStepTarget(seconds=ms / 1000.0)
