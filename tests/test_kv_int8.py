"""int8 KV cache: the quantization bound, the C kernel and the PyTorch paths that read it,
and the capacity it buys (per-token float32 scales inline, see engine/kv_quant.py)."""

from __future__ import annotations

import pytest
import torch

from servefleet.engine.attention import (
    AttentionMetadata,
    PagedAttention,
    PrefillSpan,
    prefill_attention,
    torch_paged_decode,
)
from servefleet.engine.kernels.cpu_paged_decode import Threading, load_cpu_paged_decode
from servefleet.engine.kv_quant import (
    SCALE_BYTES,
    dequantize_rows,
    quantize_rows,
    write_rows,
)
from servefleet.engine.model.config import ModelConfig
from servefleet.engine.model.kv_layout import allocate_kv_cache, kv_bytes_per_block
from tests.test_kernels import THREADINGS, Case, make_case

needs_compiler = pytest.mark.usefixtures("require_compiler")


def quantized(case: Case) -> Case:
    return case._replace(k_cache=quantize_rows(case.k_cache), v_cache=quantize_rows(case.v_cache))


def test_quantize_round_trip_is_within_half_a_step() -> None:
    gen = torch.Generator().manual_seed(0)
    magnitudes = torch.logspace(-6, 4, 40).view(40, 1, 1)  # tiny to large rows
    x = torch.randn(40, 3, 64, generator=gen) * magnitudes
    rows = quantize_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == (40, 3, 64 + SCALE_BYTES)
    back = dequantize_rows(rows)
    step = x.abs().amax(dim=-1, keepdim=True) / 127
    err = (back - x).abs()
    assert bool((err <= step / 2 * (1 + 1e-5) + 1e-30).all()), float((err / step).max())
    # the largest magnitude of each row is representable exactly (up to float rounding)
    peak = x.abs().argmax(dim=-1, keepdim=True)
    torch.testing.assert_close(back.gather(-1, peak), x.gather(-1, peak), rtol=1e-6, atol=0)
    # a row in int8 never exceeds +-127 (symmetric, no -128)
    assert int(rows[..., :64].abs().max()) == 127


def test_zero_rows_stay_zero() -> None:
    rows = quantize_rows(torch.zeros(2, 2, 32))
    assert torch.equal(dequantize_rows(rows), torch.zeros(2, 2, 32))


def test_write_rows_stores_each_slot_with_its_scale() -> None:
    cache = torch.zeros(4, 8, 2, 16 + SCALE_BYTES, dtype=torch.int8)
    x = torch.randn(3, 2, 16)
    slots = torch.tensor([5, 17, 30])
    write_rows(cache, slots, x)
    flat = dequantize_rows(cache.view(-1, 2, 16 + SCALE_BYTES))
    torch.testing.assert_close(flat[slots], dequantize_rows(quantize_rows(x)))
    assert int(flat.abs().sum(dim=(1, 2)).ne(0).sum()) == 3  # nothing else written


@needs_compiler
@pytest.mark.parametrize("threading", THREADINGS)
@pytest.mark.parametrize("head_dim", [32, 64, 80])
def test_cpu_kernel_reads_int8_rows(threading: Threading, head_dim: int) -> None:
    kernel = load_cpu_paged_decode(threading)
    assert kernel is not None
    case = quantized(
        make_case(
            seed=head_dim, num_heads=9, num_kv_heads=3, head_dim=head_dim, block_size=16,
            context_lens=[1, 16, 17, 70, 5, 33],
        )
    )  # fmt: skip
    scale = head_dim**-0.5
    out = kernel(*case, scale)
    # the same int8 rows, dequantized by PyTorch: only summation order differs
    wide = case._replace(
        k_cache=dequantize_rows(case.k_cache), v_cache=dequantize_rows(case.v_cache)
    )
    torch.testing.assert_close(out, torch_paged_decode(*wide, scale), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch_paged_decode(*case, scale), out, atol=1e-5, rtol=1e-5)


