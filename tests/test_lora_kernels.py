"""The C LoRA kernel (`sf_lora_add`) against the PyTorch path (`LoraBatch.add`), its batch
invariance and checks, and the one-call decode program with adapters against the per-layer
path (bitwise).

Adapters are real PEFT files of random weights read by the engine's loader, for a tiny model
whose widths are no multiple of any vector width (every masked tail runs) and for SmolLM2.
"""

from __future__ import annotations

import platform
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from servefleet.engine.attention import AttentionMetadata, PrefillSpan
from servefleet.engine.kernels.cpu_lora import CpuLoraKernel
from servefleet.engine.kernels.cpu_small_gemm import IsaCap, load_cpu_small_gemm
from servefleet.engine.kernels.lora_layout import LoraStep
from servefleet.engine.lora.adapter import LoraAdapter
from servefleet.engine.lora.batch import LoraBatch
from servefleet.engine.model.kv_layout import allocate_kv_cache
from servefleet.engine.model.weights import PROJECTIONS
from tests.support.lora_kernels import ALL, TINY, fused_shapes, make_adapters, shuffled_step

pytestmark = pytest.mark.usefixtures("require_compiler")
ISAS: list[IsaCap] = ["native"]
if platform.machine().lower() in ("x86_64", "amd64"):  # instruction-set caps are x86 flags
    ISAS += ["avx2", "plain"]
# ranks 1 to 33 (33: more rank columns than two vectors hold), every kind of part set
SPECS = [
    (8, ALL),
    (1, ("q_proj", "v_proj")),
    (33, ("gate_proj", "up_proj", "down_proj")),
    (4, ("k_proj", "o_proj")),
    (16, ("up_proj", "q_proj", "k_proj")),
]


