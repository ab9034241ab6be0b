"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of the
sequence's last n tokens (no extra model).

Strong where the output copies from the input (editing, summarising, RAG, code); costs
one vectorised scan of the sequence's tokens per step, and proposes nothing when the
suffix never occurred before.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(
    token_ids: Sequence[int], num_tokens: int, lookup_min: int, lookup_max: int
) -> list[int]:
    """Up to `num_tokens` proposed continuations of `token_ids`; [] when nothing matches.

    The longest suffix n-gram (lookup_max down to lookup_min) that occurred earlier wins;
    among its occurrences the latest, whose context is closest to what is being written.
    """
    length = len(token_ids)
    if num_tokens <= 0 or length < lookup_min + 1:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(lookup_max, length - 1), lookup_min - 1, -1):
        suffix = tokens[length - n :]
        # Windows of the tokens before the last one: the suffix itself is never a match.
        windows = sliding_window_view(tokens[: length - 1], n)
        starts = np.flatnonzero((windows == suffix).all(axis=1))
        if starts.size:
            follow = int(starts[-1]) + n
            return tokens[follow : follow + num_tokens].tolist()
    return []
