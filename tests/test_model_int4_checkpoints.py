"""AWQ and GPTQ 4-bit checkpoints: read packed, multiplied as the format defines them.

Synthetic layers (random nibbles, zeros and float16 scales) are packed the way AutoAWQ
(GEMM: 8 output columns a word in the order 0 2 4 6 1 3 5 7) and AutoGPTQ (8 input rows a
word; zeros stored minus one in the v1 format) write them; the test dequantizes them with
the format's own formula, w = scale × (q - zero), and the packed matmul must equal the
dense matmul on those weights. A whole tiny model saved as AWQ must load packed and give
the logits of the same model saved as its dequantized float weights.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from servefleet.engine.attention import AttentionMetadata, PrefillSpan
from servefleet.engine.kernels.cpu_small_gemm import CpuSmallGemm
from servefleet.engine.kernels.packed_weights import BlockQuantized, PackedFormat, pack
from servefleet.engine.model.int4_checkpoints import (
    AWQ_ORDER,
    Int4CheckpointError,
    awq_layer,
    gptq_layer,
)
from servefleet.engine.model.kv_layout import allocate_kv_cache
from servefleet.engine.model.loader import LoadedModel, load_model
from tests.test_model_safetensors import CASES, _save_checkpoint
from tests.test_small_gemm import gemm  # noqa: F401  (the fixture: every kernel build)

IN, OUT = 256, 48


def random_layer(
    in_features: int, out_features: int, group: int, seed: int
) -> tuple[np.ndarray, np.ndarray, torch.Tensor]:
    """q [in, out] and zeros [groups, out] in 0..15, float16 scales [groups, out]."""
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 16, (in_features, out_features), dtype=np.uint32)
    zeros = rng.integers(0, 16, (in_features // group, out_features), dtype=np.uint32)
    scales = torch.from_numpy(rng.uniform(0.001, 0.05, zeros.shape).astype(np.float16))
    return q, zeros, scales


def reference(q: np.ndarray, zeros: np.ndarray, scales: torch.Tensor) -> torch.Tensor:
    """The formats' dequantization: w[i, j] = scale[g(i), j] × (q[i, j] - zero[g(i), j])."""
    group = q.shape[0] // zeros.shape[0]
    z = np.repeat(zeros.astype(np.float32), group, axis=0)
    s = np.repeat(scales.float().numpy(), group, axis=0)
    return torch.from_numpy(s * (q.astype(np.float32) - z))  # [in, out]


