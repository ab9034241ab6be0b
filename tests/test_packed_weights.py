"""Packed weights: GGUF blocks in, exactly the float32 weights' products out.

The packed matmul must return bitwise what the dense C matmul returns on the dequantized
weights (so packing never changes a token), for every build of the kernels and every
block format (legacy Q4_0 … Q8_0 and the K-quants Q4_K, Q5_K, Q6_K), and the block
parsing must agree bitwise with the `gguf` package's own dequantization.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from servefleet.bench.quant_models import random_blocks
from servefleet.engine.kernels.cpu_small_gemm import CpuSmallGemm
from servefleet.engine.kernels.packed_weights import (
    BlockQuantized,
    PackedFormat,
    PackedWeight,
    PackingError,
    concat_rows,
    pack,
    packed_from_tensors,
    unpack,
)
from servefleet.engine.model.gguf_blocks import GGUF_PACKED_TYPES, from_gguf_blocks
from tests.test_small_gemm import gemm  # noqa: F401  (the fixture: every kernel build)

LEGACY = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]
K_QUANTS = ["Q4_K", "Q5_K", "Q6_K"]
FORMAT_OF = {
    "Q4_0": PackedFormat.Q4, "Q4_1": PackedFormat.Q4, "Q4_K": PackedFormat.Q4,
    "Q5_0": PackedFormat.Q5, "Q5_1": PackedFormat.Q5, "Q5_K": PackedFormat.Q5,
    "Q6_K": PackedFormat.Q6, "Q8_0": PackedFormat.Q8,
}  # fmt: skip


def gguf_weight(
    type_name: str, rows: int, cols: int, seed: int
) -> tuple[np.ndarray, BlockQuantized]:
    """A random [rows, cols] weight in a GGUF block type: (raw blocks, parsed)."""
    raw = random_blocks(type_name, rows, cols, np.random.default_rng(seed))
    return raw, from_gguf_blocks(type_name, raw, rows, cols)


def reference(raw: np.ndarray, type_name: str, rows: int, cols: int) -> torch.Tensor:
    values = dequantize(raw, GGMLQuantizationType[type_name]).reshape(rows, cols)
    return torch.from_numpy(values.astype(np.float32))


def test_every_packable_type_is_covered() -> None:
    assert set(LEGACY + K_QUANTS) == GGUF_PACKED_TYPES == set(FORMAT_OF)


@pytest.mark.parametrize("type_name", LEGACY + K_QUANTS)
def test_block_parsing_and_packing_match_gguf_dequantize(type_name: str) -> None:
    raw, weight = gguf_weight(type_name, 37, 512, seed=1)
    expected = reference(raw, type_name, 37, 512)
    assert weight.format == FORMAT_OF[type_name]
    assert torch.equal(weight.dequantize(), expected)
    packed = pack(weight)
    assert torch.equal(unpack(packed), expected.t().contiguous())
    assert packed.format_names == {weight.format.name}


def test_row_permutation_and_fusion_follow_the_rows() -> None:
    _, a = gguf_weight("Q4_K", 8, 256, seed=2)
    _, b = gguf_weight("Q4_1", 4, 256, seed=3)
    order = np.array([3, 1, 0, 2, 7, 6, 5, 4])
    assert torch.equal(a.permute_rows(order).dequantize(), a.dequantize()[order])
    fused = concat_rows([a, b])  # Q4_K and Q4_1 share the Q4 format
    assert fused is not None
    assert torch.equal(fused.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    _, q6 = gguf_weight("Q6_K", 4, 256, seed=4)
    assert concat_rows([a, q6]) is None  # different formats: only `pack` joins them


def test_formats_may_change_at_group_boundaries() -> None:
    """Q4_K_M stores v (and some ffn_down) as Q6_K beside Q4_K q and k: one fused weight,
    each 16-column group in its own format."""
    parts = [gguf_weight(t, rows, 256, seed=i)[1] for i, (t, rows) in enumerate(
        [("Q4_K", 32), ("Q4_K", 16), ("Q6_K", 16), ("Q8_0", 16), ("Q5_K", 5)]
    )]  # fmt: skip
    packed = pack(parts)
    assert (packed.k, packed.n) == (256, 85)
    assert packed.formats.tolist() == [0, 0, 0, 3, 1, 2]
    expected = torch.cat([p.dequantize() for p in parts]).t()
    assert torch.equal(unpack(packed), expected)
    with pytest.raises(PackingError, match="inside a group"):
        pack([parts[4], parts[2]])  # 5 Q5 rows, then Q6: a group would hold both


def test_unpackable_inputs_are_rejected() -> None:
    with pytest.raises(PackingError, match="no packed form"):
        from_gguf_blocks("Q2_K", np.zeros(84, np.uint8), 1, 256)
    with pytest.raises(PackingError, match="multiple of 256"):
        from_gguf_blocks("Q4_K", np.zeros(144, np.uint8), 1, 128)
    _, weight = gguf_weight("Q8_0", 5, 64, seed=6)
    packed = pack(weight)
    assert packed_from_tensors(64, 5, packed.data, packed.formats).n == 5
    as_q4 = torch.zeros_like(packed.formats)  # 8-bit blocks read as 4-bit ones
    with pytest.raises(PackingError, match="bytes"):
        packed_from_tensors(64, 5, packed.data, as_q4)
    with pytest.raises(PackingError, match="group formats"):
        packed_from_tensors(64, 17, packed.data, packed.formats)  # 17 columns: 2 groups
    with pytest.raises(PackingError, match="group formats"):
        packed_from_tensors(64, 5, packed.data, torch.tensor([9], dtype=torch.uint8))


# M crosses the kernel's row tiles (1..8 read x in place, 9..16 one transposed tile,
# then a transposed tile plus a tail); N is not always a multiple of 16.
ROWS = [1, 3, 8, 9, 16, 17, 24, 33, 40]
CASES = [(t, k, n) for t in LEGACY for k, n in [(64, 16), (96, 37), (576, 960), (32, 1)]]
CASES += [(t, k, n) for t in K_QUANTS for k, n in [(256, 16), (512, 37), (1536, 50), (256, 1)]]


@pytest.mark.parametrize(("type_name", "k", "n"), CASES)
def test_packed_mm_is_bitwise_the_dense_mm(
    gemm: CpuSmallGemm,  # noqa: F811
    type_name: str,
    k: int,
    n: int,
) -> None:
    _, weight = gguf_weight(type_name, n, k, seed=k + n)
    packed = pack(weight)
    dense = weight.dequantize().t().contiguous()  # W [k, n]
    assert torch.equal(gemm.unpack(packed), dense)
    x_all = torch.randn(max(ROWS), k, generator=torch.Generator().manual_seed(n))
    for m in ROWS:
        x = x_all[:m].contiguous()
        out = gemm.packed_mm(x, packed)
        assert torch.equal(out, gemm.mm(x, dense)), (type_name, m)
    torch.testing.assert_close(out, x @ dense, rtol=1e-4, atol=1e-4)


def test_mixed_format_weight_multiplies_bitwise(gemm: CpuSmallGemm) -> None:  # noqa: F811
    parts = [gguf_weight(t, 48, 512, seed=i)[1] for i, t in enumerate(["Q4_K", "Q6_K", "Q5_K"])]
    parts.append(gguf_weight("Q8_0", 21, 512, seed=9)[1])
    packed = pack(parts)
    dense = torch.cat([p.dequantize() for p in parts]).t().contiguous()
    assert torch.equal(gemm.unpack(packed), dense)
    x = torch.randn(20, 512, generator=torch.Generator().manual_seed(3))
    for m in (1, 7, 20):
        assert torch.equal(gemm.packed_mm(x[:m].contiguous(), packed), gemm.mm(x[:m], dense))


def test_packed_rows_are_bitwise_batch_invariant(gemm: CpuSmallGemm) -> None:  # noqa: F811
    _, weight = gguf_weight("Q4_K", 100, 256, seed=7)
    packed = pack(weight)
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(8))
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
    odd = PackedWeight(48, 16, packed.data, packed.formats, packed.offsets)
    with pytest.raises(ValueError, match="rejected"):
        gemm.packed_mm(torch.randn(2, 48), odd)
    with pytest.raises(ValueError, match="rejected"):
        gemm.unpack(odd)


def test_smollm2_holds_only_packed_projections_with_the_same_bits(smollm2) -> None:  # type: ignore[no-untyped-def]
    """SmolLM2's GGUF is Q4_1 (projections) and Q8_0 (tied embeddings / lm_head)."""
    model = smollm2.model
    assert model.packed_summary()["tensors"] == 4 * model.config.num_layers + 1
    assert {f for w in model.layers[0].packed.values() for f in w.format_names} == {"Q4"}
    assert model.packed_lm_head is not None and model.packed_lm_head.format_names == {"Q8"}
    # No float32 copy of a packed projection: only the embedding and the norms are float.
    layer = model.layers[3]
    assert layer.qkv_weight is None and layer.down_weight is None
    floats = {n for n, _ in model.named_parameters()}
    assert all(n == "embed_tokens" or "norm" in n for n in floats), floats
    assert model.weight_bytes()["float"] == sum(p.nbytes for p in model.parameters())
    matmul = model.matmul
    kernel = matmul.kernel
    for rows in (16, 80):  # the packed kernel, and MKL on the unpacked weight (prefill)
        x = torch.randn(rows, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
        for name in ("qkv_weight", "gate_up_weight"):
            packed = layer.packed[name]
            dense = kernel.unpack(packed)
            assert torch.equal(matmul.mm(x, packed), matmul.mm(x, dense)), (name, rows)
    with torch.inference_mode():
        packed_logits = model.compute_logits(x[:16])
        head, model.packed_lm_head = model.packed_lm_head, None
        try:
            dense_logits = model.compute_logits(x[:16])
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
    with pytest.raises(KeyError, match="no projection"):
        model.attach_packed({"layers.0.nonsense": wrong})


def test_packed_weights_and_fused_ops_follow_the_settings(smollm2) -> None:  # type: ignore[no-untyped-def]
    from servefleet.engine.config import EngineConfig
    from servefleet.engine.process import load_for

    off = load_for(EngineConfig(model="smollm2-135m-instruct", packed_weights=False))
    assert off.model.packed_summary()["tensors"] == 0 and off.model.fused_ops is not None
    # Turned off, the projections are the packed ones' exact float32 values.
    layer, packed_layer = off.model.layers[2], smollm2.model.layers[2]
    kernel = smollm2.model.matmul.kernel
    assert torch.equal(layer.gate_up_weight, kernel.unpack(packed_layer.packed["gate_up_weight"]))
    torch_only = load_for(EngineConfig(model="smollm2-135m-instruct", matmul="torch"))
    assert torch_only.model.packed_summary()["tensors"] == 0
    assert torch_only.model.fused_ops is None
