"""`--matmul-dtype bfloat16`: projection calls of 8+ rows in bfloat16 products.

What must hold: the C unpacking into bfloat16 rounds every weight as `Tensor.bfloat16()`
does (every kernel build); a prompt-sized call returns exactly oneDNN's bfloat16 product of
the rounded operands, widened; the packed kernel's bfloat16 products equal the exact
products of the rounded operands up to float32 summation, and a row's result does not
depend on the rows beside it; calls under `BF16_MIN_ROWS` rows are untouched; the engine
refuses the setting where it cannot apply, in one line. The quality gates are in
`test_quantize_quality.py`.
"""

from __future__ import annotations

import argparse

import pytest
import torch

from servefleet.cli import engine_cmd
from servefleet.engine.config import EngineConfig, EngineSettingsError
from servefleet.engine.kernels import (
    BF16_MIN_ROWS,
    KernelUnavailableError,
    SmallRowsMatmul,
    select_matmul,
    select_small_mm,
)
from servefleet.engine.kernels.cpu_small_gemm import CpuSmallGemm
from servefleet.engine.kernels.packed_weights import pack, unpack
from servefleet.engine.process import load_for
from tests.test_packed_weights import gguf_weight
from tests.test_small_gemm import gemm  # noqa: F401  (the fixture: every kernel build)

BF16 = torch.bfloat16
MAX_ROWS = 24


def _native_bf16_kernel() -> CpuSmallGemm:
    kernel = select_small_mm("cpu")
    assert kernel is not None
    if not kernel.bf16_products:
        pytest.skip("bfloat16 products need AVX512_BF16 hardware, which this CPU lacks")
    return kernel


@pytest.mark.parametrize(("type_name", "k", "n"), [("Q4_1", 64, 40), ("Q8_0", 96, 33)])
def test_bf16_unpack_rounds_like_torch(
    gemm: CpuSmallGemm,  # noqa: F811
    type_name: str,
    k: int,
    n: int,
) -> None:
    _, weight = gguf_weight(type_name, n, k, seed=n)
    packed = pack(weight)
    out = torch.full((k, n), float("nan"), dtype=BF16)
    assert gemm.unpack(packed, out=out) is out
    assert torch.equal(out, unpack(packed).bfloat16())
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        gemm.unpack(packed, out=torch.empty(k, n, dtype=torch.float16))


def _oracle(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    out = torch.mm(x.bfloat16(), w.bfloat16()).float()
    return out if bias is None else out.add_(bias)


def test_prompt_sized_calls_are_onednn_bfloat16(gemm: CpuSmallGemm) -> None:  # noqa: F811
    _, weight = gguf_weight("Q4_1", 48, 64, seed=3)
    packed = pack(weight)
    dense = unpack(packed)  # W [64, 48] float32
    bf16 = SmallRowsMatmul(gemm, MAX_ROWS, bf16_min_rows=BF16_MIN_ROWS)
    f32 = SmallRowsMatmul(gemm, MAX_ROWS)
    x = torch.randn(MAX_ROWS + 5, 64, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(48)
    for w in (packed, dense):
        assert torch.equal(bf16.mm(x, w), _oracle(x, dense))
        assert torch.equal(bf16.mm(x, w, bias), _oracle(x, dense, bias))
        few = x[: BF16_MIN_ROWS - 1].contiguous()
        assert torch.equal(bf16.mm(few, w), f32.mm(few, w))
        assert not torch.equal(bf16.mm(x, w), f32.mm(x, w))  # the rounding is real
    lm_head = dense.t().contiguous()
    assert torch.equal(bf16.linear(x, lm_head), f32.linear(x, lm_head))
    assert torch.equal(bf16.linear(x, packed), f32.linear(x, packed))


@pytest.mark.parametrize("type_name", ["Q4_1", "Q8_0", "Q5_K", "Q6_K"])
def test_packed_bf16_products_are_the_rounded_operands_products(type_name: str) -> None:
    kernel = _native_bf16_kernel()
    k, n = (512, 37) if type_name.endswith("_K") else (96, 37)
    _, weight = gguf_weight(type_name, n, k, seed=7)
    packed = pack(weight)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(2))
    exact = x.bfloat16().double() @ unpack(packed).bfloat16().double()
    alone = kernel.packed_mm(x[:1].contiguous(), packed, bf16=True)
    for m in (1, 7, 8, 9, 16, 17, 40):
        out = kernel.packed_mm(x[:m].contiguous(), packed, bf16=True)
        torch.testing.assert_close(out.double(), exact[:m], rtol=1e-5, atol=1e-5)
        assert torch.equal(out[:1], alone), m  # a row's bits do not depend on its step
    f32 = kernel.packed_mm(x, packed)
    assert not torch.equal(kernel.packed_mm(x, packed, bf16=True), f32)


def test_decode_sized_calls_use_the_bf16_products_from_eight_rows() -> None:
    kernel = _native_bf16_kernel()
    _, weight = gguf_weight("Q4_1", 40, 64, seed=5)
    packed = pack(weight)
    matmul = SmallRowsMatmul(kernel, MAX_ROWS, bf16_min_rows=BF16_MIN_ROWS)
    x = torch.randn(MAX_ROWS, 64, generator=torch.Generator().manual_seed(4))
    for m in (1, BF16_MIN_ROWS - 1, BF16_MIN_ROWS, MAX_ROWS):
        rows = x[:m].contiguous()
        bf16 = matmul.bf16_rows(m)
        assert bf16 == (m >= BF16_MIN_ROWS)
        expected = kernel.packed_mm(rows, packed, bf16=bf16)
        assert torch.equal(matmul.mm(rows, packed), expected)
        assert torch.equal(matmul.linear(rows, packed), expected)


def test_bfloat16_matmuls_need_the_c_matmuls() -> None:
    with pytest.raises(KernelUnavailableError, match="bfloat16 matmuls need the cpu-c"):
        select_matmul("cpu", prefer="torch", dtype=BF16)
    with pytest.raises(KernelUnavailableError, match="bfloat16 matmuls need the cpu-c"):
        select_matmul("cuda", dtype=BF16)


def test_engine_refuses_bfloat16_matmuls_of_a_bfloat16_model() -> None:
    config = EngineConfig(model="smollm2-135m-instruct", dtype="bfloat16", matmul_dtype="bfloat16")
    with pytest.raises(EngineSettingsError, match=r"--matmul-dtype bfloat16 .* runs in bfloat16"):
        load_for(config)
    with pytest.raises(ValueError, match="matmul_dtype"):
        EngineConfig(model="m", matmul_dtype="float16")  # type: ignore[arg-type]


def test_the_flag_reaches_the_config() -> None:
    parser = argparse.ArgumentParser()
    engine_cmd.add_arguments(parser)
    args = parser.parse_args(["--model", "m", "--matmul-dtype", "bfloat16"])
    assert EngineConfig(**engine_cmd.engine_settings(args)).matmul_dtype == "bfloat16"
    assert parser.parse_args(["--model", "m"]).matmul_dtype == "float32"