@pytest.fixture(scope="module", params=ISAS)
def kernel(request: pytest.FixtureRequest) -> CpuLoraKernel:
    gemm = load_cpu_small_gemm("openmp", request.param)
    assert gemm is not None
    return CpuLoraKernel(gemm)


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def adapters(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    return make_adapters(tmp_path_factory.mktemp("lora"), TINY, SPECS, request.param)


def _inputs(rows: int, seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return {
        name: (torch.randn(rows, k, generator=generator), torch.randn(rows, n, generator=generator))
        for name, (k, n) in fused_shapes(TINY).items()
    }


def _both(batch: LoraBatch, kernel: CpuLoraKernel, layer: int, name: str, x, base):  # type: ignore[no-untyped-def]
    want, got = base.clone(), base.clone()
    batch.add(layer, name, x, want)
    batch.add(layer, name, x, got, kernel)
    return want, got


@pytest.mark.parametrize("rows", [1, 5, 37, 70])
def test_the_c_kernel_adds_what_pytorch_adds(
    kernel: CpuLoraKernel, adapters: list[LoraAdapter], rows: int
) -> None:
    """Random slots (rows on the base model between them), every projection of every layer,
    fused q/k/v and gate/up parts of different sets; rows past one shrink task (32) and one
    expand tile walk (64)."""
    batch, which = shuffled_step(adapters, rows, seed=rows)
    before = kernel.calls[0]
    for layer in range(TINY.num_layers):
        for name, (x, base) in _inputs(rows, layer).items():
            want, got = _both(batch, kernel, layer, name, x, base)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
            untouched = torch.tensor([w < 0 for w in which])
            assert torch.equal(got[untouched], base[untouched])  # base rows: not a bit changed
    assert kernel.calls[0] - before == TINY.num_layers * len(PROJECTIONS)
    assert batch.ran == {"torch", "cpu-c"}


def test_a_rows_bits_depend_on_its_adapter_alone(
    kernel: CpuLoraKernel, adapters: list[LoraAdapter]
) -> None:
    """Each row alone, the rows reversed, and one thread instead of two: the same bits."""
    rows = 24
    batch, which = shuffled_step(adapters, rows, seed=3, base_share=0.0)
    x, base = _inputs(rows, 9)["gate_up_weight"]
    full = base.clone()
    batch.add(1, "gate_up_weight", x, full, kernel)
    assert batch.ran == {"cpu-c"}
    for row in (0, 7, 23):
        alone = LoraBatch.for_spans([(adapters[which[row]], 0, 1)], "cpu")
        one = base[row : row + 1].clone()
        alone.add(1, "gate_up_weight", x[row : row + 1], one, kernel)
        assert torch.equal(one, full[row : row + 1])
    flip = torch.arange(rows - 1, -1, -1)
    reversed_batch = LoraBatch.for_spans(
        [(adapters[which[int(r)]], i, 1) for i, r in enumerate(flip)], "cpu"
    )
    backwards = base[flip].clone()
    reversed_batch.add(1, "gate_up_weight", x[flip].contiguous(), backwards, kernel)
    assert torch.equal(backwards, full[flip])
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if threads > 1 else 2)
    try:
        again = base.clone()
        batch.add(1, "gate_up_weight", x, again, kernel)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(again, full)


def test_bad_steps_are_refused_and_odd_tensors_go_to_pytorch(
    kernel: CpuLoraKernel, adapters: list[LoraAdapter]
) -> None:
    batch, _ = shuffled_step(adapters, 6, seed=5, base_share=0.0)
    step = batch.kernel_step(6)
    assert step is not None
    x, out = _inputs(6, 1)["qkv_weight"]
    wide = torch.cat([x, x], dim=1)  # not the projection's input width: the entry says so
    with pytest.raises(ValueError, match="malformed adapter table entry"):
        kernel.add(wide, out.clone(), step, 0, 0)
    slots = step.row_slots.clone()
    slots[2] = step.table.shape[0]
    with pytest.raises(ValueError, match="slot is outside"):
        kernel.add(x, out.clone(), replace(step, row_slots=slots), 0, 0)
    bad = step.table.clone()
    bad[:, 0, 0, 7] = 10_000  # a part's first output column past the output
    with pytest.raises(ValueError, match="malformed"):
        kernel.add(x, out.clone(), replace(step, table=bad), 0, 0)
    with pytest.raises(ValueError, match="no layer 9"):
        kernel.add(x, out.clone(), step, 9, 0)
    kept = out.clone()
    assert not kernel.add(x.double(), kept.double(), step, 0, 0)  # not float32: declined
    assert not kernel.add(x, kept, replace(step, weight_dtype=torch.float16), 0, 0)
    assert torch.equal(kept, out)
    batch.add(0, "qkv_weight", x.double(), out.double(), kernel)
    assert batch.ran == {"torch"}


def test_adapters_of_two_weight_dtypes_in_one_step_go_to_pytorch(tmp_path: Path) -> None:
    f32 = make_adapters(tmp_path / "f", TINY, SPECS[:1])
    bf16 = make_adapters(tmp_path / "b", TINY, SPECS[:1], torch.bfloat16)
    batch = LoraBatch.for_spans([(f32[0], 0, 1), (bf16[0], 1, 1)], "cpu")
    assert batch.kernel_step(2) is None


# --- the one-call decode program (SmolLM2) -------------------------------------------------


def _decode(model, adapters: list[LoraAdapter], program: bool, cache_dtype: torch.dtype):  # type: ignore[no-untyped-def]
    """Five prompts prefilled (two under adapters, gathered rows), then one decode step of
    five rows on three adapters and the base model; the step's hidden states and caches."""
    config = model.config
    prompts = [list(range(100 + i, 140 + 7 * i)) for i in range(5)]
    which = [0, 1, None, 0, 2]
    kv = allocate_kv_cache(config, 40, 16, cache_dtype, "cpu")
    tables = [list(range(8 * i, 8 * i + 8)) for i in range(len(prompts))]
    with torch.inference_mode():
        for prompt, table, a in zip(prompts, tables, which, strict=True):
            t, pos = torch.tensor(table), torch.arange(len(prompt))
            lora = (
                None if a is None else LoraBatch.for_spans([(adapters[a], 0, len(prompt))], "cpu")
            )
            meta = AttentionMetadata(
                slot_mapping=t[pos // 16] * 16 + pos % 16, block_size=16,
                prefills=[PrefillSpan(0, len(prompt), 0, t[: -(-len(prompt) // 16)])], lora=lora,
            )  # fmt: skip
            model(torch.tensor(prompt), pos, kv, meta)
        pos, t = torch.tensor([len(p) for p in prompts]), torch.tensor(tables)
        spans = [(adapters[a], row, 1) for row, a in enumerate(which) if a is not None]
        step = AttentionMetadata(
            slot_mapping=t[torch.arange(len(prompts)), pos // 16] * 16 + pos % 16,
            block_size=16, num_decodes=len(prompts), decode_block_tables=t.int(),
            decode_context_lens=(pos + 1).int(), lora=LoraBatch.for_spans(spans, "cpu"),
        )  # fmt: skip
        model.one_call_decode = program
        try:
            hidden = model(torch.tensor([7, 8, 9, 10, 11]), pos, kv, step)
        finally:
            model.one_call_decode = True
    assert step.lora is not None
    return hidden, kv, step.lora.ran


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.int8])
def test_the_one_call_program_adds_the_per_layer_paths_bits(  # type: ignore[no-untyped-def]
    smollm2, tmp_path: Path, cache_dtype: torch.dtype
) -> None:
    model = smollm2.model
    assert isinstance(model.lora_kernel, CpuLoraKernel)
    specs = [(8, ALL), (4, ("q_proj", "v_proj", "down_proj")), (16, ("gate_proj", "up_proj"))]
    adapters = make_adapters(tmp_path, smollm2.config, specs, torch.bfloat16)
    with_program, kv_program, ran_program = _decode(model, adapters, True, cache_dtype)
    per_layer, kv_layers, ran_layers = _decode(model, adapters, False, cache_dtype)
    assert ran_program == {"program"} and ran_layers == {"cpu-c"}
    assert torch.equal(with_program, per_layer)
    for (k1, v1), (k2, v2) in zip(kv_program, kv_layers, strict=True):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    if cache_dtype != torch.float32:
        return  # int8 rows quantize differently on the slightest change: bits or nothing
    kernel = model.lora_kernel
    model.set_lora_kernel(None)
    try:
        in_torch, _, ran_torch = _decode(model, adapters, True, cache_dtype)
    finally:
        model.set_lora_kernel(kernel)
    assert ran_torch == {"torch"}  # no C LoRA kernel: the per-layer path in PyTorch
    torch.testing.assert_close(in_torch, with_program, rtol=1e-4, atol=1e-4)


def test_a_lora_step_the_program_cannot_read_is_refused(smollm2) -> None:  # type: ignore[no-untyped-def]
    kv = allocate_kv_cache(smollm2.config, 2, 16, torch.float32, "cpu")
    layers = smollm2.model._decode_layers_for(
        smollm2.model.fused_ops, kv,
        AttentionMetadata(slot_mapping=torch.zeros(1, dtype=torch.long), block_size=16,
                          num_decodes=1),
        1,
    )  # fmt: skip
    assert layers is not None
    step = LoraStep(torch.zeros(1, dtype=torch.int32), torch.zeros(1, 29, 4, 19, dtype=torch.int64),
                    torch.bfloat16, 8)  # fmt: skip
    hidden = torch.zeros(1, smollm2.config.hidden_size)
    zero = torch.zeros(1, dtype=torch.long)
    table, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="LoRA step of the wrong"):  # 29 layers, not 30
        layers.run(hidden, zero, zero, table, lens, step)
