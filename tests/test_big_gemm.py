"""The blocked many-row matmuls (`sf_big_gemm.h`): bitwise the few-row kernels' rows.

Every output element is one accumulator summed over k in ascending order in both kernels,
so a row computed in a call of 1000 rows must equal, bit for bit, the same row computed
alone or in a call of at most 64 rows: for every build (AVX-512 where the CPU has it,
AVX2, plain C; OpenMP and single-threaded), every packed format, and dense weights in
both layouts. `SmallRowsMatmul(invariant=True)` must route every float32 call so.
"""

from __future__ import annotations

import pytest
import torch

from servefleet.engine.kernels import SMALL_MM_MAX_ROWS, SmallRowsMatmul
from servefleet.engine.kernels.cpu_small_gemm import CpuSmallGemm, load_cpu_small_gemm
from servefleet.engine.kernels.matmul import DENSE_BLOCKED_ROWS
from servefleet.engine.kernels.packed_weights import pack, unpack
from tests.test_packed_weights import K_QUANTS, LEGACY, gguf_weight
from tests.test_small_gemm import gemm  # noqa: F401  (the fixture: every kernel build)

pytestmark = pytest.mark.usefixtures("require_compiler")

ROWS = [1, 63, 64, 65, 100, 257, 1000]
# Odd K and N (dense), K past one 256-k panel, N past one 64-column strip and not a
# multiple of any vector width.
DENSE_SHAPES = [(17, 3), (129, 50), (300, 161)]
PACKED_SHAPES = {"legacy": [(96, 37), (288, 70)], "k": [(512, 50)]}


def _pieces(m: int) -> list[tuple[int, int]]:
    """[start, stop) of calls of 1 row, then of up to 64 rows, covering m rows."""
    cuts, start, size = [], 0, 1
    while start < m:
        stop = min(m, start + size)
        cuts.append((start, stop))
        start, size = stop, min(SMALL_MM_MAX_ROWS, size * 2 + 5)
    return cuts


def _x(m: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed))


def _assert_rows_match(big: torch.Tensor, small_call, x: torch.Tensor) -> None:  # type: ignore[no-untyped-def]
    small = torch.cat([small_call(x[a:b].contiguous()) for a, b in _pieces(x.shape[0])])
    assert torch.equal(big, small), (x.shape, (big != small).sum().item())


