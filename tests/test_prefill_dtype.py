"""`--prefill-dtype bfloat16`: prefill-sized projection calls in bfloat16, nothing else.

What must hold: the C unpacking into bfloat16 rounds every weight as `Tensor.bfloat16()`
does (every kernel build); a many-row call returns exactly oneDNN's bfloat16 product of
the rounded operands, widened; few-row (decode) calls and the lm_head are untouched; the
engine refuses the setting where it cannot apply, in one line. Its quality gate is in
`test_quantize_quality.py`.
"""

from __future__ import annotations

import argparse
from typing import get_args

import pytest
import torch

from servefleet.api.prefill_dtype import PREFILL_DTYPE_FLAG, PREFILL_DTYPES
from servefleet.cli import engine_cmd
from servefleet.engine.config import EngineConfig, EngineSettingsError
from servefleet.engine.kernels import KernelUnavailableError, SmallRowsMatmul, select_matmul
from servefleet.engine.kernels.cpu_small_gemm import CpuSmallGemm
from servefleet.engine.kernels.packed_weights import pack, unpack
from servefleet.engine.process import load_for
from tests.test_packed_weights import gguf_weight
from tests.test_small_gemm import gemm  # noqa: F401  (the fixture: every kernel build)

BF16 = torch.bfloat16
MAX_ROWS = 8


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


def test_many_row_calls_are_bfloat16_and_few_row_calls_float32(
    gemm: CpuSmallGemm,  # noqa: F811
) -> None:
    _, weight = gguf_weight("Q4_1", 48, 64, seed=3)
    packed = pack(weight)
    dense = unpack(packed)  # W [64, 48] float32
    bf16 = SmallRowsMatmul(gemm, MAX_ROWS, many_rows_dtype=BF16)
    f32 = SmallRowsMatmul(gemm, MAX_ROWS)
    x = torch.randn(MAX_ROWS + 5, 64, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(48)
    for w in (packed, dense):
        assert torch.equal(bf16.mm(x, w), _oracle(x, dense))
        assert torch.equal(bf16.mm(x, w, bias), _oracle(x, dense, bias))
        few = x[:MAX_ROWS].contiguous()
        assert torch.equal(bf16.mm(few, w), f32.mm(few, w))
        assert not torch.equal(bf16.mm(x, w), f32.mm(x, w))  # the rounding is real
    lm_head = dense.t().contiguous()
    assert torch.equal(bf16.linear(x, lm_head), f32.linear(x, lm_head))
    assert torch.equal(bf16.linear(x, packed), f32.linear(x, packed))


def test_bfloat16_prefill_needs_the_c_matmuls() -> None:
    with pytest.raises(KernelUnavailableError, match="bfloat16 prefill matmuls need the cpu-c"):
        select_matmul("cpu", prefer="torch", many_rows_dtype=BF16)
    with pytest.raises(KernelUnavailableError, match="bfloat16 prefill matmuls need the cpu-c"):
        select_matmul("cuda", many_rows_dtype=BF16)


def test_engine_refuses_bfloat16_prefill_of_a_bfloat16_model() -> None:
    config = EngineConfig(model="smollm2-135m-instruct", dtype="bfloat16", prefill_dtype="bfloat16")
    with pytest.raises(EngineSettingsError, match=r"--prefill-dtype bfloat16 .* runs in bfloat16"):
        load_for(config)
    with pytest.raises(ValueError, match="prefill_dtype"):
        EngineConfig(model="m", prefill_dtype="float16")  # type: ignore[arg-type]


def test_the_flag_is_spelled_once() -> None:
    parser = argparse.ArgumentParser()
    engine_cmd.add_arguments(parser)
    args = parser.parse_args(["--model", "m", PREFILL_DTYPE_FLAG, "bfloat16"])
    assert EngineConfig(**engine_cmd.engine_settings(args)).prefill_dtype == "bfloat16"
    assert parser.parse_args(["--model", "m"]).prefill_dtype == "float32"
    assert (engine_cmd.PREFILL_DTYPE_FLAG, engine_cmd.PREFILL_DTYPES) == (
        PREFILL_DTYPE_FLAG,
        PREFILL_DTYPES,
    )
    assert get_args(EngineConfig.model_fields["prefill_dtype"].annotation) == PREFILL_DTYPES