def pack_words(values: np.ndarray, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """[r, c] nibbles -> int32 [r, c / 8]: nibble i of word w holds column 8w + order[i]."""
    grouped = values.reshape(values.shape[0], -1, 8)[..., list(order)].astype(np.uint32)
    words = (grouped << np.arange(0, 32, 4, dtype=np.uint32)).sum(axis=-1, dtype=np.uint32)
    return torch.from_numpy(words.view(np.int32))


def awq_tensors(q: np.ndarray, zeros: np.ndarray, scales: torch.Tensor) -> dict[str, torch.Tensor]:
    return {
        "qweight": pack_words(q, AWQ_ORDER),
        "qzeros": pack_words(zeros, AWQ_ORDER),
        "scales": scales,
    }


def gptq_tensors(
    q: np.ndarray, zeros: np.ndarray, scales: torch.Tensor, stored_zero_offset: int
) -> dict[str, torch.Tensor]:
    group = q.shape[0] // zeros.shape[0]
    return {
        "qweight": pack_words(q.T).t().contiguous(),  # rows packed: [in / 8, out]
        "qzeros": pack_words((zeros - stored_zero_offset) & 15),
        "scales": scales,
        "g_idx": torch.arange(q.shape[0], dtype=torch.int32) // group,
    }


def assert_packed_mm_is_the_reference(
    gemm: CpuSmallGemm,  # noqa: F811
    layer: BlockQuantized,
    dense: torch.Tensor,
) -> None:
    assert layer.format == PackedFormat.Q4
    packed = pack(layer)
    assert torch.equal(gemm.unpack(packed), dense)  # exact: scale × q and scale × zero are
    x = torch.randn(9, dense.shape[0], generator=torch.Generator().manual_seed(1))
    for m in (1, 4, 9):
        assert torch.equal(gemm.packed_mm(x[:m].contiguous(), packed), gemm.mm(x[:m], dense))
    torch.testing.assert_close(gemm.packed_mm(x, packed), x @ dense, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("group", [32, 128])
def test_awq_gemm_layer_multiplies_as_dequantized(gemm: CpuSmallGemm, group: int) -> None:  # noqa: F811
    q, zeros, scales = random_layer(IN, OUT, group, seed=group)
    layer = awq_layer(awq_tensors(q, zeros, scales), {"group_size": group, "version": "gemm"})
    assert_packed_mm_is_the_reference(gemm, layer, reference(q, zeros, scales))


@pytest.mark.parametrize(("checkpoint_format", "offset"), [("gptq", 1), ("gptq_v2", 0)])
def test_gptq_layer_multiplies_as_dequantized(
    gemm: CpuSmallGemm,  # noqa: F811
    checkpoint_format: str,
    offset: int,
) -> None:
    q, zeros, scales = random_layer(IN, OUT, 64, seed=offset)
    zeros = np.clip(zeros, offset, 15)  # a v1 file cannot store zero 0 (stored as zero - 1)
    tensors = gptq_tensors(q, zeros, scales, stored_zero_offset=offset)
    layer = gptq_layer(tensors, {"group_size": 64, "checkpoint_format": checkpoint_format})
    assert_packed_mm_is_the_reference(gemm, layer, reference(q, zeros, scales))


def test_unsupported_layouts_are_refused_by_name() -> None:
    q, zeros, scales = random_layer(IN, OUT, 64, seed=3)
    tensors = gptq_tensors(q, zeros, scales, stored_zero_offset=0)
    tensors["g_idx"] = tensors["g_idx"][torch.randperm(IN, generator=torch.Generator())]
    with pytest.raises(Int4CheckpointError, match="act-order"):
        gptq_layer(tensors, {"group_size": 64, "desc_act": True})
    with pytest.raises(Int4CheckpointError, match="gemv"):
        awq_layer(awq_tensors(q, zeros, scales), {"group_size": 64, "version": "gemv"})
    with pytest.raises(Int4CheckpointError, match="group_size 48"):
        awq_layer(awq_tensors(q, zeros, scales), {"group_size": 48})


LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_awq_twin(float_dir: Path, awq_dir: Path, group: int) -> None:
    """Replace every projection of `float_dir` with a random AWQ layer: `awq_dir` holds
    it packed (with quantization_config), `float_dir` its reference dequantization."""
    shutil.copytree(float_dir, awq_dir)
    (awq_dir / "model.safetensors").unlink()
    weights = load_file(str(float_dir / "model.safetensors"))
    quantized: dict[str, torch.Tensor] = {}
    for index, name in enumerate(sorted(n for n in weights if n.endswith("proj.weight"))):
        out_features, in_features = weights[name].shape
        q, zeros, scales = random_layer(in_features, out_features, group, seed=index)
        weights[name] = reference(q, zeros, scales).t().contiguous()
        prefix = name.removesuffix(".weight")
        quantized |= {f"{prefix}.{k}": v for k, v in awq_tensors(q, zeros, scales).items()}
    floats = {n: w for n, w in weights.items() if not n.endswith("proj.weight")}
    save_file(weights, str(float_dir / "model.safetensors"))
    save_file(floats | quantized, str(awq_dir / "model.safetensors"))
    config = json.loads((awq_dir / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "awq", "bits": 4, "group_size": group, "version": "gemm", "zero_point": True
    }  # fmt: skip
    (awq_dir / "config.json").write_text(json.dumps(config))


def prefill_logits(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    kv = allocate_kv_cache(loaded.model.config, math.ceil(len(ids) / 4), 4, torch.float32, "cpu")
    table = torch.arange(math.ceil(len(ids) / 4))
    positions = torch.arange(len(ids))
    meta = AttentionMetadata(
        table[positions // 4] * 4 + positions % 4,
        4,
        prefills=[PrefillSpan(0, len(ids), 0, table)],
    )
    with torch.inference_mode():
        return loaded.model.compute_logits(loaded.model(torch.tensor(ids), positions, kv, meta))


def test_awq_model_loads_packed_with_the_dequantized_logits(tmp_path: Path) -> None:
    config_class, extra = CASES["llama-linear-rope-bias-tied"]
    extra = {**extra, "hidden_size": 64, "intermediate_size": 128}  # inputs: multiples of 32
    _save_checkpoint(tmp_path / "float", config_class, extra)
    write_awq_twin(tmp_path / "float", tmp_path / "awq", group=32)
    packed = load_model(str(tmp_path / "awq"))
    dense = load_model(str(tmp_path / "float"))
    layers = packed.config.num_layers
    assert packed.model.packed_summary()["tensors"] == 4 * layers  # lm_head: float embedding
    assert not any("proj" in n or "_weight" in n for n, _ in packed.model.named_parameters())
    ids = list(range(3, 40))
    torch.testing.assert_close(
        prefill_logits(packed, ids), prefill_logits(dense, ids), rtol=1e-4, atol=1e-4
    )
    with pytest.raises(ValueError, match="not supported"):
        config = json.loads((tmp_path / "awq" / "config.json").read_text())
        config["quantization_config"]["quant_method"] = "bitsandbytes"
        (tmp_path / "awq" / "config.json").write_text(json.dumps(config))
        load_model(str(tmp_path / "awq"))
