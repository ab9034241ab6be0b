"""What speculative decoding counts between two scrapes: the speculator adds to it, the
metrics read it. Below both, so the scheduler can name it without importing the speculator."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    """Counts since the last `take_stats`, as vLLM reports them."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: dict[int, int] = field(default_factory=dict)
