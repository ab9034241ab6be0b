"""Hugging Face checkpoint folders: `config.json` plus one or many `*.safetensors` files."""

from __future__ import annotations

import json
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
