"""Decode kernels (C on CPU, Triton under the interpreter) against `torch_paged_decode`.

bf16 caches are checked against the reference run on the same caches widened to
float32: the kernels widen too and accumulate in float32, so that is the exact
answer, and it keeps bf16 matmuls (which fault on some CPUs) out of the tests.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from servefleet.engine.attention import DecodeKernel, torch_paged_decode
from servefleet.engine.kernels import (
    KernelUnavailableError,
    _select,
    cbuild,
    select_decode_kernel,
)
from servefleet.engine.kernels import cpu_paged_decode as cpu_module
from servefleet.engine.kernels.cpu_paged_decode import (
    OPTIMISE_FLAGS,
    THREADING_FLAGS,
    CpuPagedDecode,
    Threading,
    find_compiler,
    load_cpu_paged_decode,
)
from servefleet.engine.kernels.triton_paged_decode import triton_paged_decode

HAS_COMPILER = find_compiler() is not None
# The CPU kernels are part of the product: a machine that runs these tests needs `cc`.
needs_compiler = pytest.mark.usefixtures("require_compiler")


THREADINGS: list[Threading] = list(THREADING_FLAGS)


class Case(NamedTuple):
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor


def make_case(
    *,
    seed: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    context_lens: list[int],
    cache_dtype: torch.dtype = torch.float32,
    q_dtype: torch.dtype = torch.float32,
    spare_blocks: int = 5,
    share_prefix_blocks: int = 0,
    q_scale: float = 1.0,
) -> Case:
    """Random q/caches and block tables scattered over a pool; optionally the first
    `share_prefix_blocks` blocks of every sequence are the same physical blocks
    (prefix caching), so one block is read by several sequences."""
    gen = torch.Generator().manual_seed(seed)
    num_seqs = len(context_lens)
    blocks_per_seq = [-(-n // block_size) for n in context_lens]
    max_blocks = max(blocks_per_seq) + 1  # one unused column: padding must be ignored
    num_blocks = sum(blocks_per_seq) + spare_blocks
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    shared = pool[:share_prefix_blocks]
    rest = iter(pool[share_prefix_blocks:])
    tables = torch.full((num_seqs, max_blocks), -1, dtype=torch.int32)
    for s, n in enumerate(blocks_per_seq):
        for b in range(n):
            tables[s, b] = shared[b] if b < len(shared) else next(rest)
    # padding entries point at real blocks too, so an over-read would change the result
    tables[tables < 0] = int(pool[-1])
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(cache_dtype)
    v_cache = torch.randn(shape, generator=gen).to(cache_dtype)
    q = (torch.randn(num_seqs, num_heads, head_dim, generator=gen) * q_scale).to(q_dtype)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    return Case(q, k_cache, v_cache, tables, lens)


def reference(case: Case, scale: float) -> torch.Tensor:
    q, k_cache, v_cache, tables, lens = case
    return torch_paged_decode(q.float(), k_cache.float(), v_cache.float(), tables, lens, scale)


def check_against_reference(kernel: DecodeKernel, case: Case) -> None:
    q = case[0]
    scale = q.shape[-1] ** -0.5
    out = kernel(*case, scale)
    assert out.shape == q.shape
    assert out.dtype == q.dtype
    expected = reference(case, scale)
    tol = 1e-5 if q.dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


@pytest.fixture(params=THREADINGS)
def cpu_kernel(request: pytest.FixtureRequest) -> CpuPagedDecode:
    if not HAS_COMPILER:
        pytest.fail("the CPU kernels need a C compiler (cc or gcc); install one")
    kernel = load_cpu_paged_decode(request.param)
    assert kernel is not None, "a compiler is present, so the kernel must build"
    return kernel


CONTEXTS = {
    8: [1, 8, 9, 23, 40, 3],
    16: [1, 16, 17, 70, 5, 33],
    32: [1, 32, 31, 97, 64, 2],
}


@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_kernel_matches_reference(
    cpu_kernel: CpuPagedDecode, group: int, block_size: int, cache_dtype: torch.dtype
) -> None:
    case = make_case(
        seed=group * 100 + block_size,
        num_heads=2 * group,
        num_kv_heads=2,
        head_dim=64,
        block_size=block_size,
        context_lens=CONTEXTS[block_size],
        cache_dtype=cache_dtype,
        share_prefix_blocks=1,
    )
    check_against_reference(cpu_kernel, case)


@pytest.mark.parametrize("head_dim", [32, 80, 128])
def test_cpu_kernel_head_dims(cpu_kernel: CpuPagedDecode, head_dim: int) -> None:
    """64 and 128 take specialised code paths, other sizes the generic one."""
    case = make_case(
        seed=head_dim,
        num_heads=6,
        num_kv_heads=3,
        head_dim=head_dim,
        block_size=16,
        context_lens=[5, 16, 50],
    )
    check_against_reference(cpu_kernel, case)


def test_cpu_kernel_long_context_large_blocks_and_sharp_scores(
    cpu_kernel: CpuPagedDecode,
) -> None:
    """Blocks larger than the kernel's 64-token chunk, a long context, and logits in the
    hundreds: the online softmax must rescale correctly and stay finite."""
    case = make_case(
        seed=7,
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        block_size=128,
        context_lens=[1000, 129, 1],
        q_scale=30.0,
    )
    check_against_reference(cpu_kernel, case)


def test_cpu_kernel_all_sequences_share_blocks(cpu_kernel: CpuPagedDecode) -> None:
    """Identical prefixes and lengths give identical rows when q is the same."""
    q, k_cache, v_cache, tables, lens = make_case(
        seed=3,
        num_heads=3,
        num_kv_heads=1,
        head_dim=64,
        block_size=16,
        context_lens=[40, 40, 40],
        share_prefix_blocks=3,
    )
    q[1:] = q[0]
    case = Case(q, k_cache, v_cache, tables, lens)
    check_against_reference(cpu_kernel, case)
    out = cpu_kernel(*case, 0.125)
    torch.testing.assert_close(out[1], out[0], atol=0, rtol=0)


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16])
def test_cpu_kernel_low_precision_query(cpu_kernel: CpuPagedDecode, q_dtype: torch.dtype) -> None:
    case = make_case(
        seed=11,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        context_lens=[3, 20],
        q_dtype=q_dtype,
    )
    check_against_reference(cpu_kernel, case)


def test_cpu_kernel_empty_batch(cpu_kernel: CpuPagedDecode) -> None:
    q, k_cache, v_cache, _, _ = make_case(
        seed=1, num_heads=2, num_kv_heads=1, head_dim=64, block_size=8, context_lens=[4]
    )
    empty = cpu_kernel(
        q[:0],
        k_cache,
        v_cache,
        torch.zeros((0, 2), dtype=torch.int32),
        torch.zeros(0, dtype=torch.int32),
        1.0,
    )
    assert empty.shape == (0, 2, 64)


# --- input validation ---------------------------------------------------------


def small_case() -> Case:
    return make_case(
        seed=5, num_heads=4, num_kv_heads=2, head_dim=32, block_size=8, context_lens=[3, 12]
    )


BAD_INPUTS: dict[str, tuple[Callable[[Case], Case], str]] = {
    "non-contiguous q": (
        lambda c: c._replace(q=c.q.transpose(0, 1).contiguous().transpose(0, 1)),
        "q must be contiguous",
    ),
    "int64 block tables": (
        lambda c: c._replace(block_tables=c.block_tables.long()),
        "block_tables must be int32",
    ),
    "int64 context lens": (
        lambda c: c._replace(context_lens=c.context_lens.long()),
        "context_lens must be int32",
    ),
    "float64 cache": (
        lambda c: c._replace(k_cache=c.k_cache.double(), v_cache=c.v_cache.double()),
        "cache dtype",
    ),
    "mixed cache dtypes": (lambda c: c._replace(v_cache=c.v_cache.bfloat16()), "v_cache dtype"),
    "heads not a multiple": (
        lambda c: c._replace(q=torch.randn(2, 3, 32)),
        "multiple of num_kv_heads",
    ),
    "head dim mismatch": (lambda c: c._replace(q=torch.randn(2, 4, 16)), "head_dim"),
    "tables rows": (
        lambda c: c._replace(block_tables=c.block_tables[:1].contiguous()),
        "block_tables must be",
    ),
    "q rank": (lambda c: c._replace(q=c.q.flatten(1)), "q must be"),
    "v shape": (lambda c: c._replace(v_cache=c.v_cache[:-1].contiguous()), "v_cache shape"),
}


@pytest.mark.parametrize("bad", list(BAD_INPUTS))
def test_cpu_kernel_rejects_bad_inputs(cpu_kernel: CpuPagedDecode, bad: str) -> None:
    mutate, message = BAD_INPUTS[bad]
    case = mutate(small_case())
    with pytest.raises(ValueError, match=message):
        cpu_kernel(*case, 1.0)


@pytest.mark.parametrize("bad_len", [0, -1, 10_000])
def test_cpu_kernel_rejects_context_len_out_of_range(
    cpu_kernel: CpuPagedDecode, bad_len: int
) -> None:
    q, k_cache, v_cache, tables, lens = small_case()
    lens[1] = bad_len
    with pytest.raises(ValueError, match="context length"):
        cpu_kernel(q, k_cache, v_cache, tables, lens, 1.0)


@pytest.mark.parametrize("bad_block", [-1, 10_000])
def test_cpu_kernel_rejects_block_ids_outside_pool(
    cpu_kernel: CpuPagedDecode, bad_block: int
) -> None:
    q, k_cache, v_cache, tables, lens = small_case()
    tables[1, 1] = bad_block
    with pytest.raises(ValueError, match="block table entry"):
        cpu_kernel(q, k_cache, v_cache, tables, lens, 1.0)


# --- building and caching the C library ---------------------------------------


@needs_compiler
def test_library_is_cached_by_key_and_reused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cache itself, on a one-function source (the kernels' own take minutes to build
    twice; every other test here builds and loads them)."""
    monkeypatch.setenv("SERVEFLEET_CACHE_DIR", str(tmp_path / "cache"))
    source = tmp_path / "src" / "tiny.c"
    source.parent.mkdir()
    source.write_text("int sf_tiny(int x) { return x + 1; }\n")

    def build(threading: Threading) -> Path:
        return cbuild.build_library(source, OPTIMISE_FLAGS, threading)

    first = build("single")
    assert first.parent == tmp_path / "cache" / "kernels"
    stamp = first.stat().st_mtime_ns
    second = build("single")
    assert second == first and second.stat().st_mtime_ns == stamp
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temp files left
    assert build("pthreads") != first  # flags are part of the key
    (source.parent / "shared.h").write_text("/* a header beside the source */\n")
    assert build("single") != first  # and the headers next to it