def test_int8_decode_stays_close_to_float32() -> None:
    case = make_case(
        seed=3, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, context_lens=[40, 7]
    )
    scale = 64**-0.5
    exact = torch_paged_decode(*case, scale)
    approx = torch_paged_decode(*quantized(case), scale)
    assert float((approx - exact).abs().max()) < 0.02


def test_prefill_over_int8_cache_matches_dequantized_floats() -> None:
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(5, 4, 32, generator=gen)
    k = torch.randn(12, 2, 32, generator=gen)
    v = torch.randn(12, 2, 32, generator=gen)
    table = torch.tensor([2, 0])
    slots = torch.cat((table[0] * 8 + torch.arange(8), table[1] * 8 + torch.arange(4)))
    span = PrefillSpan(start=0, end=5, num_cached=7, block_table=table)
    shape = (3, 8, 2, 32 + SCALE_BYTES)
    int8 = (torch.zeros(shape, dtype=torch.int8), torch.zeros(shape, dtype=torch.int8))
    wide = (torch.zeros(3, 8, 2, 32), torch.zeros(3, 8, 2, 32))
    for cache, wide_cache, x in ((int8[0], wide[0], k), (int8[1], wide[1], v)):
        write_rows(cache, slots, x)
        write_rows(wide_cache, slots, dequantize_rows(quantize_rows(x)))
    out8 = prefill_attention(q, *int8, span, 32**-0.5)
    out32 = prefill_attention(q, *wide, span, 32**-0.5)
    torch.testing.assert_close(out8, out32)


def test_paged_attention_writes_int8_then_attends() -> None:
    """The layer's entry point: quantize on write, the decode kernel reads it back."""
    k_cache = torch.zeros(2, 4, 1, 16 + SCALE_BYTES, dtype=torch.int8)
    v_cache = torch.zeros_like(k_cache)
    k, v, q = torch.randn(1, 1, 16), torch.randn(1, 1, 16), torch.randn(1, 2, 16)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([5]), block_size=4, num_decodes=1,
        decode_block_tables=torch.tensor([[1]], dtype=torch.int32),
        decode_context_lens=torch.tensor([2], dtype=torch.int32),
    )  # fmt: skip
    out = PagedAttention()(q, k, v, k_cache, v_cache, meta, 0.25)
    # token 0 of block 1 is all zeros (scale 0): the output mixes v and a zero row
    stored_k, stored_v = dequantize_rows(quantize_rows(k))[0], dequantize_rows(quantize_rows(v))[0]
    weights = torch.softmax(torch.stack([torch.zeros(2), (q[0] @ stored_k[0]) * 0.25]), dim=0)
    expected = weights[1, :, None] * stored_v
    torch.testing.assert_close(out[0], expected, atol=1e-6, rtol=1e-5)


SMOLLM2_SHAPE = ModelConfig(
    architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
    num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=2048,
)  # fmt: skip


def test_capacity_per_byte_is_3_76x_float32_and_1_88x_float16() -> None:
    per_block = {
        d: kv_bytes_per_block(SMOLLM2_SHAPE, 16, d)
        for d in (torch.float32, torch.float16, torch.int8)
    }
    assert per_block[torch.int8] == 2 * 30 * 16 * 3 * (64 + 4)
    gib = 1 << 30
    blocks = {d: gib // b for d, b in per_block.items()}
    assert blocks[torch.int8] / blocks[torch.float32] == pytest.approx(256 / 68, rel=1e-3)  # 3.76x
    assert blocks[torch.int8] / blocks[torch.float16] == pytest.approx(128 / 68, rel=1e-3)  # 1.88x
    caches = allocate_kv_cache(SMOLLM2_SHAPE, 3, 16, torch.int8, "cpu")
    assert caches[0][0].shape == (3, 16, 3, 68) and caches[0][0].dtype == torch.int8
    total = caches[0][0].untyped_storage().nbytes()
    assert total == 3 * per_block[torch.int8]
