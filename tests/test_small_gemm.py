"""The C few-row matmuls against torch, their batch invariance, validation and fallbacks."""

from __future__ import annotations

import logging
import platform
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from servefleet.engine.cpu_isa import cpu_flags
from servefleet.engine.kernels import (
    TORCH_MATMUL,
    KernelUnavailableError,
    SmallRowsMatmul,
    _select_matmul,
    select_matmul,
    select_small_mm,
)
from servefleet.engine.kernels.cbuild import find_compiler
from servefleet.engine.kernels.cpu_small_gemm import (
    ISA_CAP_ENV,
    CpuSmallGemm,
    GemmThreading,
    IsaCap,
    KernelBuildError,
    load_cpu_small_gemm,
    small_linear,
    small_mm,
)

HAS_COMPILER = find_compiler() is not None
IS_X86 = platform.machine().lower() in ("x86_64", "amd64")
# The CPU kernels are part of the product: a machine that runs these tests needs `cc`.
needs_compiler = pytest.mark.usefixtures("require_compiler")


# (K, N): the SmolLM2 projections, plus sizes that are not multiples of the vector
# width or of the kernels' register tiles.
SHAPES = [(576, 960), (1536, 576), (17, 3), (100, 37), (129, 50), (33, 1), (1, 70), (300, 161)]


BUILDS: list[tuple[GemmThreading, IsaCap]] = [("openmp", "native"), ("single", "native")]
if IS_X86:  # instruction-set caps are x86 compiler flags
    BUILDS += [("openmp", "avx2"), ("openmp", "plain")]


@pytest.fixture(params=BUILDS, ids=["-".join(b) for b in BUILDS])
def gemm(request: pytest.FixtureRequest) -> CpuSmallGemm:
    if not HAS_COMPILER:
        pytest.fail("the CPU kernels need a C compiler (cc or gcc); install one")
    threading, isa = request.param
    kernel = load_cpu_small_gemm(threading, isa)
    assert kernel is not None, "a compiler is present, so the kernel must build"
    return kernel


@needs_compiler
@pytest.mark.skipif(not IS_X86, reason="instruction-set caps are x86 compiler flags")
def test_isa_caps_select_the_code_path() -> None:
    builds = {isa: load_cpu_small_gemm("openmp", isa) for isa in ("native", "avx2", "plain")}
    isas = {name: build.isa for name, build in builds.items() if build is not None}
    cpu_flags = _cpu_flags()
    expected_native = (
        "avx512f"
        if "avx512f" in cpu_flags
        else "avx2-fma"
        if {"avx2", "fma"} <= cpu_flags
        else "plain-c"
    )
    assert isas == {
        "native": expected_native,
        "avx2": "avx2-fma" if {"avx2", "fma"} <= cpu_flags else "plain-c",
        "plain": "plain-c",
    }


@needs_compiler
@pytest.mark.skipif(not IS_X86, reason="instruction-set caps are x86 compiler flags")
def test_the_engine_matmuls_take_their_isa_cap_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ISA_CAP_ENV, "plain")
    kernel = select_small_mm("cpu")
    assert kernel is not None and kernel.isa == "plain-c"
    monkeypatch.setenv(ISA_CAP_ENV, "sse2")
    with pytest.raises(KernelUnavailableError, match="SERVEFLEET_MATMUL_ISA='sse2': choose"):
        select_small_mm("cpu")
    monkeypatch.delenv(ISA_CAP_ENV)
    native = select_small_mm("cpu")
    assert native is not None and native.isa == load_cpu_small_gemm().isa


def _cpu_flags() -> set[str]:
    flags = cpu_flags()
    assert flags, "x86 Linux lists CPU flags in /proc/cpuinfo"
    return flags


def _inputs(m: int, k: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=generator)
    w = torch.randn(k, n, generator=generator) / k**0.5
    return x, w


def _assert_matches(out: torch.Tensor, expected: torch.Tensor) -> None:
    assert out.shape == expected.shape and out.dtype == torch.float32
    # Different summation orders: error grows like sqrt(K) * eps * |x||w|.
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize(("k", "n"), SHAPES)
@pytest.mark.parametrize("m", [1, 2, 3, 7, 8, 9, 16, 17, 24, 33, 40])
def test_mm_matches_torch(gemm: CpuSmallGemm, m: int, k: int, n: int) -> None:
    x, w = _inputs(m, k, n, seed=m * 1000 + k + n)
    _assert_matches(gemm.mm(x, w), torch.mm(x, w))