def test_missing_compiler_falls_back_with_logged_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("SERVEFLEET_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler-xyz")
    with caplog.at_level(logging.WARNING, logger="servefleet.engine.kernels"):
        assert load_cpu_paged_decode.__wrapped__("single") is None
    assert "no C compiler found" in caplog.text


def test_failing_compiler_falls_back_with_logged_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fake_cc = tmp_path / "fakecc"
    fake_cc.write_text("#!/bin/sh\necho 'fake compiler says no' >&2\nexit 3\n")
    fake_cc.chmod(0o755)
    monkeypatch.setenv("SERVEFLEET_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(fake_cc))
    with caplog.at_level(logging.WARNING, logger="servefleet.engine.kernels"):
        assert load_cpu_paged_decode.__wrapped__("single") is None
    assert "fake compiler says no" in caplog.text
    assert not list((tmp_path / "cache" / "kernels").glob("*.so"))


@needs_compiler
def test_openmp_build_shares_torchs_openmp_runtime() -> None:
    """Two libgomp copies would each keep a thread pool spinning on the same cores."""
    assert load_cpu_paged_decode("openmp") is not None
    runtimes = cpu_module.loaded_openmp_runtimes()
    assert len(runtimes) <= 1, runtimes


# --- kernel selection -----------------------------------------------------------


@pytest.fixture
def fresh_selection() -> Iterator[None]:
    _select.cache_clear()
    yield
    _select.cache_clear()


def test_auto_selection_on_cpu(fresh_selection: None, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="servefleet.engine.kernels"):
        name, kernel = select_decode_kernel("cpu")
        again = select_decode_kernel(torch.device("cpu"))
    assert again == (name, kernel)
    if HAS_COMPILER:
        assert name == "cpu-c" and isinstance(kernel, CpuPagedDecode)
    else:
        assert name == "torch" and kernel is torch_paged_decode
    chosen = [r for r in caplog.records if "decode attention kernel" in r.getMessage()]
    assert len(chosen) == 1, "the choice is logged once"


def test_forced_selection(fresh_selection: None) -> None:
    assert select_decode_kernel("cpu", prefer="torch") == ("torch", torch_paged_decode)
    with pytest.raises(ValueError, match="unknown decode kernel"):
        select_decode_kernel("cpu", prefer="fastest")
    with pytest.raises(KernelUnavailableError, match="cpu-c runs on CPU"):
        select_decode_kernel("cuda", prefer="cpu-c")


def test_triton_on_cpu_needs_the_interpreter(
    fresh_selection: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(KernelUnavailableError, match="TRITON_INTERPRET"):
        select_decode_kernel("cpu", prefer="triton")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        triton_paged_decode(*small_case(), 1.0)


# --- Triton, run by the interpreter on CPU tensors --------------------------------
# Triton decides at import time whether its own helpers (tl.sum, tl.cdiv...) are
# interpreted, so TRITON_INTERPRET must be set before triton is first imported.
# Another test module may already have imported it here, hence a child process
# that runs this file as a script (see the bottom) and reports per-case results.

TRITON_CASES: dict[str, dict[str, object]] = {
    "mha-block8-f32": {"group": 1, "block_size": 8, "head_dim": 32, "cache": "float32"},
    "gqa3-block16-f32": {"group": 3, "block_size": 16, "head_dim": 64, "cache": "float32"},
    "gqa4-block32-bf16": {"group": 4, "block_size": 32, "head_dim": 32, "cache": "bfloat16"},
    # head_dim and block size not powers of two: the kernel pads and masks lanes
    "gqa3-block8-hd80-bf16": {"group": 3, "block_size": 8, "head_dim": 80, "cache": "bfloat16"},
    "gqa2-block24-f32": {"group": 2, "block_size": 24, "head_dim": 32, "cache": "float32"},
    "gqa3-block16-f16": {"group": 3, "block_size": 16, "head_dim": 64, "cache": "float16"},
    "bf16-query": {
        "group": 2,
        "block_size": 8,
        "head_dim": 32,
        "cache": "float32",
        "q": "bfloat16",
    },
}


def run_triton_cases() -> dict[str, dict[str, object]]:
    """Runs in the child process with TRITON_INTERPRET=1."""
    results: dict[str, dict[str, object]] = {}
    name, kernel = select_decode_kernel("cpu", prefer="triton")
    for case_id, spec in TRITON_CASES.items():
        block_size = int(str(spec["block_size"]))
        group = int(str(spec["group"]))
        case = make_case(
            seed=group + block_size,
            num_heads=2 * group,
            num_kv_heads=2,
            head_dim=int(str(spec["head_dim"])),
            block_size=block_size,
            context_lens=[1, block_size + 1, 3 * block_size - 1],
            cache_dtype=getattr(torch, str(spec["cache"])),
            q_dtype=getattr(torch, str(spec.get("q", "float32"))),
            share_prefix_blocks=1,
        )
        scale = case[0].shape[-1] ** -0.5
        out = kernel(*case, scale)
        results[case_id] = {
            "kernel": name,
            "shape_ok": out.shape == case[0].shape,
            "dtype_ok": out.dtype == case[0].dtype,
            "max_error": float((out.float() - reference(case, scale)).abs().max()),
        }
    q, k_cache, v_cache, tables, lens = small_case()
    try:
        kernel(q, k_cache, v_cache, tables.long(), lens, 1.0)
        results["validation"] = {"error": None}
    except ValueError as exc:
        results["validation"] = {"error": str(exc)}
    return results


@pytest.fixture(scope="module")
def triton_results() -> dict[str, dict[str, object]]:
    pytest.importorskip("triton", reason="triton is not installed")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results: dict[str, dict[str, object]] = json.loads(proc.stdout.strip().splitlines()[-1])
    return results


@pytest.mark.parametrize("case_id", list(TRITON_CASES))
def test_triton_kernel_matches_reference(
    triton_results: dict[str, dict[str, object]], case_id: str
) -> None:
    result = triton_results[case_id]
    assert result["kernel"] == "triton"
    assert result["shape_ok"] and result["dtype_ok"]
    low_precision_q = TRITON_CASES[case_id].get("q", "float32") != "float32"
    assert float(str(result["max_error"])) <= (1e-2 if low_precision_q else 1e-5)


def test_triton_kernel_validates_inputs(triton_results: dict[str, dict[str, object]]) -> None:
    assert "block_tables must be int32" in str(triton_results["validation"]["error"])


if __name__ == "__main__":
    print(json.dumps(run_triton_cases()))
