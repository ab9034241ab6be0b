"""Quantization at load (`--quantization int8|int4`): the spec, the flag, the weights.

int8 and int4 reach only our engine's args (vLLM and SGLang refuse them by name); the
flag becomes `EngineConfig.quantization`; a float model is quantized into packed Q8/Q4
blocks whose error stays within half a quantization step, multiplied by the packed
kernels exactly as their dequantized float32 weights, and a model that cannot hold
packed weights is refused instead of silently served in float.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import save_file

from servefleet.api.engines import EngineListen, engine_adapter
from servefleet.api.llmdeployment import LLMDeploymentSpec
from servefleet.bench.quant_models import SCHEMES, TINY, write_llama_gguf
from servefleet.cli import engine_cmd
from servefleet.engine.config import EngineConfig
from servefleet.engine.kernels.cpu_small_gemm import CpuSmallGemm
from servefleet.engine.kernels.packed_weights import (
    BLOCK_K,
    BlockQuantized,
    PackedFormat,
    PackedWeight,
    pack,
)
from servefleet.engine.model.loader import (
    LoadedModel,
    QuantizationSettingsError,
    load_model,
    model_from_checkpoint,
    read_checkpoint,
)
from servefleet.engine.model.quantize import own_copies, quantize_int4, quantize_int8
from servefleet.engine.model.safetensors_loader import TensorFiles
from tests.test_model_int4_checkpoints import prefill_logits
from tests.test_model_safetensors import CASES, _save_checkpoint
from tests.test_small_gemm import gemm  # noqa: F401  (the fixture: every kernel build)

SERVEFLEET = {"model": {"name": "m", "source": {"builtin": "smollm2-135m-instruct"}}}


def engine_args(spec: dict[str, Any]) -> list[str]:
    """The args our engine runs with for `spec` (as the operator and local mode build them)."""
    parsed = LLMDeploymentSpec.model_validate(spec)
    return engine_adapter("servefleet").build_args(parsed, "m", EngineListen("127.0.0.1", 8000))


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_spec_quantization_reaches_our_engine_flag(mode: str) -> None:
    spec = {"model": {**SERVEFLEET["model"], "quantization": mode}}
    args = engine_args(spec)
    assert args[args.index("--quantization") + 1] == mode
    parser = argparse.ArgumentParser()
    engine_cmd.add_arguments(parser)
    parsed = parser.parse_args(["--model", "m", "--quantization", mode])
    assert EngineConfig(**engine_cmd.engine_settings(parsed)).quantization == mode
    assert "--quantization" not in engine_args(SERVEFLEET)


def test_load_quantization_is_refused_for_other_engines_and_kinds() -> None:
    spec = {
        "model": {"name": "m", "source": {"url": "https://x/m"}, "quantization": "int4"},
        "engine": {"kind": "vllm"},
    }
    with pytest.raises(ValidationError, match=r"int8 and int4 .* need engine\.kind servefleet"):
        LLMDeploymentSpec.model_validate(spec)
    parser = argparse.ArgumentParser()
    engine_cmd.add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--quantization", "fp8"])
    with pytest.raises(ValidationError, match="quantization"):
        EngineConfig(model="m", quantization="int2")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("quantize", "fmt"), [(quantize_int8, PackedFormat.Q8), (quantize_int4, PackedFormat.Q4)]
)
def test_quantized_weight_is_close_and_multiplies_exactly(
    gemm: CpuSmallGemm,  # noqa: F811
    quantize: Callable[[torch.Tensor], BlockQuantized],
    fmt: PackedFormat,
) -> None:
    weight = torch.randn(37, 192, generator=torch.Generator().manual_seed(0))
    weight[3, :BLOCK_K] = 0.0  # an all-zero block quantizes to zeros, not NaN
    quantized = quantize(weight)
    assert quantized.format == fmt
    dense = quantized.dequantize()
    blocks = weight.view(37, -1, BLOCK_K)
    span = blocks.amax(-1) - blocks.amin(-1) if fmt == PackedFormat.Q4 else blocks.abs().amax(-1)
    step = span / (15 if fmt == PackedFormat.Q4 else 127)
    error = (dense - weight).abs().view(37, -1, BLOCK_K).amax(-1)
    assert bool((error <= step * (0.5 + 1e-3) + 1e-6).all())  # scales: 16 significant bits
    assert torch.equal(dense[3, :BLOCK_K], torch.zeros(BLOCK_K))
    packed = pack(quantized)
    x = torch.randn(5, 192, generator=torch.Generator().manual_seed(1))
    assert torch.equal(gemm.packed_mm(x, packed), gemm.mm(x, dense.t().contiguous()))


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_float_checkpoint_is_quantized_at_load(tmp_path: Path, mode: str) -> None:
    config_class, extra = CASES["llama-linear-rope-bias-tied"]
    _save_checkpoint(tmp_path, config_class, {**extra, "intermediate_size": 128})
    dense = load_model(str(tmp_path))
    quantized = load_model(str(tmp_path), quantization=mode)
    summary = quantized.model.packed_summary()
    assert summary["tensors"] == 4 * quantized.config.num_layers + 1  # projections, lm_head
    names = {n for n, _ in quantized.model.named_parameters()}
    assert not any(n.endswith("_weight") for n in names) and "embed_tokens" in names
    assert quantized.model.packed_lm_head is not None
    assert quantized.model.packed_lm_head.format_names == {"Q8"}  # int8 head in both modes
    packed = quantized.model.layers[0].packed
    formats = {w.format_names for w in packed.values()}  # type: ignore[operator]
    assert formats == {frozenset({"Q8" if mode == "int8" else "Q4"})}
    ids = list(range(3, 40))
    ours, reference = prefill_logits(quantized, ids), prefill_logits(dense, ids)
    relative = float((ours - reference).norm() / reference.norm())
    assert 0 < relative < (0.02 if mode == "int8" else 0.2)
    assert np.isfinite(ours.numpy()).all()


def test_quantization_needs_a_model_that_holds_packed_weights(tmp_path: Path) -> None:
    _save_checkpoint(tmp_path, *CASES["llama-linear-rope-bias-tied"])
    with pytest.raises(QuantizationSettingsError, match="int8 needs packed weights"):
        load_model(str(tmp_path), torch.bfloat16, quantization="int8")
    with pytest.raises(QuantizationSettingsError, match="packed weights off"):
        load_model(str(tmp_path), packed_weights=False, quantization="int4")


def test_weights_left_in_float_no_longer_share_the_checkpoints_storage() -> None:
    """After quantizing, the float weights left (embedding, norms) are copies: a view left on
    the memory-mapped file would keep every page quantizing read resident."""
    file_storage = torch.randn(1 << 16)  # stands in for the mapped file all tensors view
    embed = file_storage[: 64 * 32].view(64, 32)
    weights = {"embed_tokens": embed, "norm": file_storage[-32:]}
    own_copies(weights)
    for name, tensor in weights.items():
        assert tensor.untyped_storage().data_ptr() != file_storage.untyped_storage().data_ptr()
        assert torch.equal(tensor, embed if name == "embed_tokens" else file_storage[-32:])


def _packed_weights(loaded: LoadedModel) -> dict[str, PackedWeight]:
    found = {
        f"{i}.{n}": w
        for i, layer in enumerate(loaded.model.layers)
        for n, w in layer.packed.items()
    }
    if loaded.model.packed_lm_head is not None:
        found["lm_head"] = loaded.model.packed_lm_head
    return found


def assert_bitwise_equal(streamed: LoadedModel, in_memory: LoadedModel) -> None:
    """Quantizing while reading gives today's in-memory quantized model, bit for bit."""
    ours, reference = _packed_weights(streamed), _packed_weights(in_memory)
    assert ours.keys() == reference.keys() and ours
    for name, weight in ours.items():
        other = reference[name]
        assert (weight.k, weight.n) == (other.k, other.n), name
        assert torch.equal(weight.data, other.data) and torch.equal(weight.formats, other.formats)
    params = dict(in_memory.model.named_parameters())
    assert {n for n, _ in streamed.model.named_parameters()} == set(params)
    for name, tensor in streamed.model.named_parameters():
        assert torch.equal(tensor, params[name]), name
    ids = list(range(3, 40))
    assert torch.equal(prefill_logits(streamed, ids), prefill_logits(in_memory, ids))


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("case", ["llama-linear-rope-bias-tied", "llama3-rope-untied"])
def test_safetensors_folder_is_quantized_as_read(tmp_path: Path, case: str, mode: str) -> None:
    config_class, extra = CASES[case]
    _save_checkpoint(tmp_path, config_class, {**extra, "intermediate_size": 128})
    streamed = load_model(str(tmp_path), quantization=mode)
    in_memory = model_from_checkpoint(read_checkpoint(str(tmp_path)), quantization=mode)
    assert_bitwise_equal(streamed, in_memory)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_cached_gguf_conversion_is_quantized_as_read(tmp_path: Path, mode: str) -> None:
    path = tmp_path / "tiny-f32.gguf"
    write_llama_gguf(path, TINY, SCHEMES["F32"], np.random.default_rng(0))
    cache = tmp_path / "cache"
    cold = load_model(str(path), cache_root=cache, quantization=mode)  # converts, then quantizes
    warm = load_model(str(path), cache_root=cache, quantization=mode)  # streams the cache entry
    in_memory = model_from_checkpoint(
        read_checkpoint(str(path), cache_root=cache), quantization=mode
    )
    assert_bitwise_equal(warm, in_memory)
    assert_bitwise_equal(cold, in_memory)