@pytest.mark.parametrize(("k", "n"), SHAPES)
@pytest.mark.parametrize("m", [1, 2, 5, 8, 11, 16, 25, 32, 40])
def test_linear_matches_torch(gemm: CpuSmallGemm, m: int, k: int, n: int) -> None:
    x, w = _inputs(m, k, n, seed=m * 1000 + k + n)
    w_out_in = w.t().contiguous()
    _assert_matches(gemm.linear(x, w_out_in), F.linear(x, w_out_in))


def test_lm_head_shape(gemm: CpuSmallGemm) -> None:
    x, w = _inputs(5, 576, 4099, seed=3)
    w_out_in = w.t().contiguous()
    _assert_matches(gemm.linear(x, w_out_in), F.linear(x, w_out_in))


def test_module_level_helpers_use_the_kernel() -> None:
    if not HAS_COMPILER:
        pytest.fail("the CPU kernels need a C compiler (cc or gcc); install one")
    x, w = _inputs(4, 40, 24, seed=9)
    _assert_matches(small_mm(x, w), torch.mm(x, w))
    _assert_matches(small_linear(x, w.t().contiguous()), x @ w)


@pytest.mark.parametrize(("k", "n"), [(576, 960), (100, 37), (1536, 50)])
def test_rows_are_bitwise_batch_invariant(gemm: CpuSmallGemm, k: int, n: int) -> None:
    """A row's bits must not depend on M, on its position, or on its neighbours."""
    x, w = _inputs(40, k, n, seed=k + n)
    w_out_in = w.t().contiguous()
    alone_mm = torch.cat([gemm.mm(x[i : i + 1].clone(), w) for i in range(40)])
    alone_lin = torch.cat([gemm.linear(x[i : i + 1].clone(), w_out_in) for i in range(40)])
    assert not torch.equal(alone_mm, torch.zeros_like(alone_mm))
    for m in (2, 5, 8, 9, 16, 23, 32, 40):
        for start in (0, 40 - m):
            rows = x[start : start + m].clone()
            assert torch.equal(gemm.mm(rows, w), alone_mm[start : start + m]), (m, start)
            assert torch.equal(gemm.linear(rows, w_out_in), alone_lin[start : start + m])
    # Other rows changing must not change row 0 either.
    mixed = torch.cat([x[:1], torch.randn(15, k) * 1e3])
    assert torch.equal(gemm.mm(mixed, w)[0], alone_mm[0])


def test_results_do_not_depend_on_thread_count(gemm: CpuSmallGemm) -> None:
    x, w = _inputs(16, 576, 960, seed=1)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = (gemm.mm(x, w), gemm.linear(x, w.t().contiguous()))
        torch.set_num_threads(max(2, before))
        many = (gemm.mm(x, w), gemm.linear(x, w.t().contiguous()))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one[0], many[0]) and torch.equal(one[1], many[1])


def test_empty_and_degenerate_sizes(gemm: CpuSmallGemm) -> None:
    w = torch.randn(8, 5)
    assert gemm.mm(torch.empty(0, 8), w).shape == (0, 5)
    zero_k = gemm.mm(torch.empty(3, 0), torch.empty(0, 5))
    assert torch.equal(zero_k, torch.zeros(3, 5))
    assert torch.equal(gemm.linear(torch.empty(3, 0), torch.empty(5, 0)), torch.zeros(3, 5))


def test_special_values_propagate(gemm: CpuSmallGemm) -> None:
    x, w = _inputs(3, 20, 18, seed=4)
    x[1, 7] = float("nan")
    x[2, 3] = float("inf")
    expected = torch.mm(x, w)
    out = gemm.mm(x, w)
    assert torch.equal(out.isnan(), expected.isnan()) and torch.equal(out.isinf(), expected.isinf())


BAD_INPUTS = {
    "x dtype": (lambda x, w: (x.double(), w), "x must be float32"),
    "w dtype": (lambda x, w: (x, w.to(torch.bfloat16)), "weight must be float32"),
    "x not contiguous": (lambda x, w: (x.t().contiguous().t(), w), "x must be contiguous"),
    "w not contiguous": (lambda x, w: (x, w.t().contiguous().t()), "weight must be contiguous"),
    "x 1-D": (lambda x, w: (x[0], w), "x must be 2-D"),
    "inner size": (lambda x, w: (x[:, :-1].contiguous(), w), "disagree on the inner size"),
}


@pytest.mark.parametrize("bad", list(BAD_INPUTS))
def test_bad_inputs_are_rejected(gemm: CpuSmallGemm, bad: str) -> None:
    change, message = BAD_INPUTS[bad]
    x, w = change(*_inputs(4, 12, 12, seed=0))
    with pytest.raises(ValueError, match=message):
        gemm.mm(x, w)
    with pytest.raises(ValueError, match=message):
        gemm.linear(x, w)


