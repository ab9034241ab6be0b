"""KV-cache sizing: what max_num_seqs x max_model_len needs, capped by --kv-cache-memory."""

from __future__ import annotations

import pytest
import torch

from servefleet.engine.config import EngineConfig
from servefleet.engine.kv_budget import MIN_BLOCKS, blocks_needed, kv_cache_blocks
from servefleet.engine.model.kv_layout import kv_bytes_per_block
from servefleet.engine.model.loader import LoadedModel
from servefleet.engine.process import build_engine
from tests.support.engine_harness import running_engine

PER_BLOCK = 1000  # bytes, for the pure rule


def test_the_need_caps_a_large_budget() -> None:
    # 4 sequences of 2048 tokens: 4 x 128 blocks of 16, not the 10 000 the budget holds.
    assert kv_cache_blocks(10_000 * PER_BLOCK, PER_BLOCK, 16, 4, 2048) == 512


def test_the_budget_caps_a_large_need() -> None:
    assert kv_cache_blocks(300 * PER_BLOCK + 999, PER_BLOCK, 16, 64, 8192) == 300


def test_a_partial_block_counts_whole() -> None:
    assert blocks_needed(max_num_seqs=3, max_model_len=100, block_size=16) == 3 * 7
    assert kv_cache_blocks(10**9, PER_BLOCK, 16, 3, 100) == 21


def test_never_fewer_than_the_engine_minimum() -> None:
    assert kv_cache_blocks(10**9, PER_BLOCK, 256, 1, 16) == MIN_BLOCKS


def test_bytes_per_block_must_be_positive() -> None:
    with pytest.raises(ValueError, match="bytes_per_block"):
        kv_cache_blocks(10**9, 0, 16, 1, 16)


def test_the_engine_reserves_only_what_its_concurrency_needs(smollm2: LoadedModel) -> None:
    with running_engine(
        smollm2, kv_cache_memory="1GiB", max_num_seqs=2, max_model_len=256
    ) as built:
        assert built.kv_cache.num_blocks == 2 * 256 // 16
        key_cache = built.engine.runner.kv_caches[0][0]
        assert key_cache.shape[0] == 32  # the allocation itself, not only the block count


def test_the_default_budget_holds_one_whole_default_context(smollm2: LoadedModel) -> None:
    """The default cap (peak RSS ≤ 1.5 GB on SmolLM2) still fits one full-length sequence."""
    config = EngineConfig(model="smollm2-135m-instruct", device="cpu")
    built = build_engine(config, smollm2)
    assert built.kv_cache.num_blocks * 16 >= built.state.max_model_len
    assert built.state.max_model_len == 8192  # the model's own context
    assert built.kv_cache.num_blocks == (384 << 20) // kv_bytes_per_block(
        smollm2.config, 16, torch.float32
    )