def test_tensor_files_read_what_safetensors_stores(tmp_path: Path) -> None:
    """Tensors read one at a time into memory of their own (nothing mapped), any dtype."""
    generator = torch.Generator().manual_seed(0)
    tensors = {
        "f32": torch.randn(5, 7, generator=generator),
        "bf16": torch.randn(3, 64, generator=generator).to(torch.bfloat16),
        "f16": torch.randn(9, generator=generator).to(torch.float16),
        "i8": torch.randint(-128, 127, (4, 4), dtype=torch.int8, generator=generator),
        "empty": torch.zeros(0, 3),
    }
    save_file(tensors, str(tmp_path / "a.safetensors"))
    save_file({"scalar": torch.tensor(2.5)}, str(tmp_path / "b.safetensors"))
    files = TensorFiles([tmp_path / "a.safetensors", tmp_path / "b.safetensors"])
    assert set(files) == {*tensors, "scalar"} and len(files) == 6
    for name, expected in {**tensors, "scalar": torch.tensor(2.5)}.items():
        got = files[name]
        assert got.dtype == expected.dtype and torch.equal(got, expected), name
        assert got.is_contiguous() and got.untyped_storage().nbytes() == expected.nbytes


def _reference_int8(weight: torch.Tensor) -> tuple[np.ndarray, ...]:
    """The whole-matrix int8 quantizer as first shipped: row chunking must not change a bit."""
    blocks = weight.to(torch.float32).contiguous().numpy().reshape(weight.shape[0], -1, BLOCK_K)
    bits = (np.abs(blocks).max(axis=-1) / np.float32(127.0)).view(np.uint32)
    scale = ((bits + np.uint32(0x80)) & np.uint32(0xFFFFFF00)).view(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1.0))[..., None]
    return np.clip(np.rint(blocks / safe), -127, 127).astype(np.int8), scale


