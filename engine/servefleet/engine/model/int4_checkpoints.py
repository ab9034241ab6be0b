"""AWQ and GPTQ 4-bit safetensors checkpoints -> `BlockQuantized` Q4, kept packed.

Both store a linear layer as `qweight` (int32, 8 nibbles each), `qzeros` (int32, 8
nibbles) and `scales` (float16) per group of `group_size` inputs, and dequantize as
w = scale × (q - zero). That is the packed Q4 format exactly: scale × q + min with
min = -(scale × zero); both products are exact in float32 (an 11-bit scale times a
4-bit integer), so their sum is scale × (q - zero) bit for bit.

- AWQ (AutoAWQ `version: gemm`): qweight [in, out / 8], 8 output columns a word in the
  order [0, 2, 4, 6, 1, 3, 5, 7] (nibble i holds column AWQ_ORDER[i]); qzeros
  [in / group, out / 8] packed the same way; scales [in / group, out].
- GPTQ (AutoGPTQ / GPTQModel): qweight [in / 8, out], 8 input rows a word in order
  (nibble i of word r holds row 8r + i); qzeros [groups, out / 8], 8 output columns a
  word in order; scales [groups, out]; `g_idx` [in] maps inputs to groups. The "gptq"
  checkpoint format stores zero - 1 (the reader adds 1); "gptq_v2" stores zero.
  Act-order checkpoints (`desc_act`, g_idx not in input order) are refused: running them
  packed needs each projection's activations permuted, which the kernels do not do.

Group sizes must be multiples of the packed block (32 inputs); -1 (one group) works
when the input size is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from servefleet.engine.kernels.packed_weights import BLOCK_K, BlockQuantized, PackedFormat

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # column held by nibble i of an AWQ word
_NIBBLES = 8
_SHIFTS = np.arange(0, 32, 4, dtype=np.uint32)


class Int4CheckpointError(ValueError):
    """An AWQ/GPTQ checkpoint this engine cannot run packed (named in the message)."""


def _nibbles(packed: torch.Tensor) -> np.ndarray:
    """int32 [..., w] -> uint8 [..., w, 8]: nibble i of each word at index i."""
    words = packed.numpy().view(np.uint32)
    return ((words[..., None] >> _SHIFTS) & 15).astype(np.uint8)


def _config_field(config: Mapping[str, Any], key: str, default: Any) -> Any:
    value = config.get(key, default)
    return default if value is None else value


def _group_size(config: Mapping[str, Any], in_features: int) -> int:
    group = int(_config_field(config, "group_size", -1))
    group = in_features if group == -1 else group
    if group <= 0 or group % BLOCK_K or in_features % group:
        raise Int4CheckpointError(
            f"quantization_config.group_size {group} must be a multiple of {BLOCK_K} dividing "
            f"the input size {in_features}"
        )
    return group


def _to_q4(q_out_in: np.ndarray, zeros: np.ndarray, scales: np.ndarray) -> BlockQuantized:
    """q [out, in], zeros and scales [groups, out] -> Q4 with (scale, min) per 32 inputs."""
    out_features, in_features = q_out_in.shape
    groups = scales.shape[0]
    fits = zeros.shape == scales.shape and scales.shape[1] == out_features
    if not fits or in_features % groups or (in_features // groups) % BLOCK_K:
        raise Int4CheckpointError(
            f"scales {scales.shape} and zeros {zeros.shape} do not fit a weight "
            f"[{out_features}, {in_features}]"
        )
    repeat = in_features // groups // BLOCK_K
    scale = np.repeat(scales.astype(np.float32).T, repeat, axis=1)
    zero = np.repeat(zeros.astype(np.float32).T, repeat, axis=1)
    minimum = -(scale * zero)
    return BlockQuantized(PackedFormat.Q4, np.ascontiguousarray(q_out_in), scale, minimum)


def awq_layer(tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any]) -> BlockQuantized:
    """One AWQ GEMM layer (`qweight`, `qzeros`, `scales`) as packed-ready Q4."""
    version = str(_config_field(config, "version", "gemm")).lower()
    if version != "gemm":
        raise Int4CheckpointError(f"AWQ version {version!r} is not supported (only 'gemm')")
    if not _config_field(config, "zero_point", True):
        raise Int4CheckpointError("AWQ without zero_point is not supported")
    order = np.argsort(AWQ_ORDER)  # nibble that holds column j of a word

    def columns(packed: torch.Tensor) -> np.ndarray:  # [r, out / 8] -> [r, out]
        nib = _nibbles(packed)[..., order]
        return nib.reshape(packed.shape[0], -1)

    q = columns(tensors["qweight"])  # [in, out]
    _group_size(config, q.shape[0])
    zeros = columns(tensors["qzeros"])
    return _to_q4(q.T, zeros, tensors["scales"].float().numpy())


def gptq_layer(tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any]) -> BlockQuantized:
    """One GPTQ layer (`qweight`, `qzeros`, `scales`, optional `g_idx`) as packed-ready Q4."""
    qweight = tensors["qweight"]
    q = _nibbles(qweight.t().contiguous()).reshape(qweight.shape[1], -1)  # [out, in]
    in_features = q.shape[1]
    group = _group_size(config, in_features)
    g_idx = tensors.get("g_idx")
    in_order = np.arange(in_features) // group
    if g_idx is not None and not np.array_equal(g_idx.numpy().astype(np.int64), in_order):
        raise Int4CheckpointError(
            "GPTQ act-order (desc_act, g_idx not in input order) is not supported packed; "
            "use a checkpoint quantized with desc_act=false"
        )
    zeros = _nibbles(tensors["qzeros"]).reshape(tensors["qzeros"].shape[0], -1).astype(np.int32)
    if str(_config_field(config, "checkpoint_format", "gptq")).lower() == "gptq":
        zeros = zeros + 1  # the v1 format stores zero - 1
    return _to_q4(q, zeros, tensors["scales"].float().numpy())


_LAYER_READERS = {"awq": awq_layer, "gptq": gptq_layer}
_PARTS = ("qweight", "qzeros", "scales", "g_idx")


def int4_method(quantization_config: Mapping[str, Any] | None) -> str | None:
    """'awq' or 'gptq' for a checkpoint this module reads, None for a float one."""
    if not quantization_config:
        return None
    method = str(quantization_config.get("quant_method", "")).lower()
    if method not in _LAYER_READERS:
        raise Int4CheckpointError(
            f"quantization_config.quant_method {method!r} is not supported (awq, gptq)"
        )
    bits = quantization_config.get("bits", quantization_config.get("w_bit", 4))
    if int(bits) != 4:
        raise Int4CheckpointError(f"{method} with {bits} bits is not supported (4 only)")
    return method


def int4_layers(
    weights: dict[str, torch.Tensor], quantization_config: Mapping[str, Any]
) -> dict[str, BlockQuantized]:
    """Every quantized layer of `weights` as `<layer>.weight` -> Q4; its parts are removed
    from `weights`, so what remains is the float part of the checkpoint."""
    method = int4_method(quantization_config)
    assert method is not None
    reader = _LAYER_READERS[method]
    layers: dict[str, BlockQuantized] = {}
    for name in [n for n in weights if n.endswith(".qweight")]:
        prefix = name.removesuffix(".qweight")
        parts = {p: weights.pop(f"{prefix}.{p}") for p in _PARTS if f"{prefix}.{p}" in weights}
        missing = {"qzeros", "scales"} - set(parts)
        if missing:
            raise Int4CheckpointError(f"{prefix} lacks {', '.join(sorted(missing))}")
        try:
            layers[f"{prefix}.weight"] = reader(parts, quantization_config)
        except Int4CheckpointError as exc:
            raise Int4CheckpointError(f"{prefix}: {exc}") from exc
    return layers
