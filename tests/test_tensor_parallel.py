"""Tensor parallelism over gloo, ranks as processes on this machine: greedy output split
over ranks equals one process's, alone and batched; a rank that dies takes the group down
(non-zero exit, one log line) instead of hanging; what does not combine is refused by name."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models

from servefleet.api.parallel import RankPlace
from servefleet.engine.config import EngineConfig, EngineSettingsError
from servefleet.engine.model.config import ModelConfig
from servefleet.engine.parallel.plan import StepPlan, decode, encode
from servefleet.engine.parallel.setup import check_parallel_settings
from servefleet.engine.parallel.shard import ShardingError, check_divisible

VOCAB, HIDDEN, INTER, LAYERS, HEADS, KV_HEADS = 96, 64, 128, 2, 4, 2
PROMPTS = [[5, 17, 33, 2 + 7, 61], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [90, 3]]
NEW_TOKENS = 12


def _tiny_model(folder: Path) -> Path:
    """A random Llama (untied lm_head, q/k/v and o biases) as an HF folder."""
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int, scale: float = 0.2) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    hd = HIDDEN // HEADS
    tensors = {"model.embed_tokens.weight": rand(VOCAB, HIDDEN, scale=1.0)}
    tensors["model.norm.weight"] = 1 + rand(HIDDEN, scale=0.1)
    tensors["lm_head.weight"] = rand(VOCAB, HIDDEN, scale=0.5)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = 1 + rand(HIDDEN, scale=0.1)
        tensors[p + "post_attention_layernorm.weight"] = 1 + rand(HIDDEN, scale=0.1)
        for name, rows in (("q", HEADS * hd), ("k", KV_HEADS * hd), ("v", KV_HEADS * hd)):
            tensors[f"{p}self_attn.{name}_proj.weight"] = rand(rows, HIDDEN)
            tensors[f"{p}self_attn.{name}_proj.bias"] = rand(rows, scale=0.1)
        tensors[p + "self_attn.o_proj.weight"] = rand(HIDDEN, HEADS * hd)
        tensors[p + "self_attn.o_proj.bias"] = rand(HIDDEN, scale=0.1)
        tensors[p + "mlp.gate_proj.weight"] = rand(INTER, HIDDEN)
        tensors[p + "mlp.up_proj.weight"] = rand(INTER, HIDDEN)
        tensors[p + "mlp.down_proj.weight"] = rand(HIDDEN, INTER)
    save_file(tensors, str(folder / "model.safetensors"))
    config = {
        "model_type": "llama",
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": INTER,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "max_position_embeddings": 128,
        "rms_norm_eps": 1e-5,
        "attention_bias": True,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    (folder / "config.json").write_text(json.dumps(config))
    vocab = {f"t{i}": i for i in range(VOCAB)}
    HFTokenizer(models.WordLevel(vocab, unk_token="t0")).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "t1", "eos_token": "t2"})
    )
    return folder


def _settings(model: str, tp: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": model,
        "tensor_parallel_size": tp,
        "kv_cache_memory": "4MiB",
        "max_num_seqs": 8,
        "threads": 1,
        "dist_timeout": 20.0,
        "batch_invariant": "off",
        **extra,
    }


def _greedy(built: Any, prompts: list[list[int]], batched: bool) -> list[list[int]]:
    """Greedy tokens for each prompt, all in one batch or one prompt at a time."""
    from servefleet.engine.sampling_params import SamplingParams
    from servefleet.engine.sequence import Sequence

    scheduler, runner = built.engine.scheduler, built.engine.runner
    groups = [prompts] if batched else [[p] for p in prompts]
    outputs: list[list[int]] = []
    for group in groups:
        seqs = [
            Sequence(
                list(p),
                SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True),
                0.0,
            )
            for p in group
        ]
        for seq in seqs:
            scheduler.add(seq)
        while scheduler.num_unfinished:
            out = scheduler.schedule()
            scheduler.update(out, runner.execute(out).token_by_seq_id())
        outputs += [list(s.output_token_ids) for s in seqs]
    return outputs


def _outputs(settings: dict[str, Any], prompts: list[list[int]]) -> dict[str, list[list[int]]]:
    from servefleet.engine.process import build_engine, resolve_device
    from servefleet.engine.parallel.setup import leader_group

    config = EngineConfig(**settings)
    group = leader_group(config, resolve_device("cpu"))
    built = build_engine(config, group=group)
    result = {"alone": _greedy(built, prompts, False), "batched": _greedy(built, prompts, True)}
    built.engine.runner.close()
    return result


def _rank_main(
    rank: int, world: int, port: int, settings: dict[str, Any], prompts: Any, results: Any
) -> None:
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    from servefleet.engine.parallel.group import leave_group

    if rank == 0:
        results.put(("outputs", _outputs(settings, prompts)))
        leave_group()
        return
    from servefleet.engine.parallel.worker import run_worker

    results.put((f"rank{rank}", run_worker(EngineConfig(**settings))))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_split(settings: dict[str, Any], prompts: list[list[int]]) -> dict[str, Any]:
    world = settings["tensor_parallel_size"]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, world, port, settings, prompts, results))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    got: dict[str, Any] = {}
    for _ in range(world):
        key, value = results.get(timeout=120)
        got[key] = value
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    return got


def _reference(settings: dict[str, Any], prompts: list[list[int]]) -> dict[str, list[list[int]]]:
    from servefleet.engine.process import build_engine

    built = build_engine(EngineConfig(**{**settings, "tensor_parallel_size": 1}))
    return {"alone": _greedy(built, prompts, False), "batched": _greedy(built, prompts, True)}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(_tiny_model(tmp_path_factory.mktemp("tp") / "tiny"))


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param({"matmul": "torch"}, id="float-torch"),
        pytest.param({"quantization": "int8"}, id="packed-int8-cpu-c"),
    ],
)
def test_tp2_greedy_equals_tp1(tiny: str, extra: dict[str, Any]) -> None:
    settings = _settings(tiny, 2, **extra)
    split = _run_split(settings, PROMPTS)
    assert split["rank1"] == 0
    reference = _reference(settings, PROMPTS)
    assert reference["alone"] == reference["batched"]
    assert split["outputs"] == reference
    assert all(len(tokens) == NEW_TOKENS for tokens in reference["alone"])
