"""Prompts run to the end in one engine batch, below the HTTP server: the scheduler, the
runner and a KV cache sized for them, greedy. Shared by the exactness tests (CPU) and
`gpu_check` (CUDA), so both compare the same engine path with transformers."""

from __future__ import annotations

import math
from collections.abc import Sequence as Jobs
from typing import Any

import torch

from servefleet.engine.kv_cache import KVCacheManager
from servefleet.engine.lora.adapter import LoraAdapter
from servefleet.engine.lora.batch import LoraBatch
from servefleet.engine.model.kv_layout import allocate_kv_cache
from servefleet.engine.model.loader import LoadedModel
from servefleet.engine.runner import ModelRunner
from servefleet.engine.sampling_params import SamplingParams
from servefleet.engine.scheduler import Scheduler, SchedulerConfig
from servefleet.engine.sequence import Sequence
from servefleet.engine.spec.speculator import Speculator

BLOCK = 16


def run_in_one_batch(
    loaded: LoadedModel,
    jobs: Jobs[tuple[LoraAdapter | None, list[int]]],
    new_tokens: int,
    device: str = "cpu",
    speculator: Speculator | None = None,
) -> tuple[list[Sequence], list[LoraBatch | None]]:
    """Every (adapter, prompt ids) job in one engine batch, `new_tokens` greedy tokens each
    (EOS ignored); the sequences and each step's adapter grouping."""
    blocks = sum(math.ceil((len(p) + new_tokens + 8) / BLOCK) + 1 for _, p in jobs) + 8
    kv = allocate_kv_cache(loaded.config, blocks, BLOCK, loaded.model.norm.dtype, device)
    scheduler = Scheduler(
        SchedulerConfig(64, 4096, 2048), KVCacheManager(blocks, BLOCK), [], speculator
    )
    runner = ModelRunner(loaded.model, kv, BLOCK, torch.device(device))
    steps: list[LoraBatch | None] = []
    build = runner.build_inputs

    def recording(out: Any) -> Any:
        inputs = build(out)
        steps.append(inputs[2].lora)
        return inputs

    runner.build_inputs = recording  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    seqs = [Sequence(list(p), params, 0.0, lora=a) for a, p in jobs]
    for seq in seqs:
        scheduler.add(seq)
    with torch.inference_mode():
        while scheduler.num_unfinished:
            out = scheduler.schedule()
            scheduler.update(out, runner.execute(out).token_by_seq_id())
    return seqs, steps
