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

from servefleet.api import load_quantization
from servefleet.api.engines import EngineListen, engine_adapter
from servefleet.api.llmdeployment import LLMDeploymentSpec
from servefleet.cli import engine_cmd
from servefleet.engine.config import EngineConfig
from servefleet.engine.kernels.cpu_small_gemm import CpuSmallGemm
from servefleet.engine.kernels.packed_weights import BLOCK_K, BlockQuantized, PackedFormat, pack
from servefleet.engine.model.loader import QuantizationSettingsError, load_model
from servefleet.engine.model.quantize import own_copies, quantize_int4, quantize_int8
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


def test_cli_spells_the_api_flag_and_choices() -> None:
    assert engine_cmd.QUANTIZATION_FLAG == load_quantization.QUANTIZATION_FLAG
    assert engine_cmd.LOAD_QUANTIZATIONS == load_quantization.LOAD_QUANTIZATIONS


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
