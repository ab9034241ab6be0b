"""Tensor and pipeline parallelism over gloo, ranks as processes on this machine: greedy
output split over ranks (TP=2, PP=2, TP=2 x PP=2) equals one process's, alone and
batched; a rank that dies takes the group down (non-zero exit, one log line) instead of
hanging; what does not combine is refused by name."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models

from servefleet.api.rank_place import RankPlace
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


def _greedy(
    built: Any, prompts: list[list[int]], batched: bool, tokens: int = NEW_TOKENS
) -> list[list[int]]:
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
                SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True),
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


def _outputs(settings: dict[str, Any], prompts: list[list[int]], tokens: int) -> dict[str, Any]:
    from servefleet.engine.parallel.setup import leader_group
    from servefleet.engine.process import build_engine, resolve_device

    config = EngineConfig(**settings)
    group = leader_group(config, resolve_device("cpu"))
    built = build_engine(config, group=group)
    result: dict[str, Any] = {
        "alone": _greedy(built, prompts, False, tokens),
        "batched": _greedy(built, prompts, True, tokens),
    }
    result["micro_batches"] = built.engine.runner.group.micro_batches_run
    built.engine.runner.close()
    return result


def _rank_main(
    rank: int, world: int, ports: list[int], runs: list[dict[str, Any]], prompts: Any, results: Any
) -> None:
    """One rank through every run in turn (a fresh group each, on its own port)."""
    from servefleet.engine.parallel.group import leave_group
    from servefleet.engine.parallel.worker import run_worker

    for index, (port, settings) in enumerate(zip(ports, runs, strict=True)):
        os.environ.update(
            {"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": str(port)}
        )  # fmt: skip
        if rank == 0:
            outputs = _outputs(settings, *prompts)
            results.put((index, "micro_batches", outputs.pop("micro_batches")))
            results.put((index, "outputs", outputs))
            leave_group()
        else:
            results.put((index, f"rank{rank}", run_worker(EngineConfig(**settings))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_split(
    runs: list[dict[str, Any]], prompts: list[list[int]], world: int, tokens: int = NEW_TOKENS
) -> list[dict[str, Any]]:
    """Each run's rank-0 outputs and micro-batch count and the other ranks' exit statuses,
    ranks as processes."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    ports = [free_port() for _ in runs]
    procs = [
        ctx.Process(target=_rank_main, args=(r, world, ports, runs, (prompts, tokens), results))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    got: list[dict[str, Any]] = [{} for _ in runs]
    try:
        for _ in range((world + 1) * len(runs)):  # rank 0 puts two results a run
            index, key, value = results.get(timeout=240)
            got[index][key] = value
    finally:
        for p in procs:
            p.join(30)
            if p.exitcode is None:
                p.kill()
    assert [p.exitcode for p in procs] == [0] * world
    return got


def reference(
    settings: dict[str, Any], prompts: list[list[int]], tokens: int = NEW_TOKENS
) -> dict[str, list[list[int]]]:
    from servefleet.engine.process import build_engine

    one = {"tensor_parallel_size": 1, "pipeline_parallel_size": 1}
    built = build_engine(EngineConfig(**{**settings, **one}))
    return {
        "alone": _greedy(built, prompts, False, tokens),
        "batched": _greedy(built, prompts, True, tokens),
    }


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(_tiny_model(tmp_path_factory.mktemp("tp") / "tiny"))


RUNS = {
    "TP=2, float32, torch matmuls": (2, {"matmul": "torch"}),
    "TP=2, int8 packed at load, C matmuls, int8 KV": (
        2,
        {"quantization": "int8", "kv_cache_dtype": "int8"},
    ),
    "PP=2 (a layer a stage), C matmuls, 2 micro-batches": (
        1,
        {"pipeline_parallel_size": 2, "pipeline_micro_batches": 2},
    ),
}


def test_split_greedy_equals_one_process_alone_and_batched(tiny: str) -> None:
    """One spawn of two ranks runs every case in turn (a fresh group each)."""
    runs = [_settings(tiny, tp, **extra) for tp, extra in RUNS.values()]
    split = run_split(runs, PROMPTS, 2)
    for name, settings, got in zip(RUNS, runs, split, strict=True):
        assert got["rank1"] == 0, name
        micro = got["micro_batches"]  # the batched steps were cut, if asked
        assert (micro > 0) == (settings.get("pipeline_micro_batches", 1) > 1), name
        expected = reference(settings, PROMPTS)
        assert expected["alone"] == expected["batched"], name
        assert all(len(tokens) == NEW_TOKENS for tokens in expected["alone"]), name
        assert got["outputs"] == expected, name


GRID_RUNS = {
    "TP=2 x PP=2 (4 ranks), float32, torch matmuls, 2 micro-batches": {
        "matmul": "torch",
        "pipeline_micro_batches": 2,
    },
    "TP=2 x PP=2 (4 ranks), int8 packed at load, C matmuls, int8 KV, whole steps": {
        "quantization": "int8",
        "kv_cache_dtype": "int8",
    },
}


def test_tensor_and_pipeline_together_equal_one_process(tiny: str) -> None:
    """Two stages of two tensor shards each (rank = stage * 2 + shard): greedy output
    equals one process's, alone and batched; one spawn of four ranks runs both cases."""
    runs = [_settings(tiny, 2, pipeline_parallel_size=2, **extra) for extra in GRID_RUNS.values()]
    split = run_split(runs, PROMPTS, 4)
    for name, settings, got in zip(GRID_RUNS, runs, split, strict=True):
        assert [got[f"rank{r}"] for r in (1, 2, 3)] == [0, 0, 0], name
        micro = got["micro_batches"]  # the batched steps were cut, if asked
        assert (micro > 0) == (settings.get("pipeline_micro_batches", 1) > 1), name
        expected = reference(settings, PROMPTS)
        assert expected["alone"] == expected["batched"], name
        assert got["outputs"] == expected, name


def test_ranks_are_laid_out_stage_major() -> None:
    """vLLM's layout: rank = stage * TP + tensor rank; a stage's shards are consecutive."""
    from servefleet.engine.parallel.group import ParallelGroup

    cpu = torch.device("cpu")
    places = [ParallelGroup(r, 6, cpu, tensor_size=2) for r in range(6)]
    assert [(g.stage, g.tensor_rank, g.stage_leader) for g in places] == [
        (0, 0, 0), (0, 1, 0), (1, 0, 2), (1, 1, 2), (2, 0, 4), (2, 1, 4),
    ]  # fmt: skip
    assert all(g.stages == 3 and g.pipeline for g in places)
    only_tensor = ParallelGroup(1, 2, cpu)
    assert (only_tensor.tensor_size, only_tensor.stages, only_tensor.pipeline) == (2, 1, False)


def test_micro_batches_cut_between_sequences_and_rebase_rows() -> None:
    """Two decode rows and two prompt chunks (3 and 4 rows) cut in two by token balance:
    [decodes + first chunk | second chunk], each a step of its own from row 0."""
    from servefleet.engine.attention import AttentionMetadata, PrefillSpan
    from servefleet.engine.parallel.micro_batches import micro_batches

    meta = AttentionMetadata(
        slot_mapping=torch.arange(100, 109),
        block_size=4,
        num_decodes=2,
        decode_block_tables=torch.tensor([[1, 2], [3, 0]], dtype=torch.int32),
        decode_context_lens=torch.tensor([6, 2], dtype=torch.int32),
        prefills=[
            PrefillSpan(2, 5, 0, torch.tensor([7])),
            PrefillSpan(5, 9, 4, torch.tensor([8, 9])),
        ],
    )
    plan = StepPlan(torch.arange(9), torch.arange(20, 29), meta, [0, 1, 4, 8])
    first, second = micro_batches(plan, 2)
    assert (first.first, first.end, second.first, second.end) == (0, 5, 5, 9)
    assert first.plan.ids.tolist() == [0, 1, 2, 3, 4] and first.plan.logit_rows == [0, 1, 4]
    assert first.plan.meta.num_decodes == 2 and len(first.plan.meta.prefills) == 1
    assert second.plan.meta.num_decodes == 0 and second.plan.meta.decode_block_tables is None
    (span,) = second.plan.meta.prefills
    assert (span.start, span.end, span.num_cached, span.block_table.tolist()) == (0, 4, 4, [8, 9])
    assert second.plan.meta.slot_mapping.tolist() == [105, 106, 107, 108]
    assert second.plan.positions.tolist() == [25, 26, 27, 28] and second.plan.logit_rows == [3]
    (whole,) = micro_batches(plan, 1)
    assert whole.plan is plan
    chunk = PrefillSpan(0, 3, 0, torch.tensor([1]))
    alone = AttentionMetadata(slot_mapping=torch.arange(3), block_size=4, prefills=[chunk])
    one_sequence = StepPlan(torch.arange(3), torch.arange(3), alone, [2])
    assert len(micro_batches(one_sequence, 4)) == 1  # a prompt chunk is never cut


def test_plan_round_trips_through_its_tensors() -> None:
    from servefleet.engine.attention import AttentionMetadata, PrefillSpan

    meta = AttentionMetadata(
        slot_mapping=torch.tensor([9, 20, 21, 22]),
        block_size=4,
        num_decodes=1,
        decode_block_tables=torch.tensor([[2, 7]], dtype=torch.int32),
        decode_context_lens=torch.tensor([6], dtype=torch.int32),
        prefills=[PrefillSpan(1, 4, 0, torch.tensor([5]))],
    )
    plan = StepPlan(torch.tensor([3, 4, 5, 6]), torch.tensor([5, 0, 1, 2]), meta, [0, 3])
    head, payload = encode(plan)
    back = decode(head, payload, 4, torch.device("cpu"))
    assert back.ids.tolist() == [3, 4, 5, 6] and back.positions.tolist() == [5, 0, 1, 2]
    assert back.logit_rows == [0, 3] and back.meta.num_decodes == 1
    assert back.meta.slot_mapping.tolist() == [9, 20, 21, 22]
    assert back.meta.decode_block_tables is not None
    assert back.meta.decode_block_tables.tolist() == [[2, 7]]
    assert back.meta.decode_block_tables.dtype == torch.int32
    (span,) = back.meta.prefills
    assert (span.start, span.end, span.num_cached, span.block_table.tolist()) == (1, 4, 0, [5])


def test_packed_slices_keep_blocks_and_refuse_cuts_inside_them() -> None:
    import numpy as np

    from servefleet.engine.kernels.packed_weights import BlockQuantized, PackedFormat, pack, unpack
    from servefleet.engine.parallel.packed_slices import packed_columns, packed_rows

    rng = np.random.default_rng(0)
    q = rng.integers(-127, 128, size=(80, 96), dtype=np.int8)
    scale = rng.random((80, 3), dtype=np.float32)
    weight = pack(BlockQuantized(PackedFormat.Q8, q, scale, None))  # W [96, 80]
    whole = unpack(weight)
    cols = packed_columns(weight, [(16, 32), (48, 80)])
    assert cols is not None
    assert torch.equal(unpack(cols), torch.cat([whole[:, 16:32], whole[:, 48:80]], dim=1))
    rows = packed_rows(weight, 32, 96)
    assert rows is not None and torch.equal(unpack(rows), whole[32:96])
    assert packed_columns(weight, [(8, 24)]) is None  # inside a 16-column group
    assert packed_rows(weight, 16, 48) is None  # inside a 32-row block


def test_shapes_that_do_not_split_are_refused_by_name() -> None:
    config = ModelConfig(
        architecture="llama", vocab_size=96, hidden_size=64, intermediate_size=192,
        num_layers=1, num_heads=9, num_kv_heads=3, head_dim=16,
    )  # fmt: skip
    with pytest.raises(
        ShardingError, match=r"tensor-parallel-size 2 does not divide .*heads \(9\)"
    ):
        check_divisible(config, 2)
    check_divisible(config, 3)


@pytest.mark.parametrize(
    ("extra", "world", "message"),
    [
        ({"speculative_config": '{"method": "ngram", "num_speculative_tokens": 2}'}, 2,
         "--speculative-config is not supported with --tensor-parallel-size 2"),
        ({"enable_lora": True}, 2, "--enable-lora is not supported"),
        ({"pipeline_parallel_size": 2}, 2,
         "--tensor-parallel-size 2 with --pipeline-parallel-size 2 needs WORLD_SIZE=4"),
        ({"speculative_config": '{"method": "ngram", "num_speculative_tokens": 2}',
          "pipeline_parallel_size": 2}, 4,
         "--speculative-config is not supported with --tensor-parallel-size 2 with "
         "--pipeline-parallel-size 2"),
        ({"enable_lora": True, "tensor_parallel_size": 1, "pipeline_parallel_size": 2}, 2,
         "--enable-lora is not supported with --pipeline-parallel-size 2"),
        ({}, 3, "needs WORLD_SIZE=2 processes, the environment says WORLD_SIZE=3"),
        ({"pipeline_micro_batches": 2}, 2,
         "--pipeline-micro-batches 2 needs --pipeline-parallel-size > 1"),
    ],
)  # fmt: skip
def test_combinations_that_do_not_split_are_refused_at_start(
    extra: dict[str, Any], world: int, message: str
) -> None:
    config = EngineConfig(**_settings("unused", 2, **extra))
    place = RankPlace(rank=0, world_size=world, local_rank=0, master_addr="x", master_port=1)
    with pytest.raises(EngineSettingsError, match=message):
        check_parallel_settings(config, place)
