"""A PEFT LoRA adapter read into the decoder's fused layout, never merged into the weights.

PEFT computes `base(x) + scaling * B(A(x))` per projection, with A [r, in] and B [out, r].
The decoder runs q/k/v as one matmul and gate/up as one (`model.weights`), so each fused
projection gets one A of every adapted part side by side ([in, sum of r]: one matmul for
all parts) and per part its B, transposed and pre-multiplied by `scaling`, writing that
part's columns of the fused output. A part the adapter leaves alone costs nothing.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import ValidationError
from safetensors.torch import load as load_safetensors

from servefleet.api.lora import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    MAX_ADAPTER_CONFIG_BYTES,
    LoraConfigError,
    PeftLoraConfig,
)
from servefleet.engine.kernels.lora_layout import FIELDS, PartEntry, projection_entry
from servefleet.engine.model.config import ModelConfig
from servefleet.engine.model.weights import PROJECTIONS

_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\."
    r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.lora_([AB])(?:\.[^.]+)?\.weight$"
)


@dataclass(frozen=True)
class LoraPart:
    """One adapted HF projection inside a fused one: its rank columns of the fused A's
    output, the fused output columns it writes, and its scaled B [r, out_part]."""

    ranks: slice
    columns: slice
    b: torch.Tensor


@dataclass(frozen=True)
class LoraProjection:
    """One fused projection of one layer: x @ a gives every part's low-rank activations."""

    a: torch.Tensor  # [in, sum of the parts' ranks]
    parts: tuple[LoraPart, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.a, *(p.b for p in self.parts)))


@dataclass(frozen=True, eq=False)
class LoraAdapter:
    """A loaded adapter. `identity` changes with its files, so the prefix cache never mixes
    KV computed under two adapters (or two versions of one name)."""

    name: str
    path: str
    config: PeftLoraConfig
    identity: int
    layers: tuple[dict[str, LoraProjection], ...]  # per layer: fused projection name -> LoRA

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for layer in self.layers for p in layer.values())

    @property
    def weight_dtype(self) -> torch.dtype:
        return next(iter(p.a.dtype for layer in self.layers for p in layer.values()))

    @functools.cached_property
    def kernel_table(self) -> torch.Tensor:
        """int64 [layers, projections (`PROJECTIONS` order), FIELDS] on the weights' device:
        the addresses and shapes the LoRA kernels read (`kernels.lora_layout`)."""
        rows = [
            projection_entry(
                lora.a if lora is not None else None,
                [] if lora is None else [_part_entry(part) for part in lora.parts],
            )
            for layer in self.layers
            for lora in (layer.get(name) for name in PROJECTIONS)
        ]
        device = next(iter(p.a.device for layer in self.layers for p in layer.values()))
        table = torch.tensor(rows, dtype=torch.int64).view(
            len(self.layers), len(PROJECTIONS), FIELDS
        )
        return table.to(device)


def _part_entry(part: LoraPart) -> PartEntry:
    ranks, columns = part.ranks, part.columns
    return PartEntry(ranks.start, ranks.stop - ranks.start, columns.start,
                     columns.stop - columns.start, part.b)  # fmt: skip


def _fused_columns(config: ModelConfig) -> dict[str, tuple[str, int, int]]:
    """HF projection -> (our fused projection, first output column, width)."""
    q = config.num_heads * config.head_dim
    kv = config.num_kv_heads * config.head_dim
    inter = config.intermediate_size
    return {
        "q_proj": ("qkv_weight", 0, q),
        "k_proj": ("qkv_weight", q, kv),
        "v_proj": ("qkv_weight", q + kv, kv),
        "o_proj": ("o_weight", 0, config.hidden_size),
        "gate_proj": ("gate_up_weight", 0, inter),
        "up_proj": ("gate_up_weight", inter, inter),
        "down_proj": ("down_weight", 0, config.hidden_size),
    }


def _inputs(config: ModelConfig) -> dict[str, int]:
    attn = config.num_heads * config.head_dim
    hidden = config.hidden_size
    return {
        "qkv_weight": hidden,
        "o_weight": attn,
        "gate_up_weight": hidden,
        "down_weight": config.intermediate_size,
    }


