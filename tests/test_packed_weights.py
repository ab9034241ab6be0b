"""Packed 4/8-bit weights: GGUF blocks in, exactly the float32 weights' products out.

The packed matmul must return bitwise what the dense C matmul returns on the dequantized
weights (so packing never changes a token), for every build of the kernels, and the
block parsing must agree with the `gguf` package's own dequantization.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from servefleet.engine.kernels.cpu_small_gemm import CpuSmallGemm
from servefleet.engine.kernels.packed_weights import (
    BlockQuantized,
    PackedWeight,
    PackingError,
    concat_rows,
    from_gguf_blocks,
    pack,
    packed_from_tensor,
)
from tests.test_small_gemm import gemm  # noqa: F401  (the fixture: every kernel build)

FORMATS = ["Q4_0", "Q4_1", "Q8_0"]


def gguf_weight(
    type_name: str, rows: int, cols: int, seed: int
) -> tuple[np.ndarray, BlockQuantized]:
    """Random [rows, cols] weights quantized by `gguf` itself: (raw blocks, parsed)."""
    values = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * 0.05
    raw = quantize(values, GGMLQuantizationType[type_name])
    return raw, from_gguf_blocks(type_name, raw, rows, cols)


@pytest.mark.parametrize("type_name", FORMATS)
def test_block_parsing_matches_gguf_dequantize(type_name: str) -> None:
    raw, weight = gguf_weight(type_name, 37, 96, seed=1)
    reference = dequantize(raw, GGMLQuantizationType[type_name]).reshape(37, 96)
    assert weight.bits == (8 if type_name == "Q8_0" else 4)
    assert torch.equal(weight.dequantize(), torch.from_numpy(reference.astype(np.float32)))


def test_row_permutation_and_fusion_follow_the_rows() -> None:
    _, a = gguf_weight("Q4_1", 8, 64, seed=2)
    _, b = gguf_weight("Q4_1", 4, 64, seed=3)
    order = np.array([3, 1, 0, 2, 7, 6, 5, 4])
    assert torch.equal(a.permute_rows(order).dequantize(), a.dequantize()[order])
    fused = concat_rows([a, b])
    assert fused is not None
    assert torch.equal(fused.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    _, q8 = gguf_weight("Q8_0", 4, 64, seed=4)
    _, q4_0 = gguf_weight("Q4_0", 4, 64, seed=5)
    assert concat_rows([a, q8]) is None  # 4-bit and 8-bit cannot share one packed layout
    assert concat_rows([a, q4_0]) is not None  # Q4_0 carries its min (-8 × scale) too


def test_unpackable_inputs_are_rejected() -> None:
    with pytest.raises(PackingError, match="no packed form"):
        from_gguf_blocks("Q6_K", np.zeros(210, np.uint8), 1, 256)
    with pytest.raises(PackingError, match="multiple of 32"):
        from_gguf_blocks("Q8_0", np.zeros(34, np.uint8), 1, 48)
    _, weight = gguf_weight("Q8_0", 5, 64, seed=6)
    packed = pack(weight)
    assert packed_from_tensor(8, 64, 5, packed.data).n == 5
    with pytest.raises(PackingError, match="needs uint8"):
        packed_from_tensor(4, 64, 5, packed.data)  # 8-bit blocks read as 4-bit ones
    with pytest.raises(PackingError, match="needs uint8"):
        packed_from_tensor(8, 64, 17, packed.data)  # 17 columns need 2 groups


# M crosses the kernel's row tiles (1..8 read x in place, 9..16 one transposed tile,
# then a transposed tile plus a tail); N is not always a multiple of 16.
ROWS = [1, 3, 8, 9, 16, 17, 24, 33, 40]
SHAPES = [(64, 16), (96, 37), (576, 960), (1536, 50), (32, 1)]


@pytest.mark.parametrize("type_name", FORMATS)
@pytest.mark.parametrize(("k", "n"), SHAPES)
def test_packed_mm_is_bitwise_the_dense_mm(
    gemm: CpuSmallGemm,  # noqa: F811
    type_name: str,
    k: int,
    n: int,
) -> None:
    _, weight = gguf_weight(type_name, n, k, seed=k + n)
    packed = pack(weight)
    dense = weight.dequantize().t().contiguous()  # W [k, n]
    x_all = torch.randn(max(ROWS), k, generator=torch.Generator().manual_seed(n))
    for m in ROWS:
        x = x_all[:m].contiguous()
        out = gemm.packed_mm(x, packed)
        assert torch.equal(out, gemm.mm(x, dense)), (type_name, m)
    torch.testing.assert_close(out, x @ dense, rtol=1e-5, atol=2e-5)


def test_packed_rows_are_bitwise_batch_invariant(gemm: CpuSmallGemm) -> None:  # noqa: F811
    _, weight = gguf_weight("Q4_1", 100, 128, seed=7)
    packed = pack(weight)
    x = torch.randn(40, 128, generator=torch.Generator().manual_seed(8))
    together = gemm.packed_mm(x, packed)
    alone = torch.cat([gemm.packed_mm(x[i : i + 1].clone(), packed) for i in range(40)])
    assert torch.equal(together, alone)


def test_packed_mm_rejects_mismatched_inputs(gemm: CpuSmallGemm) -> None:  # noqa: F811
    _, weight = gguf_weight("Q4_1", 16, 64, seed=9)
    packed = pack(weight)
    with pytest.raises(ValueError, match=r"contiguous float32 \[M, 64\]"):
        gemm.packed_mm(torch.randn(2, 32), packed)
    with pytest.raises(ValueError, match="float32"):
        gemm.packed_mm(torch.randn(2, 64, dtype=torch.float64), packed)
    odd = PackedWeight(bits=4, k=48, n=16, data=packed.data)
    with pytest.raises(ValueError, match="rejected"):
        gemm.packed_mm(torch.randn(2, 48), odd)


def test_smollm2_decode_reads_packed_weights_with_the_same_bits(smollm2) -> None:  # type: ignore[no-untyped-def]
    """SmolLM2's GGUF is Q4_1 (projections) and Q8_0 (tied embeddings / lm_head)."""
    model = smollm2.model
    assert model.packed_summary()["tensors"] == 4 * model.config.num_layers + 1
    assert {w.bits for w in model.layers[0].packed.values()} == {4}
    assert model.packed_lm_head is not None and model.packed_lm_head.bits == 8
    matmul = model.matmul
    layer = model.layers[3]
    x = torch.randn(16, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    for name in ("qkv_weight", "gate_up_weight"):
        dense = getattr(layer, name)
        assert torch.equal(matmul.mm(x, dense, None, layer.packed[name]), matmul.mm(x, dense))
    with torch.inference_mode():
        packed_logits = model.compute_logits(x)
        head, model.packed_lm_head = model.packed_lm_head, None
        try:
            dense_logits = model.compute_logits(x)
        finally:
            model.packed_lm_head = head
    # The dense lm_head sums in its own (dot-product) order: same values to rounding.
    torch.testing.assert_close(packed_logits, dense_logits, rtol=1e-5, atol=1e-4)
    assert torch.equal(packed_logits.argmax(-1), dense_logits.argmax(-1))


def test_attach_packed_checks_names_and_shapes(smollm2) -> None:  # type: ignore[no-untyped-def]
    model = smollm2.model
    wrong = model.layers[0].packed["o_weight"]
    with pytest.raises(PackingError, match=r"layers\.0\.qkv_weight"):
        model.attach_packed({"layers.0.qkv_weight": wrong})
    with pytest.raises(KeyError, match="no float32 counterpart"):
        model.attach_packed({"layers.0.nonsense": wrong})


def test_packed_weights_and_fused_ops_follow_the_settings() -> None:
    from servefleet.engine.config import EngineConfig
    from servefleet.engine.process import load_for

    off = load_for(EngineConfig(model="smollm2-135m-instruct", packed_weights=False))
    assert off.model.packed_summary()["tensors"] == 0 and off.model.fused_ops is not None
    torch_only = load_for(EngineConfig(model="smollm2-135m-instruct", matmul="torch"))
    assert torch_only.model.packed_summary()["tensors"] == 0
    assert torch_only.model.fused_ops is None
