"""The two kernel switches of batch-invariant mode, on small random tensors.

`SmallRowsMatmul(invariant=True)` gives every row of a many-row call the bits a one-row
call gives it; `PagedAttention.per_row_prefill` computes a step of decode rows and prompt
chunks (with cached prefixes) as the decode kernel computes each row alone, and agrees
with the SDPA path to float32 rounding.
"""

from __future__ import annotations

import pytest
import torch

from servefleet.engine.attention import AttentionMetadata, PagedAttention, PrefillSpan
from servefleet.engine.kernels import SMALL_MM_MAX_ROWS, select_decode_kernel, select_small_mm
from servefleet.engine.kernels.matmul import SmallRowsMatmul

BLOCK, KV_HEADS, HEADS, HEAD_DIM = 16, 2, 6, 32
# The CPU kernels are part of the product: without a compiler these fail, never skip.
pytestmark = pytest.mark.usefixtures("require_compiler")


def _gemm() -> SmallRowsMatmul:
    kernel = select_small_mm("cpu")
    assert kernel is not None, "the C matmuls did not build"
    return SmallRowsMatmul(kernel, SMALL_MM_MAX_ROWS, invariant=True)


def test_many_row_calls_give_each_row_its_own_bits() -> None:
    matmul = _gemm()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(150, 96, generator=gen)
    w_in_out, w_out_in = torch.randn(96, 80, generator=gen), torch.randn(80, 96, generator=gen)
    bias = torch.randn(80, generator=gen)
    many_mm, many_linear = matmul.mm(x, w_in_out, bias), matmul.linear(x, w_out_in)
    for row in (0, 63, 64, 65, 149):
        one = x[row : row + 1]
        assert torch.equal(many_mm[row], matmul.mm(one, w_in_out, bias)[0])
        assert torch.equal(many_linear[row], matmul.linear(one, w_out_in)[0])
    assert torch.allclose(many_mm, x @ w_in_out + bias, atol=1e-4)


def _cache(blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    shape = (blocks, BLOCK, KV_HEADS, HEAD_DIM)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def test_prompt_rows_are_computed_as_decodes_of_their_positions() -> None:
    name, kernel = select_decode_kernel("cpu", "auto")
    assert name == "cpu-c", "the C decode kernel did not build"
    k_cache, v_cache = _cache(12)
    # one decode (context 20, blocks 0-1), a chunk of 10 after 21 cached tokens (blocks
    # 2-3), a cold chunk of 40 (blocks 4-6)
    q = torch.randn(51, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(3))
    spans = [
        PrefillSpan(1, 11, 21, torch.tensor([2, 3])),
        PrefillSpan(11, 51, 0, torch.tensor([4, 5, 6])),
    ]
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(51, dtype=torch.long),
        block_size=BLOCK,
        num_decodes=1,
        decode_block_tables=torch.tensor([[0, 1]], dtype=torch.int32),
        decode_context_lens=torch.tensor([20], dtype=torch.int32),
        prefills=spans,
    )
    attention = PagedAttention(kernel)
    sdpa = attention.attend(q, k_cache, v_cache, meta, HEAD_DIM**-0.5)
    attention.per_row_prefill = True
    per_row = attention.attend(q, k_cache, v_cache, meta, HEAD_DIM**-0.5)
    assert torch.allclose(per_row, sdpa, atol=1e-5)
    # row 5 of the cold chunk is the decode of position 5 (context 6) in blocks 4-6
    alone = kernel(
        q[16:17].contiguous(),
        k_cache,
        v_cache,
        torch.tensor([[4, 5, 6]], dtype=torch.int32),
        torch.tensor([6], dtype=torch.int32),
        HEAD_DIM**-0.5,
    )
    assert torch.equal(per_row[16], alone[0])
    assert meta.row_tables is not None and meta.row_tables[1].tolist()[:3] == [20, 22, 23]
