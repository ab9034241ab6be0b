"""Embeddings from the served model: the mean of its final-normed hidden states, L2-normalised.

A prompt is run through the same forward pass as generation, in chunks, against a small KV
cache of its own, so embedding takes no blocks from the shared cache and never evicts a cached
prefix. It runs on the engine thread (`Engine.call`), between two steps, because that thread
owns the model and its kernels' scratch state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from servefleet.engine.attention import AttentionMetadata, PrefillSpan
from servefleet.engine.runner import ModelRunner

CHUNK_TOKENS = 512  # bounds the attention scores' memory for long inputs


@torch.inference_mode()
def embed(runner: ModelRunner, token_ids: list[int]) -> list[float]:
    """One embedding (float32 values) for a prompt of token ids."""
    block_size = runner.block_size
    device = runner.device
    num_blocks = -(-len(token_ids) // block_size)
    caches = [
        (
            torch.zeros((num_blocks, *k.shape[1:]), dtype=k.dtype, device=k.device),
            torch.zeros((num_blocks, *v.shape[1:]), dtype=v.dtype, device=v.device),
        )
        for k, v in runner.kv_caches
    ]
    ids = torch.tensor(token_ids, dtype=torch.long, device=device)
    total: torch.Tensor | None = None
    for start in range(0, len(token_ids), CHUNK_TOKENS):
        end = min(start + CHUNK_TOKENS, len(token_ids))
        positions = torch.arange(start, end, dtype=torch.long, device=device)
        table = torch.arange(-(-end // block_size), dtype=torch.long, device=device)
        meta = AttentionMetadata(
            slot_mapping=positions.clone(),  # block i holds positions i*bs .. : slot == position
            block_size=block_size,
            prefills=[PrefillSpan(0, end - start, start, table)],
        )
        hidden = runner.model.forward(ids[start:end], positions, caches, meta).float()
        part = hidden.sum(0)
        total = part if total is None else total + part
    assert total is not None
    pooled = F.normalize(total / len(token_ids), dim=0)
    return [float(x) for x in pooled.cpu().tolist()]
