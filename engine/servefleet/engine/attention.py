"""Paged attention over a block-structured KV cache.

One step of the engine is a flat batch of tokens: first one token per decoding
sequence, then the prompt chunks being prefilled. Decode tokens go through one
batched kernel (the gather-free CPU kernel or Triton on GPU when available,
plain PyTorch otherwise); each prefill chunk runs SDPA over its sequence's
cached context, which is what lets chunked prefill and prefix-cache hits share
one code path. In batch-invariant mode (`PagedAttention.per_row_prefill`) every prompt
row goes through the decode kernel instead, as the decode of its position.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from servefleet.engine.kv_quant import widen, write_rows

if TYPE_CHECKING:
    from servefleet.engine.lora.batch import LoraBatch

DecodeKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor
]


@dataclass
class PrefillSpan:
    """One prompt chunk inside the flat token batch."""

    start: int  # first token of the chunk in the flat batch
    end: int  # one past its last token
    num_cached: int  # tokens of this sequence already in the KV cache before the chunk
    block_table: torch.Tensor  # int64 [num_blocks] covering num_cached + (end - start) tokens


@dataclass
class AttentionMetadata:
    """Everything attention needs about one step, built once and shared by all layers,
    and the step's adapters (which rows run under which LoRA; None: all on the base)."""

    slot_mapping: torch.Tensor  # int64 [T]: block_id * block_size + offset for every token
    block_size: int
    num_decodes: int = 0
    decode_block_tables: torch.Tensor | None = None  # int32 [D, max_blocks]
    decode_context_lens: torch.Tensor | None = None  # int32 [D], the current token included
    prefills: list[PrefillSpan] = field(default_factory=list)
    lora: LoraBatch | None = None
    # Batch-invariant mode: every row of the step as one decode-kernel entry (built once
    # a step by `per_row_tables`, shared by all layers).
    row_tables: tuple[torch.Tensor, torch.Tensor] | None = None


def per_row_tables(
    meta: AttentionMetadata, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block tables [T, max_blocks] and context lengths [T] with one entry per row of the
    step: decode rows as they are, prompt row i of a chunk as a decode of position
    num_cached + i. The decode kernel then computes a prompt row exactly as a decode step
    of that position would, whatever the chunking, caching or batch."""
    if meta.row_tables is not None:
        return meta.row_tables
    tables: list[torch.Tensor] = []
    lens: list[torch.Tensor] = []
    expected = meta.num_decodes
    if meta.num_decodes:
        assert meta.decode_block_tables is not None and meta.decode_context_lens is not None
        tables.append(meta.decode_block_tables.to(device=device, dtype=torch.int32))
        lens.append(meta.decode_context_lens.to(device=device, dtype=torch.int32))
    for span in meta.prefills:
        if span.start != expected:
            raise ValueError("prompt chunks must follow the decode rows, in order")
        rows, expected = span.end - span.start, span.end
        table = span.block_table.to(device=device, dtype=torch.int32)
        tables.append(table.unsqueeze(0).expand(rows, -1))
        lens.append(torch.arange(1, rows + 1, dtype=torch.int32, device=device) + span.num_cached)
    width = max(t.shape[1] for t in tables)
    padded = torch.zeros(expected, width, dtype=torch.int32, device=device)
    row = 0
    for t in tables:
        padded[row : row + t.shape[0], : t.shape[1]] = t
        row += t.shape[0]
    meta.row_tables = (padded, torch.cat(lens))
    return meta.row_tables


def torch_paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Reference decode attention: gathers each sequence's blocks, then SDPA.

    q: [D, H, hd]; caches: [num_blocks, block_size, kvh, hd] (int8: hd + 4, see kv_quant);
    returns [D, H, hd].
    """
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    tables = block_tables.long()
    max_len = tables.shape[1] * block_size
    k = widen(k_cache[tables]).view(num_seqs, max_len, num_kv_heads, head_dim).transpose(1, 2)
    v = widen(v_cache[tables]).view(num_seqs, max_len, num_kv_heads, head_dim).transpose(1, 2)
    positions = torch.arange(max_len, device=q.device)
    visible = positions[None, :] < context_lens.to(q.device)[:, None].long()
    group = num_heads // num_kv_heads
    qg = q.view(num_seqs, num_kv_heads, group, head_dim)
    # A cache narrower than q (float16 under a float32 model) is widened, never q narrowed.
    dtype = torch.promote_types(q.dtype, k.dtype)
    out = F.scaled_dot_product_attention(
        qg.to(dtype), k.to(dtype), v.to(dtype), attn_mask=visible[:, None, None, :], scale=scale
    )
    return out.reshape(num_seqs, num_heads, head_dim).to(q.dtype)


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    span: PrefillSpan,
    scale: float,
) -> torch.Tensor:
    """Causal attention of one chunk over its sequence's cached prefix plus itself."""
    num_tokens, num_heads = q.shape[0], q.shape[1]
    num_kv_heads = k_cache.shape[2]
    context = span.num_cached + num_tokens
    k = widen(k_cache[span.block_table].flatten(0, 1)[:context]).transpose(0, 1)
    v = widen(v_cache[span.block_table].flatten(0, 1)[:context]).transpose(0, 1)
    dtype = torch.promote_types(q.dtype, k.dtype)
    k, v = k.to(dtype), v.to(dtype)
    qh = q.transpose(0, 1).to(dtype)
    gqa = num_heads != num_kv_heads
    if span.num_cached == 0:
        out = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        query_pos = span.num_cached + torch.arange(num_tokens, device=q.device)
        key_pos = torch.arange(context, device=q.device)
        mask = key_pos[None, :] <= query_pos[:, None]
        out = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out.transpose(0, 1).to(q.dtype)


class PagedAttention:
    """Writes the step's keys/values into the cache, then attends."""

    def __init__(self, decode_kernel: DecodeKernel | None = None) -> None:
        self.decode_kernel: DecodeKernel = decode_kernel or torch_paged_decode
        # Batch-invariant mode: prompt rows through the decode kernel, one row each.
        self.per_row_prefill = False

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """q: [T, H, hd], k/v: [T, kvh, hd]; caches [num_blocks, block_size, kvh, hd]."""
        write_rows(k_cache, meta.slot_mapping, k)
        write_rows(v_cache, meta.slot_mapping, v)
        return self.attend(q, k_cache, v_cache, meta, scale)

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Attention over caches that already hold this step's keys and values."""
        if meta.prefills and self.per_row_prefill:
            tables, lens = per_row_tables(meta, q.device)
            return self.decode_kernel(q.contiguous(), k_cache, v_cache, tables, lens, scale)
        if not meta.prefills:
            assert meta.decode_block_tables is not None and meta.decode_context_lens is not None
            return self.decode_kernel(
                q.contiguous(),
                k_cache,
                v_cache,
                meta.decode_block_tables,
                meta.decode_context_lens,
                scale,
            )
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if meta.num_decodes:
            assert meta.decode_block_tables is not None and meta.decode_context_lens is not None
            out[: meta.num_decodes] = self.decode_kernel(
                q[: meta.num_decodes].contiguous(),
                k_cache,
                v_cache,
                meta.decode_block_tables,
                meta.decode_context_lens,
                scale,
            )
        for span in meta.prefills:
            out[span.start : span.end] = prefill_attention(
                q[span.start : span.end], k_cache, v_cache, span, scale
            )
        return out
