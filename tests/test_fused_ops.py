"""The fused C decoder ops against PyTorch, and the model with them against without.

rms_norm, SwiGLU and RoPE + KV-cache write must compute what the PyTorch ops compute
(to float rounding; int8 KV rows exactly), per row independently of the batch, and reject
inputs that would make the C code read or write out of bounds. The float16 conversions are
also checked in the portable build (-DSF_NO_FLOAT16) that compilers without _Float16 get.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from servefleet.engine.attention import AttentionMetadata, PagedAttention, PrefillSpan
from servefleet.engine.kernels import SmallRowsMatmul, cbuild, cpu_fused_ops, cpu_paged_decode
from servefleet.engine.kernels.cpu_fused_ops import CpuFusedOps, load_cpu_fused_ops
from servefleet.engine.kernels.cpu_paged_decode import CpuPagedDecode, load_cpu_paged_decode
from servefleet.engine.kv_quant import quantize_rows, row_width
from servefleet.engine.model.config import ModelConfig
from servefleet.engine.model.kv_layout import allocate_kv_cache
from servefleet.engine.model.llama import LlamaForCausalLM
from servefleet.engine.model.rope import apply_rope

pytestmark = pytest.mark.usefixtures("require_compiler")


@pytest.fixture(scope="module")
def ops() -> CpuFusedOps:
    built = load_cpu_fused_ops()
    assert built is not None, "a compiler is present, so the fused ops must build"
    return built


@pytest.fixture(scope="module")
def portable_ops() -> CpuFusedOps:
    flags = (*cpu_fused_ops.OPTIMISE_FLAGS, "-DSF_NO_FLOAT16")
    path = cbuild.build_library(cpu_fused_ops.SOURCE_PATH, flags, "single")
    return CpuFusedOps(library=cpu_fused_ops._open(path), path=path)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_add_rms_norm_matches_torch_and_updates_the_residual(ops: CpuFusedOps) -> None:
    hidden = torch.randn(7, 576, generator=_gen(1)) * 3
    delta = torch.randn(7, 576, generator=_gen(2))
    weight = torch.randn(576, generator=_gen(3))
    expected_hidden = hidden + delta
    expected = F.rms_norm(expected_hidden, (576,), weight, 1e-5)
    out = ops.add_rms_norm(hidden, delta, weight, 1e-5)
    assert torch.equal(hidden, expected_hidden)  # the residual stream, updated in place
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    alone = torch.cat(
        [ops.add_rms_norm(hidden[i : i + 1].clone(), None, weight, 1e-5) for i in range(7)]
    )
    assert torch.equal(ops.add_rms_norm(hidden.clone(), None, weight, 1e-5), alone)
    odd = torch.randn(3, 37, generator=_gen(4))  # not a multiple of the 16 lanes
    torch.testing.assert_close(
        ops.add_rms_norm(odd, None, torch.ones(37), 1e-6), F.rms_norm(odd, (37,), eps=1e-6)
    )
    with pytest.raises(ValueError, match="matching shapes"):
        ops.add_rms_norm(hidden, delta[:, :10], weight, 1e-5)


def test_silu_mul_matches_torch_over_the_whole_range(ops: CpuFusedOps) -> None:
    gate = torch.cat([torch.linspace(-120, 120, 2001), torch.randn(47, generator=_gen(5))])
    up = torch.randn(gate.numel(), generator=_gen(6))
    gate_up = torch.cat([gate, up])[None, :].repeat(3, 1).contiguous()
    out = ops.silu_mul(gate_up)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, (F.silu(gate) * up).expand(3, -1), rtol=2e-6, atol=1e-7)
    with pytest.raises(ValueError, match=r"\[T, 2·I\]"):
        ops.silu_mul(torch.randn(2, 5))


def _rope_case(tokens: int, cache_dtype: torch.dtype, seed: int):  # type: ignore[no-untyped-def]
    heads, kv_heads, hd = 6, 2, 32
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * hd, generator=_gen(seed))
    positions = torch.randint(0, 100, (tokens,), generator=_gen(seed + 1))
    angles = torch.rand(100, hd // 2, generator=_gen(seed + 2)) * 6.28
    cos = torch.cat([angles.cos(), angles.cos()], -1).contiguous()
    sin = torch.cat([angles.sin(), angles.sin()], -1).contiguous()
    k_cache = torch.zeros(4, 16, kv_heads, hd, dtype=cache_dtype)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(64, generator=_gen(seed + 3))[:tokens]
    return heads, kv_heads, hd, qkv, positions, cos, sin, k_cache, v_cache, slots


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_rope_kv_matches_torch(ops: CpuFusedOps, cache_dtype: torch.dtype) -> None:
    heads, kvh, hd, qkv, positions, cos, sin, k_cache, v_cache, slots = _rope_case(
        9, cache_dtype, 7
    )
    qk = qkv[:, : (heads + kvh) * hd].reshape(9, heads + kvh, hd)
    expected_qk = apply_rope(qk, cos[positions][:, None], sin[positions][:, None])
    v = qkv[:, (heads + kvh) * hd :].reshape(9, kvh, hd).clone()
    ops.rope_kv(qkv, heads, kvh, hd, positions, cos, sin, k_cache, v_cache, slots)
    rotated = qkv[:, : (heads + kvh) * hd].reshape(9, heads + kvh, hd)
    torch.testing.assert_close(rotated, expected_qk, rtol=1e-5, atol=1e-6)
    # The cache holds exactly the rotated k (rounded as torch rounds) and v.
    flat_k, flat_v = k_cache.view(-1, kvh, hd), v_cache.view(-1, kvh, hd)
    assert torch.equal(flat_k[slots], rotated[:, heads:].to(cache_dtype))
    assert torch.equal(flat_v[slots], v.to(cache_dtype))
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[slots] = False
    assert not flat_k[untouched].any() and not flat_v[untouched].any()


def test_rope_kv_quantizes_int8_rows_as_kv_quant_does(ops: CpuFusedOps) -> None:
    """An int8 cache gets quantize_rows of the rotated k and of v, bit for bit (scale
    inline), for rows of every magnitude, all-zero rows, exact halves and underflow."""
    heads, kvh, hd, tokens = 2, 2, 32, 64
    qkv = torch.randn(tokens, (heads + 2 * kvh) * hd, generator=_gen(20))
    qkv *= torch.logspace(-30, 30, tokens)[:, None]
    qkv[0] = 0.0
    qkv[1] = torch.randint(-5, 6, (qkv.shape[1],), generator=_gen(21)) * 0.5  # ties to even
    qkv[2, -hd:] = 1e-44  # scale underflows to 0: values 0, as in torch
    positions = torch.randint(0, 50, (tokens,), generator=_gen(22))
    angles = torch.rand(50, hd // 2, generator=_gen(23)) * 6.28
    cos = torch.cat([angles.cos(), angles.cos()], -1).contiguous()
    sin = torch.cat([angles.sin(), angles.sin()], -1).contiguous()
    k_cache = torch.zeros(5, 16, kvh, row_width(hd, torch.int8), dtype=torch.int8)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(80, generator=_gen(24))[:tokens]
    v = qkv[:, (heads + kvh) * hd :].reshape(tokens, kvh, hd).clone()
    ops.rope_kv(qkv, heads, kvh, hd, positions, cos, sin, k_cache, v_cache, slots)
    k = qkv[:, heads * hd : (heads + kvh) * hd].reshape(tokens, kvh, hd)  # rotated in place
    flat_k, flat_v = k_cache.view(80, kvh, -1), v_cache.view(80, kvh, -1)
    assert torch.equal(flat_k[slots], quantize_rows(k))
    assert torch.equal(flat_v[slots], quantize_rows(v))
    untouched = torch.ones(80, dtype=torch.bool)
    untouched[slots] = False
    assert not flat_k[untouched].any() and not flat_v[untouched].any()
    with pytest.raises(ValueError, match="wrong dtype"):  # int8 rows lack their scale bytes
        narrow = torch.zeros(5, 16, kvh, hd, dtype=torch.int8)
        ops.rope_kv(qkv, heads, kvh, hd, positions, cos, sin, narrow, narrow.clone(), slots)


def test_rope_kv_rejects_what_would_go_out_of_bounds(ops: CpuFusedOps) -> None:
    heads, kvh, hd, qkv, positions, cos, sin, k_cache, v_cache, slots = _rope_case(
        3, torch.float32, 8
    )
    with pytest.raises(ValueError, match="outside the rope table"):
        ops.rope_kv(qkv, heads, kvh, hd, positions + 100, cos, sin, k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="outside the cache"):
        ops.rope_kv(qkv, heads, kvh, hd, positions, cos, sin, k_cache, v_cache, slots + 64)
    with pytest.raises(ValueError, match="does not match the heads"):
        ops.rope_kv(qkv, heads + 1, kvh, hd, positions, cos, sin, k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="wrong dtype"):
        ops.rope_kv(qkv, heads, kvh, hd, positions.int(), cos, sin, k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="wrong dtype"):
        ops.rope_kv(
            qkv, heads, kvh, hd, positions, cos, sin, k_cache.bfloat16(), v_cache.bfloat16(), slots
        )


SPECIAL_HALF_INPUTS = [
    0.0,
    -0.0,
    1.0,
    -2.5,
    65504.0,
    65519.9,
    65520.0,
    -70000.0,
    1e-5,
    6.1e-5,
    5.96e-8,
    2.9e-8,
    3.0e-8,
    1e-9,
    0.333333,
    1.0009765625,
    1.00048828125,
    1.00146484375,
    math.inf,
    -math.inf,
]


def test_portable_float16_write_rounds_like_torch(
    ops: CpuFusedOps, portable_ops: CpuFusedOps
) -> None:
    """v is stored as it is (no rotation): the cache gets exactly v converted to float16."""
    values = torch.tensor(SPECIAL_HALF_INPUTS + [math.nan] * 4)
    values = torch.cat([values, torch.randn(104, generator=_gen(9)) * 1000])  # 128 = 2 rows
    heads, kvh, hd = 1, 1, 64
    qkv = torch.zeros(2, 3 * hd)
    qkv[:, 2 * hd :] = values.view(2, hd)
    cos, sin = torch.ones(4, hd), torch.zeros(4, hd)
    for built in (ops, portable_ops):
        k_cache = torch.zeros(2, 1, 1, hd, dtype=torch.float16)
        v_cache = torch.zeros_like(k_cache)
        built.rope_kv(
            qkv.clone(), heads, kvh, hd, torch.tensor([0, 1]), cos, sin, k_cache, v_cache,
            torch.tensor([0, 1]),
        )  # fmt: skip
        got, expected = v_cache.view(2, hd), values.view(2, hd).half()
        assert torch.equal(got.isnan(), expected.isnan())
        assert torch.equal(got[~got.isnan()], expected[~expected.isnan()])


def test_portable_float16_read_matches_the_native_build() -> None:
    native = load_cpu_paged_decode()
    assert native is not None
    flags = (*cpu_paged_decode.OPTIMISE_FLAGS, "-DSF_NO_FLOAT16")
    path = cbuild.build_library(cpu_paged_decode.SOURCE_PATH, flags, "openmp")
    portable = CpuPagedDecode(cpu_paged_decode._open_library(path, "openmp"), "openmp", path)
    generator = _gen(10)
    k = torch.randn(6, 16, 2, 64, generator=generator)
    k[0, :4] *= 1e-6  # float16 subnormals
    k_cache, v_cache = k.half(), torch.randn(6, 16, 2, 64, generator=generator).half()
    q = torch.randn(3, 4, 64, generator=generator)
    tables = torch.tensor([[0, 1, 2], [3, 4, 0], [5, 2, 1]], dtype=torch.int32)
    lens = torch.tensor([40, 17, 48], dtype=torch.int32)
    expected = native(q, k_cache, v_cache, tables, lens, 0.125)
    assert torch.equal(portable(q, k_cache, v_cache, tables, lens, 0.125), expected)


TINY = ModelConfig(
    architecture="llama", vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=128,
)  # fmt: skip


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.int8])
def test_model_with_fused_ops_matches_without(ops: CpuFusedOps, cache_dtype: torch.dtype) -> None:
    """A prefill span then a decode step, through both paths, on the same random model."""
    torch.manual_seed(11)
    model = LlamaForCausalLM(TINY)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    model._build_rope()
    ids = torch.randint(0, 96, (21,), generator=_gen(12))

    def run(fused: CpuFusedOps | None) -> torch.Tensor:
        model.set_fused_ops(fused)
        kv = allocate_kv_cache(TINY, 4, 16, cache_dtype, "cpu")
        table = torch.tensor([2, 0, 3])
        pos = torch.arange(20)
        meta = AttentionMetadata(
            slot_mapping=table[pos // 16] * 16 + pos % 16,
            block_size=16,
            prefills=[PrefillSpan(0, 20, 0, table[:2])],
        )
        with torch.inference_mode():
            first = model.compute_logits(model(ids[:20], pos, kv, meta)[-1:])
            step = AttentionMetadata(
                slot_mapping=table[1:2] * 16 + 4,
                block_size=16,
                num_decodes=1,
                decode_block_tables=table[None, :2].int(),
                decode_context_lens=torch.tensor([21], dtype=torch.int32),
            )
            second = model.compute_logits(model(ids[20:], torch.tensor([20]), kv, step))
        return torch.cat([first, second])

    model.set_attention(PagedAttention())
    torch.testing.assert_close(run(ops), run(None), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    ("cache_dtype", "bf16"), [(torch.float32, False), (torch.int8, False), (torch.float32, True)]
)
def test_decode_layers_in_one_call_give_the_python_paths_bits(  # type: ignore[no-untyped-def]
    smollm2, cache_dtype: torch.dtype, bf16: bool
) -> None:
    """A decode step of SmolLM2 through the one-call C program and through the model's
    per-layer Python path: the same hidden states and the same KV-cache writes, bitwise
    (an int8 cache quantized on write by the same C code in both; bfloat16 products from
    the same packed kernel in both)."""
    model = smollm2.model
    assert model.fused_ops is not None
    if bf16:
        matmul = model.matmul
        assert isinstance(matmul, SmallRowsMatmul)
        if not matmul.kernel.bf16_products:
            pytest.skip("bfloat16 products need AVX512_BF16 hardware, which this CPU lacks")
        model.set_matmul(replace(matmul, bf16_min_rows=1))
        try:
            _one_call_against_per_layer(model, cache_dtype)
        finally:
            model.set_matmul(matmul)
        return
    _one_call_against_per_layer(model, cache_dtype)


def _one_call_against_per_layer(model: LlamaForCausalLM, cache_dtype: torch.dtype) -> None:
    config = model.config
    prompts = [list(range(100 + i, 140 + 7 * i)) for i in range(5)]

    def run(program: bool) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        kv = allocate_kv_cache(config, 40, 16, cache_dtype, "cpu")
        tables = [list(range(8 * i, 8 * i + 8)) for i in range(len(prompts))]
        with torch.inference_mode():
            for prompt, table in zip(prompts, tables, strict=True):  # one prefill each
                t = torch.tensor(table)
                pos = torch.arange(len(prompt))
                meta = AttentionMetadata(
                    slot_mapping=t[pos // 16] * 16 + pos % 16,
                    block_size=16,
                    prefills=[PrefillSpan(0, len(prompt), 0, t[: -(-len(prompt) // 16)])],
                )
                model(torch.tensor(prompt), pos, kv, meta)
            pos = torch.tensor([len(p) for p in prompts])
            t = torch.tensor(tables)
            step = AttentionMetadata(
                slot_mapping=t[torch.arange(len(prompts)), pos // 16] * 16 + pos % 16,
                block_size=16,
                num_decodes=len(prompts),
                decode_block_tables=t.int(),
                decode_context_lens=(pos + 1).int(),
            )
            ids = torch.tensor([7, 8, 9, 10, 11])
            model.one_call_decode = program
            try:
                hidden = model(ids, pos, kv, step)
            finally:
                model.one_call_decode = True
        return hidden, kv

    assert model._decode_layers_for(
        model.fused_ops,
        allocate_kv_cache(config, 2, 16, cache_dtype, "cpu"),
        AttentionMetadata(slot_mapping=torch.zeros(1, dtype=torch.long), block_size=16,
                          num_decodes=1),
        1,
    ) is not None  # fmt: skip
    with_program, kv_program = run(True)
    per_layer, kv_layers = run(False)
    assert torch.equal(with_program, per_layer)
    for (k1, v1), (k2, v2) in zip(kv_program, kv_layers, strict=True):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
