"""Sampling seeds: one range, checked at the boundary, and the one place a missing seed is
invented.

The range is a signed 64-bit integer, what OpenAI's API and vLLM accept, so a seed the gateway
invents is taken by every engine behind it. A request's `seed` outside it is a 400 naming
`seed` (`servefleet.api.openai_requests`), in the gateway and the engine alike. A request
without one gets `new_seed()`: in the gateway when it may continue the stream on another
replica (the seed must be known to both), else in the engine at admission, so any sampled
answer is reproducible from (seed, prompt, delivered tokens).
"""

from __future__ import annotations

import secrets

SEED_MIN = -(2**63)
SEED_MAX = 2**63 - 1


def new_seed() -> int:
    """A uniformly random seed of the whole range."""
    return SEED_MIN + secrets.randbits(64)
