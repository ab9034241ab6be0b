"""Convert-once cache for GGUF checkpoints.

Reading GGUF metadata and dequantizing every tensor costs seconds on a small CPU; the
float32 result, the rebuilt tokenizer and the config are stored as plain files (safetensors,
`tokenizer.json`, JSON) so the next start only memory-maps them. Entries are keyed by the
source file's identity (resolved path, size, mtime, a content sample) and the converter
version, and are published with an atomic rename, so concurrent starts never see half an
entry. A conversion (minutes for a 7B model) logs progress lines; a cache hit logs nothing.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from pydantic import BaseModel
from safetensors.torch import load_file, save_file

from servefleet.engine.kernels.packed_weights import PackedWeight, packed_from_tensors
from servefleet.engine.model.config import ModelConfig
from servefleet.text.tokenizer import Tokenizer

# Bump whenever the conversion's output changes (names, un-permutation, tokenizer build,
# packed weights).
CONVERTER_VERSION = 4
_FORMATS_SUFFIX = ".formats"  # packed.safetensors: a weight's group formats beside its bytes
CACHE_DIR_ENV = "SERVEFLEET_CACHE_DIR"
_SAMPLE_BYTES = 1 << 20

logger = logging.getLogger(__name__)


@dataclass
class Checkpoint:
    """A model's fused state dict (`fuse_hf_weights`) with everything needed to serve it;
    the weights in `packed` are absent from `weights`."""

    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    chat_template: str | None
    name: str
    # Quantized forms of some weights for the packed CPU matmuls (`fuse_packed_weights`).
    packed: dict[str, PackedWeight] = field(default_factory=dict)


class PackedMeta(BaseModel):
    k: int
    n: int


class CacheEntryMeta(BaseModel):
    converter_version: int
    source: str
    name: str
    chat_template: str | None
    packed: dict[str, PackedMeta] = {}


def default_cache_root() -> Path:
    configured = os.environ.get(CACHE_DIR_ENV)
    return Path(configured) if configured else Path.home() / ".cache" / "servefleet"


def source_key(path: Path) -> str:
    """Identity of a source file: cheap to compute, changes when the file does."""
    resolved = path.resolve()
    stat = resolved.stat()
    digest = hashlib.sha256()
    digest.update(f"v{CONVERTER_VERSION}|{resolved}|{stat.st_size}|{stat.st_mtime_ns}|".encode())
    with resolved.open("rb") as handle:
        digest.update(handle.read(_SAMPLE_BYTES))
        if stat.st_size > 2 * _SAMPLE_BYTES:
            handle.seek(-_SAMPLE_BYTES, os.SEEK_END)
            digest.update(handle.read(_SAMPLE_BYTES))
    return digest.hexdigest()[:32]


def entry_dir(cache_root: Path, source: Path) -> Path:
    return cache_root / "converted" / source_key(source)


def read_entry(directory: Path) -> Checkpoint | None:
    """The cached checkpoint, or None when absent or written by another converter version."""
    meta_path = directory / "meta.json"
    if not meta_path.is_file():
        return None
    meta = CacheEntryMeta.model_validate_json(meta_path.read_text(encoding="utf-8"))
    if meta.converter_version != CONVERTER_VERSION:
        return None
    config = ModelConfig.model_validate_json((directory / "config.json").read_text("utf-8"))
    packed_tensors = load_file(str(directory / "packed.safetensors")) if meta.packed else {}
    return Checkpoint(
        config=config,
        weights=load_file(str(directory / "weights.safetensors")),
        tokenizer=Tokenizer.load(directory),
        chat_template=meta.chat_template,
        name=meta.name,
        packed={
            name: packed_from_tensors(
                m.k, m.n, packed_tensors[name], packed_tensors[name + _FORMATS_SUFFIX]
            )
            for name, m in meta.packed.items()
        },
    )


def write_entry(directory: Path, source: Path, checkpoint: Checkpoint) -> None:
    """Write into a temporary sibling, then rename into place (first writer wins)."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}-", dir=directory.parent))
    try:
        weights = {k: v.contiguous() for k, v in checkpoint.weights.items()}
        save_file(weights, str(staging / "weights.safetensors"))
        if checkpoint.packed:
            packed = {k: v.data.contiguous() for k, v in checkpoint.packed.items()}
            packed |= {k + _FORMATS_SUFFIX: v.formats for k, v in checkpoint.packed.items()}
            save_file(packed, str(staging / "packed.safetensors"))
        (staging / "config.json").write_text(checkpoint.config.model_dump_json(), "utf-8")
        checkpoint.tokenizer.save(staging)
        meta = CacheEntryMeta(
            converter_version=CONVERTER_VERSION,
            source=str(source),
            name=checkpoint.name,
            chat_template=checkpoint.chat_template,
            packed={k: PackedMeta(k=v.k, n=v.n) for k, v in checkpoint.packed.items()},
        )
        # meta.json last: its presence marks a complete entry.
        (staging / "meta.json").write_text(meta.model_dump_json(), "utf-8")
        try:
            os.rename(staging, directory)
        except OSError:
            if not (directory / "meta.json").is_file():
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


class ConversionProgress:
    """Progress lines for one GGUF conversion: a first line, one every `interval_s` while
    tensors are converted, a last one with the time taken. Counted in tensor steps (each
    tensor of the file once, and a packed one once more for its blocks)."""

    def __init__(
        self,
        source: Path,
        total_steps: int,
        *,
        interval_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.source = source
        self.total_steps = max(1, total_steps)
        self.steps = 0
        self._interval_s = interval_s
        self._clock = clock
        self._started = clock()
        self._last_line = self._started
        size_mb = source.stat().st_size / 1e6 if source.exists() else 0.0
        logger.info(
            "converting: source=%s size_mb=%.0f (first start only; the result is cached)",
            source,
            size_mb,
        )

    def step(self) -> None:
        self.steps += 1
        now = self._clock()
        if now - self._last_line >= self._interval_s and self.steps < self.total_steps:
            self._last_line = now
            logger.info(
                "converting: %d%% (%d/%d tensor steps) elapsed_s=%.0f",
                100 * self.steps // self.total_steps,
                self.steps,
                self.total_steps,
                now - self._started,
            )

    def done(self, cached_in: Path | None) -> None:
        logger.info(
            "converted: source=%s seconds=%.1f cached_in=%s",
            self.source,
            self._clock() - self._started,
            cached_in if cached_in is not None else "-",
        )