def _reference_int4(weight: torch.Tensor) -> tuple[np.ndarray, ...]:
    blocks = weight.to(torch.float32).contiguous().numpy().reshape(weight.shape[0], -1, BLOCK_K)
    low, high = blocks.min(axis=-1), blocks.max(axis=-1)
    bits = ((high - low) / np.float32(15)).view(np.uint32)
    scale = ((bits + np.uint32(0x80)) & np.uint32(0xFFFFFF00)).view(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1.0))[..., None]
    q = np.clip(np.rint((blocks - low[..., None]) / safe), 0, 15).astype(np.uint8)
    return q, scale, low


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_quantizers_equal_the_whole_matrix_ones(dtype: torch.dtype) -> None:
    fused_in_out = torch.randn(96, 2500, generator=torch.Generator().manual_seed(3)).to(dtype)
    weight = fused_in_out.t()  # [out, in] as quantizing reads a fused projection: a view
    weight_before = weight.clone()
    q8, q4 = quantize_int8(weight), quantize_int4(weight)
    assert torch.equal(weight, weight_before)  # the float weight is never written to
    q, scale = _reference_int8(weight)
    assert np.array_equal(q8.q, q.reshape(weight.shape)) and np.array_equal(q8.scale, scale)
    q, scale, low = _reference_int4(weight)
    assert np.array_equal(q4.q, q.reshape(weight.shape)) and np.array_equal(q4.scale, scale)
    assert q4.minimum is not None and np.array_equal(q4.minimum, low)
    embedding = weight.contiguous()  # float32: the chunks are views of it, never written
    quantize_int8(embedding), quantize_int4(embedding)
    assert torch.equal(embedding, weight_before)
