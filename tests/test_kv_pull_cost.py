"""When an engine pulls a prefix's KV instead of recomputing it: measured rates decide."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from servefleet.api.ewma import Ewma
from servefleet.engine.kv_puller import worth_pulling

BLOCK_BYTES = 737_280  # SmolLM2, float32, 16 tokens


def _store(pull_bytes_per_s: float | None) -> Any:
    rate = Ewma(0.0)
    if pull_bytes_per_s is not None:
        rate.update(pull_bytes_per_s)
    return SimpleNamespace(bytes_per_block=BLOCK_BYTES, block_size=16, pull_rate=rate)


def _prompt_rate(tokens_per_s: float | None) -> Ewma:
    rate = Ewma(0.0)
    if tokens_per_s is not None:
        rate.update(tokens_per_s)
    return rate


def test_unmeasured_rates_pull_to_learn() -> None:
    assert worth_pulling(_prompt_rate(None), _store(150e6), 100)
    assert worth_pulling(_prompt_rate(50_000), _store(None), 100)


def test_a_cpu_pulls_and_a_fast_gpu_recomputes() -> None:
    # a 2-core CPU prefills ~400 tokens/s: 40 ms a block against ~5 ms to pull it
    assert worth_pulling(_prompt_rate(400), _store(150e6), 128)
    # an H200 prefilled SmolLM2 at ~46k tokens/s (kv_gpu_check): 0.35 ms a block against
    # ~1.8 ms through host memory and HTTP at 400 MB/s
    assert not worth_pulling(_prompt_rate(46_000), _store(400e6), 128)