# --- building, fallbacks and selection --------------------------------------------


@pytest.fixture
def fresh_selection() -> Iterator[None]:
    load_cpu_small_gemm.cache_clear()
    _select_matmul.cache_clear()
    yield
    load_cpu_small_gemm.cache_clear()
    _select_matmul.cache_clear()


def _no_compiler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SERVEFLEET_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler-xyz")


def test_without_compiler_everything_falls_back_to_torch(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    fresh_selection: None,
) -> None:
    _no_compiler(tmp_path, monkeypatch)
    with caplog.at_level(logging.WARNING, logger="servefleet.engine.kernels"):
        assert load_cpu_small_gemm() is None
        assert select_small_mm("cpu") is None
        assert select_matmul("cpu") is TORCH_MATMUL
    assert "no C compiler found" in caplog.text
    with pytest.raises(KernelUnavailableError, match="could not be built"):
        select_matmul("cpu", prefer="cpu-c")
    with pytest.raises(KernelBuildError, match="could not be built"):
        small_mm(torch.ones(1, 2), torch.ones(2, 2))


def test_failing_compiler_falls_back_with_its_message(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    fresh_selection: None,
) -> None:
    fake_cc = tmp_path / "fakecc"
    fake_cc.write_text("#!/bin/sh\necho 'fake compiler says no' >&2\nexit 3\n")
    fake_cc.chmod(0o755)
    monkeypatch.setenv("SERVEFLEET_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(fake_cc))
    with caplog.at_level(logging.WARNING, logger="servefleet.engine.kernels"):
        assert load_cpu_small_gemm() is None
    assert "fake compiler says no" in caplog.text


@needs_compiler
def test_selection(fresh_selection: None, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="servefleet.engine.kernels"):
        chosen = select_matmul("cpu")
    assert isinstance(chosen, SmallRowsMatmul) and chosen.name == "cpu-c"
    assert "matmul for cpu: cpu-c" in caplog.text
    assert select_matmul("cpu", prefer="torch") is TORCH_MATMUL
    assert select_matmul("cuda") is TORCH_MATMUL  # no kernel for CUDA tensors: torch's
    assert select_small_mm("cuda") is None
    with pytest.raises(KernelUnavailableError, match="CPU tensors"):
        select_matmul("cuda", prefer="cpu-c")
    with pytest.raises(ValueError, match="unknown matmul backend"):
        select_matmul("cpu", prefer="mkl")


@needs_compiler
def test_small_rows_matmul_routes_by_rows_dtype_and_layout() -> None:
    loaded = load_cpu_small_gemm()
    assert loaded is not None
    kernel: CpuSmallGemm = loaded
    calls: list[str] = []

    class Spy:
        isa = kernel.isa

        def mm_unchecked(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            calls.append("mm")
            return kernel.mm(x, w)

        def linear_unchecked(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            calls.append("linear")
            return kernel.linear(x, w)

    matmul = SmallRowsMatmul(Spy(), max_rows=4, blocked=False)  # type: ignore[arg-type]
    x, w = _inputs(5, 16, 8, seed=2)
    bias = torch.randn(8)
    _assert_matches(matmul.mm(x[:4], w, bias), torch.addmm(bias, x[:4], w))
    assert calls == ["mm"]
    _assert_matches(matmul.mm(x, w), torch.mm(x, w))  # 5 rows > 4: torch
    _assert_matches(matmul.mm(x[:2].double(), w.double()).float(), torch.mm(x[:2], w))
    _assert_matches(matmul.mm(x[:2], w.t().contiguous().t()), torch.mm(x[:2], w))
    with pytest.raises(RuntimeError):  # shapes that do not fit: torch's own error
        matmul.mm(x[:2, :-1], w)
    assert calls == ["mm"]
    w_out_in = w.t().contiguous()
    _assert_matches(matmul.linear(x[:4], w_out_in), F.linear(x[:4], w_out_in))
    _assert_matches(matmul.linear(x, w_out_in), F.linear(x, w_out_in))
    assert calls == ["mm", "linear"]


def test_torch_matmul_is_what_the_model_did_before() -> None:
    x, w = _inputs(3, 6, 4, seed=5)
    bias = torch.randn(4)
    assert torch.equal(TORCH_MATMUL.mm(x, w), torch.mm(x, w))
    assert torch.equal(TORCH_MATMUL.mm(x, w, bias), torch.addmm(bias, x, w))
    assert torch.equal(TORCH_MATMUL.linear(x, w.t()), F.linear(x, w.t()))
