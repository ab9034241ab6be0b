"""One entry point from a model source (GGUF file, HF folder, built-in name) to a ready model."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from servefleet.engine.attention import PagedAttention
from servefleet.engine.kernels.packed_weights import PackedWeight
from servefleet.engine.memory import touch_pages
from servefleet.engine.model.config import ModelConfig
from servefleet.engine.model.conversion_cache import (
    Checkpoint,
    ConversionProgress,
    default_cache_root,
    entry_dir,
    read_entry,
    write_entry,
)
from servefleet.engine.model.int4_checkpoints import int4_layers, int4_method
from servefleet.engine.model.llama import LlamaForCausalLM
from servefleet.engine.model.quantize import quantize_checkpoint, quantize_into, read_quantized
from servefleet.engine.model.safetensors_loader import (
    TensorFiles,
    config_from_hf_folder,
    read_json,
    read_safetensors_weights,
    safetensors_files,
)
from servefleet.engine.model.weights import (
    FusedProjections,
    dense_from_packed,
    fuse_hf_weights,
    fuse_packed_weights,
    packed_sources,
)
from servefleet.text.builtin import BUILTIN_MODELS, UnknownModelError, resolve_builtin
from servefleet.text.gguf_metadata import gguf_chat_template
from servefleet.text.hf_folder import hf_chat_template
from servefleet.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class QuantizationSettingsError(ValueError):
    """Quantization at load asked of a model that cannot hold packed weights."""


_GGUF_MAGIC = b"GGUF"


@dataclass
class LoadedModel:
    """A model ready to run, with what the server needs to talk to it."""

    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: Tokenizer
    chat_template: str | None
    name: str


def load_model(
    source: str,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    *,
    attn_impl: PagedAttention | None = None,
    max_positions: int | None = None,
    cache_root: Path | None = None,
    use_cache: bool = True,
    packed_weights: bool = True,
    quantization: str | None = None,
    shard: Callable[[Checkpoint], Checkpoint] | None = None,
) -> LoadedModel:
    """Load `source`: a .gguf file, a Hugging Face folder, or a built-in model name.

    `packed_weights`: hold a quantized checkpoint's projections as their 4-8-bit blocks
    for the packed CPU matmuls, instead of float32 (float32 CPU models only; the same
    results from 3.5-5x fewer bytes). Otherwise they are dequantized here.
    `quantization` (int8, int4): quantize the float projections at load into packed blocks
    (needs packed weights on a float32 CPU model), each weight as it is read.
    `shard`: keep only this process's share of the checkpoint (tensor parallelism).
    """
    if quantization is not None:
        _check_quantizable(quantization, dtype, device, packed_weights)
    checkpoint = read_checkpoint(
        source, cache_root=cache_root, use_cache=use_cache, quantization=quantization
    )
    if shard is not None:
        checkpoint = shard(checkpoint)
    return model_from_checkpoint(
        checkpoint,
        dtype,
        device,
        attn_impl=attn_impl,
        max_positions=max_positions,
        packed_weights=packed_weights,
        quantization=quantization,
    )


def model_from_checkpoint(
    checkpoint: Checkpoint,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    *,
    attn_impl: PagedAttention | None = None,
    max_positions: int | None = None,
    packed_weights: bool = True,
    quantization: str | None = None,
) -> LoadedModel:
    """A ready model from a read checkpoint (see `load_model` for the options)."""
    # Built on the meta device: parameters are adopted from the checkpoint, never allocated twice.
    model = LlamaForCausalLM(
        checkpoint.config, attn_impl, max_positions=max_positions, dtype=dtype, device="meta"
    )
    keep_packed = _holds_packed(dtype, device, packed_weights)
    if quantization is not None:
        _check_quantizable(quantization, dtype, device, packed_weights)
        quantize_checkpoint(checkpoint, quantization)  # what reading left in float (if any)
    if keep_packed:
        model.load_weights(checkpoint.weights, device=device, packed=checkpoint.packed)
    else:
        dense = dense_from_packed(checkpoint.config, checkpoint.packed)
        model.load_weights({**checkpoint.weights, **dense}, device=device)
    model.eval()
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        touch_pages(tensor)  # mapped weights resident now, not as tokens first appear
    return LoadedModel(
        model=model,
        config=checkpoint.config,
        tokenizer=checkpoint.tokenizer,
        chat_template=checkpoint.chat_template,
        name=checkpoint.name,
    )


def _holds_packed(dtype: torch.dtype, device: str, packed_weights: bool) -> bool:
    return packed_weights and dtype == torch.float32 and torch.device(device).type == "cpu"


def _check_quantizable(quantization: str, dtype: torch.dtype, device: str, packed: bool) -> None:
    """Refuse before reading anything: quantized weights need a model that holds them."""
    if not _holds_packed(dtype, device, packed):
        raise QuantizationSettingsError(
            f"quantization {quantization} needs packed weights on a float32 CPU model, "
            f"not {dtype} on {device} with packed weights {'on' if packed else 'off'}"
        )


def read_checkpoint(
    source: str,
    *,
    cache_root: Path | None = None,
    use_cache: bool = True,
    quantization: str | None = None,
) -> Checkpoint:
    """Weights (HF names), config, tokenizer and template for `source`, without a model.

    `quantization`: quantize the float projections while reading them (a warm GGUF cache
    entry, a safetensors folder), so their float32 copies never all exist at once.
    """
    path = Path(source).expanduser()
    if source in BUILTIN_MODELS and not path.exists():
        checkpoint = _read_gguf(resolve_builtin(source), cache_root, use_cache, quantization)
        checkpoint.name = source
        return checkpoint
    if path.is_file():
        with path.open("rb") as handle:
            if handle.read(4) != _GGUF_MAGIC:
                raise UnknownModelError(f"{path} is not a GGUF file")
        return _read_gguf(path, cache_root, use_cache, quantization)
    if path.is_dir():
        return _read_hf_folder(path, quantization)
    raise UnknownModelError(
        f"unknown model {source!r}: not a file or folder, and not a built-in "
        f"(built-ins: {', '.join(sorted(BUILTIN_MODELS))})"
    )


def _read_gguf(
    path: Path, cache_root: Path | None, use_cache: bool, quantization: str | None = None
) -> Checkpoint:
    directory = entry_dir(cache_root or default_cache_root(), path) if use_cache else None
    if directory is not None:
        cached = read_entry(directory)
        if cached is not None and quantization is not None:
            # read_entry maps the file without touching it; drop that mapping and stream
            # the weights instead, so quantizing leaves no page of them resident.
            files = TensorFiles([directory / "weights.safetensors"])
            cached.weights = {}
            cached.weights = read_quantized(cached.config, files, cached.packed, quantization)
        if cached is not None:
            return cached
    # A conversion holds every float32 tensor anyway (to write the cache); quantizing
    # then happens in memory (`model_from_checkpoint`).
    # Imported on a cache miss only: `gguf` costs a noticeable share of a warm start.
    from servefleet.engine.model.gguf_loader import (
        GGUFBlocks,
        config_from_gguf,
        open_gguf,
        read_gguf_weights,
    )

    reader = open_gguf(path)
    config = config_from_gguf(reader)
    blocks = GGUFBlocks(reader, config)
    progress = ConversionProgress(path, len(reader.tensors) + len(blocks))
    blocks.on_tensor = progress.step
    # Packed first: the tensors they cover are never dequantized to float32.
    packed = fuse_packed_weights(config, blocks)
    skip = packed_sources(config, packed)
    checkpoint = Checkpoint(
        config=config,
        weights=fuse_hf_weights(
            config, read_gguf_weights(reader, config, progress.step, skip=skip), packed
        ),
        tokenizer=Tokenizer.from_gguf_fields(reader.fields),
        chat_template=gguf_chat_template(reader.fields),
        name=path.stem,
        packed=packed,
    )
    if directory is not None:
        try:
            write_entry(directory, path, checkpoint)
        except OSError as exc:  # the cache only saves time; serving goes on without it
            logger.warning("could not cache converted %s in %s: %s", path, directory, exc)
            directory = None
    progress.done(directory)
    return checkpoint


def _read_hf_folder(folder: Path, quantization: str | None = None) -> Checkpoint:
    config = config_from_hf_folder(folder)
    tokenizer = Tokenizer.from_hf_folder(folder)
    prequantized = read_json(folder / "config.json").get("quantization_config") is not None
    if quantization is not None and not prequantized:
        # Each projection read, fused, quantized and released before the next is read.
        files = TensorFiles(safetensors_files(folder))
        packed: dict[str, PackedWeight] = {}
        quantize_into(config, FusedProjections(config, files), packed, quantization)
        fused = fuse_hf_weights(config, files, packed)
        logger.info("quantized %d weights at load to %s (streamed)", len(packed), quantization)
    else:
        weights = read_safetensors_weights(folder)
        packed = _int4_packed(folder, config, weights)
        fused = fuse_hf_weights(config, weights, packed)
    return Checkpoint(
        config=config,
        weights=fused,
        tokenizer=tokenizer,
        chat_template=hf_chat_template(folder),
        name=folder.name,
        packed=packed,
    )


def _int4_packed(
    folder: Path, config: ModelConfig, weights: dict[str, torch.Tensor]
) -> dict[str, PackedWeight]:
    """An AWQ/GPTQ checkpoint's layers packed (their parts leave `weights`); a quantized
    layer that fuses into no packed projection goes back into `weights` as float32."""
    quantization_config = read_json(folder / "config.json").get("quantization_config")
    if quantization_config is None or int4_method(quantization_config) is None:
        return {}
    layers = int4_layers(weights, quantization_config)
    packed = fuse_packed_weights(config, layers)
    covered = packed_sources(config, packed)
    weights.update({n: layer.dequantize() for n, layer in layers.items() if n not in covered})
    return packed
