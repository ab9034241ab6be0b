"""What two engines must share for one's KV blocks to be the other's, bit for bit.

A KV block moved between engines is only correct if both run the same model with the same
numerics into the same cache layout: the fingerprint is sha256 over a canonical JSON of
exactly that (model identity, dtypes, cache layout and shape, the kernels that write KV),
and an import whose fingerprint differs is refused, never converted. The model's identity
hashes its config, tokenizer size and a sample of every weight's bytes, but no path or
mtime, so two pods that loaded the same checkpoint from different places agree.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

from servefleet.engine.kv_quant import row_width
from servefleet.engine.model.loader import LoadedModel

LAYOUT = "L2NBHR-v1"  # storage [layers, 2 (k, v), blocks, block_size, kv_heads, row]
_SAMPLE_BYTES = 256  # of each weight tensor: enough to tell checkpoints apart, cheap to read


def model_digest(loaded: LoadedModel) -> str:
    """sha256 of the config, the vocabulary size and every parameter's name, shape, dtype
    and first bytes (weights after any load-time quantization, as they run)."""
    digest = hashlib.sha256()
    digest.update(loaded.config.model_dump_json().encode())
    digest.update(str(loaded.tokenizer.vocab_size).encode())
    tensors = {**dict(loaded.model.named_parameters()), **dict(loaded.model.named_buffers())}
    for name in sorted(tensors):
        tensor = tensors[name].detach()
        digest.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}|".encode())
        flat = tensor.reshape(-1)[: _SAMPLE_BYTES // max(1, tensor.element_size())]
        digest.update(flat.cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def fingerprint_fields(
    loaded: LoadedModel, kv_dtype: torch.dtype, block_size: int, settings: dict[str, Any]
) -> dict[str, Any]:
    """The canonical description a fingerprint hashes (also served by /internal/kv/info).

    `settings`: the engine flags that change the bits KV is computed with (matmul dtype,
    packed weights, load quantization)."""
    model = loaded.model
    config = loaded.config
    weights = next(model.parameters())
    kernel = model.attn_impl.decode_kernel
    return {
        "layout": LAYOUT,
        "model_digest": model_digest(loaded),
        "weights_dtype": str(weights.dtype).removeprefix("torch."),
        "device_type": weights.device.type,
        "kv_cache_dtype": str(kv_dtype).removeprefix("torch."),
        "block_size": block_size,
        "num_layers": config.num_layers,
        "num_kv_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "row_width": row_width(config.head_dim, kv_dtype),
        "numerics": {
            "decode_kernel": getattr(kernel, "__name__", type(kernel).__name__),
            "matmul": model.matmul.name,
            "fused_ops": getattr(model, "fused_ops", None) is not None,
            **settings,
        },
    }


def kv_fingerprint(fields: dict[str, Any]) -> str:
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()
