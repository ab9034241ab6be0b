"""Hugging Face checkpoint folders: `config.json` plus one or many `*.safetensors` files."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from servefleet.engine.model.config import ModelConfig


class CheckpointError(ValueError):
    """The folder is not a loadable Hugging Face checkpoint."""


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} does not hold a JSON object")
    return data


def config_from_hf_folder(folder: str | Path) -> ModelConfig:
    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{folder} has no config.json")
    generation_path = folder / "generation_config.json"
    generation = read_json(generation_path) if generation_path.is_file() else None
    return ModelConfig.from_hf_config(read_json(config_path), generation)


def safetensors_files(folder: str | Path) -> list[Path]:
    """The shard files, from `model.safetensors.index.json` when present."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index} has no weight_map")
        files = [folder / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder} holds no *.safetensors files")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"safetensors shards missing: {missing}")
    return files


def read_safetensors_weights(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint by HF name (in its stored dtype)."""
    weights: dict[str, torch.Tensor] = {}
    for path in safetensors_files(folder):
        weights.update(load_file(str(path)))
    return weights


_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class TensorFiles(Mapping[str, torch.Tensor]):
    """The tensors of safetensors files, each read from disk into memory of its own when
    looked up. Nothing is memory-mapped, so a tensor dropped after use (quantized at load)
    leaves no resident pages behind; file reads go through the page cache, not our RSS."""

    def __init__(self, paths: Sequence[str | Path]) -> None:
        self._entries: dict[str, tuple[Path, int, torch.dtype, list[int]]] = {}
        for path in map(Path, paths):
            with path.open("rb") as handle:
                (size,) = struct.unpack("<Q", handle.read(8))
                header = json.loads(handle.read(size))
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                if info["dtype"] not in _DTYPES:
                    raise CheckpointError(f"{path}: tensor {name} has dtype {info['dtype']}")
                begin = 8 + size + info["data_offsets"][0]
                self._entries[name] = (path, begin, _DTYPES[info["dtype"]], info["shape"])

    def __getitem__(self, name: str) -> torch.Tensor:
        path, begin, dtype, shape = self._entries[name]
        count = 1
        for dim in shape:
            count *= dim
        tensor = torch.empty(count, dtype=dtype)
        raw = tensor.view(torch.uint8)
        with path.open("rb") as handle:
            handle.seek(begin)
            if count and handle.readinto(raw.numpy().data) != raw.numel():
                raise CheckpointError(f"{path}: tensor {name} is truncated")
        return tensor.view(shape)

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)
