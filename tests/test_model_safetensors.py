"""Tiny random-weight HF checkpoints (saved by transformers) through our safetensors loader."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models

from servefleet.engine.attention import AttentionMetadata, PrefillSpan
from servefleet.engine.model.config import ModelConfig
from servefleet.engine.model.kv_layout import allocate_kv_cache, kv_bytes_per_block
from servefleet.engine.model.llama import LlamaForCausalLM
from servefleet.engine.model.loader import load_model
from servefleet.engine.model.safetensors_loader import CheckpointError, read_safetensors_weights

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

BLOCK = 4
BASE: dict[str, Any] = {
    "vocab_size": 97,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3-rope-untied": (
        "LlamaConfig",
        {
            "tie_word_embeddings": False,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        },
    ),
    "llama-linear-rope-bias-tied": (
        "LlamaConfig",
        {
            "tie_word_embeddings": True,
            "attention_bias": True,
            "rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
        },
    ),
    "qwen2-yarn": (
        "Qwen2Config",
        {
            "tie_word_embeddings": True,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 1000000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        },
    ),
    "qwen2-untied": ("Qwen2Config", {"tie_word_embeddings": False}),
    "mistral-head-dim": (
        "MistralConfig",
        {"head_dim": 24, "sliding_window": 48, "tie_word_embeddings": False},
    ),
}


def _save_checkpoint(folder: Path, config_class: str, extra: dict[str, Any]) -> Any:
    config = getattr(transformers, config_class)(**{**BASE, **extra})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # random biases/norms so that every tensor matters
        for name, param in model.named_parameters():
            if "norm" in name or "bias" in name:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(folder)
    vocab = {f"t{i}": i for i in range(BASE["vocab_size"])}
    HFTokenizer(models.WordLevel(vocab, unk_token="t0")).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "t1", "eos_token": "t2", "chat_template": "{{ messages }}"})
    )
    return model


def _paged_logits(model: LlamaForCausalLM, ids: list[int], prefill: int) -> torch.Tensor:
    """Logits for every position: `prefill` tokens in one span, the rest as a second chunk
    (prefix in cache) and then single decode steps, all through a shuffled block table."""
    blocks = math.ceil(len(ids) / BLOCK) + 1
    kv = allocate_kv_cache(model.config, blocks, BLOCK, torch.float32, "cpu")
    table = torch.randperm(blocks, generator=torch.Generator().manual_seed(1))

    def slots(pos: torch.Tensor) -> torch.Tensor:
        return table[pos // BLOCK] * BLOCK + pos % BLOCK

    def run(start: int, end: int, meta: AttentionMetadata) -> torch.Tensor:
        pos = torch.arange(start, end)
        return model.compute_logits(model(torch.tensor(ids[start:end]), pos, kv, meta))

    def span_meta(start: int, end: int) -> AttentionMetadata:
        span = PrefillSpan(0, end - start, start, table[: math.ceil(end / BLOCK)])
        return AttentionMetadata(slots(torch.arange(start, end)), BLOCK, prefills=[span])

    out = [run(0, prefill, span_meta(0, prefill))]
    chunk_end = prefill + 3
    out.append(run(prefill, chunk_end, span_meta(prefill, chunk_end)))
    for position in range(chunk_end, len(ids)):
        context = position + 1
        meta = AttentionMetadata(
            slots(torch.tensor([position])),
            BLOCK,
            num_decodes=1,
            decode_block_tables=table[None, : math.ceil(context / BLOCK)].int(),
            decode_context_lens=torch.tensor([context], dtype=torch.int32),
        )
        out.append(run(position, context, meta))
    return torch.cat(out)


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(tmp_path: Path, case: str) -> None:
    config_class, extra = CASES[case]
    reference = _save_checkpoint(tmp_path, config_class, extra)
    loaded = load_model(str(tmp_path), torch.float32, "cpu")
    ids = torch.randint(3, BASE["vocab_size"], (40,), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        theirs = reference(ids[None]).logits[0]
        ours = _paged_logits(loaded.model, ids.tolist(), prefill=21)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    assert loaded.chat_template == "{{ messages }}"
    assert loaded.tokenizer.eos_token_ids == [2]
    assert loaded.name == tmp_path.name


def test_config_reads_what_transformers_saved(tmp_path: Path) -> None:
    _save_checkpoint(tmp_path, *CASES["llama3-rope-untied"])
    config = ModelConfig.from_hf_config(json.loads((tmp_path / "config.json").read_text()))
    assert config.rope_scaling is not None and config.rope_scaling.rope_type == "llama3"
    assert config.rope_scaling.original_max_position_embeddings == 16
    assert config.rope_theta == 500000.0
    assert not config.tie_word_embeddings


def test_sharded_checkpoint_is_read_through_its_index(tmp_path: Path) -> None:
    config = transformers.LlamaConfig(**BASE)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    weights = read_safetensors_weights(tmp_path)
    assert set(weights) == set(model.state_dict()) - {"lm_head.weight"} or set(weights) == set(
        model.state_dict()
    )
    for name, tensor in model.state_dict().items():
        if name in weights:
            torch.testing.assert_close(weights[name], tensor)


def test_missing_weights_and_folders_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors"):
        read_safetensors_weights(tmp_path)
    with pytest.raises(ValueError, match=r"unknown model .no-such-model.*smollm2-135m-instruct"):
        load_model("no-such-model")


def test_kv_cache_is_one_allocation_with_contiguous_layer_views() -> None:
    config = ModelConfig.from_hf_config({**BASE, "model_type": "llama"})
    caches = allocate_kv_cache(
        config, num_blocks=5, block_size=BLOCK, dtype=torch.float16, device="cpu"
    )
    assert len(caches) == config.num_layers
    base = caches[0][0].untyped_storage().data_ptr()
    for k, v in caches:
        assert k.shape == v.shape == (5, BLOCK, config.num_kv_heads, config.head_dim)
        assert k.is_contiguous() and v.is_contiguous()
        assert k.untyped_storage().data_ptr() == base
    total = sum(k.numel() + v.numel() for k, v in caches) * 2
    assert kv_bytes_per_block(config, BLOCK, torch.float16) * 5 == total