def read_adapter_config(directory: Path) -> PeftLoraConfig:
    """The adapter's `adapter_config.json`, size-capped and validated."""
    path = directory / ADAPTER_CONFIG
    if not path.is_file():
        raise LoraConfigError(f"{directory} has no {ADAPTER_CONFIG}")
    if path.stat().st_size > MAX_ADAPTER_CONFIG_BYTES:
        raise LoraConfigError(f"{ADAPTER_CONFIG} is over {MAX_ADAPTER_CONFIG_BYTES} bytes")
    try:
        return PeftLoraConfig.model_validate(json.loads(path.read_bytes()))
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "body"
        raise LoraConfigError(f"{ADAPTER_CONFIG}: {where}: {first['msg']}") from exc
    except ValueError as exc:  # not JSON, or not UTF-8
        raise LoraConfigError(f"{ADAPTER_CONFIG} is not JSON: {exc}") from exc


def load_adapter(
    name: str,
    directory: Path,
    model: ModelConfig,
    max_rank: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> LoraAdapter:
    """Read, check and lay out one PEFT adapter; a mismatch is a `LoraConfigError` naming it."""
    config = read_adapter_config(directory)
    config.check_servable(max_rank)
    weights_path = directory / ADAPTER_WEIGHTS
    if not weights_path.is_file():
        raise LoraConfigError(f"{directory} has no {ADAPTER_WEIGHTS}")
    blob = weights_path.read_bytes()  # read once: parsed, and hashed for the identity
    try:
        tensors = load_safetensors(blob)
    except Exception as exc:  # safetensors raises its own error types for a bad header
        raise LoraConfigError(f"{ADAPTER_WEIGHTS}: not a safetensors file ({exc})") from exc
    pairs = _pairs(tensors, model, config)
    layers = tuple(
        _fuse_layer(pairs.get(index, {}), model, config.scaling, dtype, device)
        for index in range(model.num_layers)
    )
    digest = hashlib.sha256(blob + config.model_dump_json().encode()).digest()
    return LoraAdapter(
        name=name,
        path=str(directory),
        config=config,
        identity=int.from_bytes(digest[:8], "big", signed=True),
        layers=layers,
    )


def _pairs(
    tensors: dict[str, torch.Tensor], model: ModelConfig, config: PeftLoraConfig
) -> dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """layer -> HF projection -> (A [r, in], B [out, r]), shapes checked against the model."""
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise LoraConfigError(f"tensor {key!r} adapts nothing the engine serves")
        layer, module, which = int(match[1]), match[2], match[3]
        if layer >= model.num_layers:
            raise LoraConfigError(f"tensor {key!r}: the model has {model.num_layers} layers")
        found.setdefault((layer, module), {})[which] = tensor
    columns, inputs = _fused_columns(model), _inputs(model)
    pairs: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    for (layer, module), ab in sorted(found.items()):
        if set(ab) != {"A", "B"}:
            raise LoraConfigError(f"layer {layer} {module}: lora_A and lora_B come in pairs")
        a, b = ab["A"], ab["B"]
        fused, _, width = columns[module]
        want_a, want_b = (config.r, inputs[fused]), (width, config.r)
        if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
            raise LoraConfigError(
                f"layer {layer} {module}: lora_A {list(a.shape)} and lora_B {list(b.shape)} "
                f"do not fit the model (want {list(want_a)} and {list(want_b)})"
            )
        pairs.setdefault(layer, {})[module] = (a, b)
    if not pairs:
        raise LoraConfigError(f"{ADAPTER_WEIGHTS} holds no LoRA weights")
    return pairs


def _fuse_layer(
    parts: dict[str, tuple[torch.Tensor, torch.Tensor]],
    model: ModelConfig,
    scaling: float,
    dtype: torch.dtype,
    device: torch.device | str,
) -> dict[str, LoraProjection]:
    """One layer's adapted HF projections grouped into our fused ones (q/k/v, gate/up)."""
    columns = _fused_columns(model)
    grouped: dict[str, list[tuple[str, torch.Tensor, torch.Tensor]]] = {}
    for module, (a, b) in parts.items():
        grouped.setdefault(columns[module][0], []).append((module, a, b))
    fused: dict[str, LoraProjection] = {}
    for name, members in grouped.items():
        members.sort(key=lambda m: columns[m[0]][1])
        a_parts, lora_parts, rank0 = [], [], 0
        for module, a, b in members:
            _, first, width = columns[module]
            rank = a.shape[0]
            a_parts.append(a.t())
            scaled = (b.t().to(torch.float64) * scaling).to(dtype=dtype, device=device)
            scaled = scaled.contiguous()  # the kernels read B [r, width] row by row
            lora_parts.append(
                LoraPart(slice(rank0, rank0 + rank), slice(first, first + width), scaled)
            )
            rank0 += rank
        a_fused = torch.cat(a_parts, dim=1).to(dtype=dtype, device=device).contiguous()
        fused[name] = LoraProjection(a_fused, tuple(lora_parts))
    return fused
