"""What a step costs on this machine, learnt from the steps the engine runs.

step seconds ≈ fixed + decode_row·D + prompt_token·P + prompt_attention·A + prompt_step·[P>0]

with D the decode rows (proposals included), P the prompt tokens and A = Σ n·(c + n/2)/1024
over the step's prompt chunks (n tokens after c already computed): the attention a chunk
pays grows with its context, which on a 1,500-token prompt is a third of the chunk's time
for a small model, so a chunk late in a long prompt must be smaller than an early one for
the same step time. `prompt_step` is the switch from the few-row decode kernels to the
prompt path that any prompt token costs. Decode attention (D x context) is left in
`decode_row`: decoding contexts change slowly, and the exponential forgetting follows them.

The fit is ridge-regularised least squares with exponential forgetting (each step's sums
decay by FORGET): the seeded priors hold until steps say otherwise (PRIOR_STEPS worth of
weight), then the last few hundred steps decide. Priors are conservative for a CPU (prompt
tokens dear), so an engine's first chunks beside decodes are small, never too large.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from servefleet.api.step_cost import STEP_COST_TERMS

PRIORS = (0.010, 0.001, 0.0005, 0.0001, 0.010)  # seconds per unit of each term
SCALES = (1.0, 8.0, 256.0, 128.0, 1.0)  # a typical step's value of each term
PRIOR_STEPS = 0.1  # the priors weigh as much as this many typical steps
FORGET = 0.99  # per step: the fit remembers about the last 100 steps
ATTENTION_SPAN = 1024.0


@dataclass(frozen=True)
class StepShape:
    """What a step computes, in the model's terms."""

    decode_rows: int = 0
    prompt_tokens: int = 0
    prompt_attention: float = 0.0  # Σ n·(context + n/2) / 1024

    @classmethod
    def of(cls, decode_rows: int, chunks: Iterable[tuple[int, int]]) -> StepShape:
        """`chunks`: (tokens, computed before) of each prompt chunk."""
        tokens, attention = 0, 0.0
        for n, before in chunks:
            tokens += n
            attention += chunk_attention(n, before)
        return cls(decode_rows, tokens, attention)

    def features(self) -> np.ndarray:
        prompt = 1.0 if self.prompt_tokens else 0.0
        return np.array([1.0, self.decode_rows, self.prompt_tokens, self.prompt_attention, prompt])


def chunk_attention(tokens: int, before: int) -> float:
    return tokens * (before + tokens / 2) / ATTENTION_SPAN


class StepCostModel:
    """Online fit of step seconds over `StepShape`s (engine thread only)."""

    def __init__(self, priors: tuple[float, ...] = PRIORS) -> None:
        self.priors = np.array(priors, dtype=np.float64)
        scales = np.array(SCALES, dtype=np.float64)
        self._ridge = np.diag(PRIOR_STEPS * scales**2)
        self._xtx = np.zeros((len(priors), len(priors)))
        self._xty = np.zeros(len(priors))
        self._coef = self.priors.copy()
        self.num_steps = 0

    def observe(self, shape: StepShape, seconds: float) -> None:
        if not math.isfinite(seconds) or seconds < 0:
            return
        x = shape.features()
        self._xtx = FORGET * self._xtx + np.outer(x, x)
        self._xty = FORGET * self._xty + x * seconds
        self.num_steps += 1
        self._coef = _nonnegative_solve(
            self._xtx + self._ridge, self._xty + self._ridge @ self.priors
        )

    @property
    def coefficients(self) -> dict[str, float]:
        return {term: float(c) for term, c in zip(STEP_COST_TERMS, self._coef, strict=True)}

    def predict(self, shape: StepShape) -> float:
        return float(shape.features() @ self._coef)

    def decode_step(self, decode_rows: int) -> float:
        """Predicted seconds of a step of `decode_rows` decodes and no prompt token."""
        return self.predict(StepShape(decode_rows))

    def prompt_tokens_within(self, seconds: float, context: int, first: bool) -> int:
        """The most prompt tokens of one chunk after `context` computed tokens whose cost
        fits in `seconds` (`first`: the step's first chunk pays the prompt_step term)."""
        _, _, per_token, per_attention, prompt_step = self._coef
        left = seconds - (prompt_step if first else 0.0)
        if left <= 0:
            return 0
        # cost(n) = per_token·n + per_attention·n·(context + n/2)/1024: solve cost(n) = left.
        quad = per_attention / (2 * ATTENTION_SPAN)
        lin = per_token + per_attention * context / ATTENTION_SPAN
        if quad <= 0:
            return int(left / lin) if lin > 0 else 1 << 30
        n = (-lin + math.sqrt(lin * lin + 4 * quad * left)) / (2 * quad)
        return int(min(n, 1 << 30))

    def chunk_seconds(self, tokens: int, context: int, first: bool) -> float:
        _, _, per_token, per_attention, prompt_step = self._coef
        fixed = prompt_step if first else 0.0
        return fixed + per_token * tokens + per_attention * chunk_attention(tokens, context)


def _nonnegative_solve(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin of the quadratic (a, b) with every coefficient ≥ 0: a cost is never negative,
    though noise may say so for terms the steps barely tell apart. Terms that come out
    negative are pinned at 0 and the rest solved again (a few rounds: five terms)."""
    free = np.ones(len(b), dtype=bool)
    coef = np.zeros(len(b))
    for _ in range(len(b)):
        coef[:] = 0.0
        coef[free] = np.linalg.solve(a[np.ix_(free, free)], b[free])
        negative = free & (coef < 0)
        if not negative.any():
            return coef
        free &= ~negative
    return np.maximum(coef, 0.0)