@pytest.mark.parametrize(("k", "n"), DENSE_SHAPES)
def test_dense_rows_are_the_few_row_kernels_bits(gemm: CpuSmallGemm, k: int, n: int) -> None:  # noqa: F811
    w = torch.randn(k, n, generator=torch.Generator().manual_seed(k)) / k**0.5
    w_out_in = w.t().contiguous()
    x_all = _x(max(ROWS), k, seed=n)
    for m in ROWS:
        x = x_all[:m].contiguous()
        _assert_rows_match(gemm.mm(x, w, blocked=True), lambda r: gemm.mm(r, w), x)
        big = gemm.linear(x, w_out_in, blocked=True)
        _assert_rows_match(big, lambda r: gemm.linear(r, w_out_in), x)
    torch.testing.assert_close(gemm.mm(x, w, blocked=True), x @ w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("type_name", LEGACY + K_QUANTS)
def test_packed_rows_are_the_few_row_kernels_bits(gemm: CpuSmallGemm, type_name: str) -> None:  # noqa: F811
    shapes = PACKED_SHAPES["k" if type_name in K_QUANTS else "legacy"]
    for k, n in shapes:
        packed = pack(gguf_weight(type_name, n, k, seed=k + n)[1])
        dense = unpack(packed)
        x_all = _x(max(ROWS), k, seed=n)
        for m in ROWS:
            x = x_all[:m].contiguous()
            big = gemm.packed_mm(x, packed, blocked=True)
            _assert_rows_match(big, lambda r, w=packed: gemm.packed_mm(r, w), x)
            assert torch.equal(big, gemm.mm(x, dense, blocked=True)), (type_name, m)


def test_mixed_formats_and_threads_change_no_bit() -> None:
    kernel = load_cpu_small_gemm()
    assert kernel is not None
    parts = [gguf_weight(t, 48, 256, seed=i)[1] for i, t in enumerate(["Q4_K", "Q6_K", "Q8_0"])]
    packed = pack(parts)
    x = _x(300, 256, seed=5)
    one = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = kernel.packed_mm(x, packed, blocked=True)
        torch.set_num_threads(3)
        assert torch.equal(kernel.packed_mm(x, packed, blocked=True), alone)
    finally:
        torch.set_num_threads(one)
    _assert_rows_match(alone, lambda r: kernel.packed_mm(r, packed), x)


def test_blocked_kernels_refuse_what_they_cannot_read() -> None:
    kernel = load_cpu_small_gemm()
    assert kernel is not None
    packed = pack(gguf_weight("Q4_1", 16, 64, seed=9)[1])
    with pytest.raises(ValueError, match="float32 only"):
        kernel.packed_mm(_x(70, 64, seed=1), packed, bf16=True, blocked=True)
    with pytest.raises(ValueError, match="contiguous float32"):
        kernel.packed_mm(_x(70, 32, seed=1), packed, blocked=True)
    with pytest.raises(ValueError, match="inner size"):
        kernel.mm(_x(70, 5, seed=1), torch.randn(6, 3), blocked=True)


def test_invariant_matmul_rows_do_not_depend_on_the_call() -> None:
    kernel = load_cpu_small_gemm()
    assert kernel is not None
    matmul = SmallRowsMatmul(kernel, SMALL_MM_MAX_ROWS, invariant=True)
    packed = pack(gguf_weight("Q4_1", 70, 96, seed=3)[1])
    w = torch.randn(96, 70)
    w_out_in = w.t().contiguous()
    bias = torch.randn(70)
    x = _x(300, 96, seed=4)
    for big, call in [
        (matmul.mm(x, packed, bias), lambda r: matmul.mm(r, packed, bias)),
        (matmul.mm(x, w, bias), lambda r: matmul.mm(r, w, bias)),
        (matmul.linear(x, w_out_in), lambda r: matmul.linear(r, w_out_in)),
        (matmul.linear(x, packed), lambda r: matmul.linear(r, packed)),
    ]:
        _assert_rows_match(big, call, x)
    with pytest.raises(ValueError, match="bf16_min_rows must be None"):
        SmallRowsMatmul(kernel, SMALL_MM_MAX_ROWS, bf16_min_rows=8, invariant=True)


def test_default_routing_blocks_packed_calls_and_dense_ones_up_to_the_crossover() -> None:
    kernel = load_cpu_small_gemm()
    assert kernel is not None
    default = SmallRowsMatmul(kernel, SMALL_MM_MAX_ROWS)
    mkl = SmallRowsMatmul(kernel, SMALL_MM_MAX_ROWS, blocked=False)
    packed = pack(gguf_weight("Q8_0", 50, 128, seed=6)[1])
    dense = unpack(packed)
    x = _x(200, 128, seed=7)
    many = _x(DENSE_BLOCKED_ROWS + 1, 128, seed=8)
    assert torch.equal(default.mm(many, dense), torch.mm(many, dense))  # MKL above it
    assert torch.equal(default.mm(many, packed), kernel.packed_mm(many, packed, blocked=True))
    assert torch.equal(default.mm(x, packed), kernel.packed_mm(x, packed, blocked=True))
    assert torch.equal(default.mm(x, dense), default.mm(x, packed))  # packing changes no bit
    assert torch.equal(default.linear(x, packed), default.mm(x, packed))
    assert torch.equal(mkl.mm(x, packed), torch.mm(x, dense))
    lm_head = dense.t().contiguous()
    assert torch.equal(default.linear(x, lm_head), torch.nn.functional.linear(x, lm_head))
