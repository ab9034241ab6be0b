"""The engine's KV-cache storage types and the /metrics names that describe its capacity.

Shared by the engine's settings, its CLI and its metrics, so a cache dtype and the series
that report it are spelled once.
"""

from __future__ import annotations

from typing import Literal, get_args

KVCacheDtype = Literal["auto", "float32", "float16", "bfloat16", "int8"]
"""`--kv-cache-dtype`: auto is the model's dtype; int8 stores keys and values quantized."""

KV_CACHE_DTYPES: tuple[str, ...] = get_args(KVCacheDtype)

KV_CACHE_BYTES_PER_TOKEN_METRIC = "servefleet_engine_kv_cache_bytes_per_token"
"""Bytes one token takes in the cache over every layer (keys, values and any scales)."""

KV_CACHE_DTYPE_LABEL = "cache_dtype"
"""Label of the bytes-per-token series: the storage dtype (float32, float16, int8, ...)."""
