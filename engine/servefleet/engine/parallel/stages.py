"""Pipeline parallelism: the layers split into consecutive stages, one process each.

Stage s holds layers [s·L/P, (s+1)·L/P) and their KV cache (the same block tables: every
stage gets the step's plan). A step runs the stages in turn: stage 0 embeds and runs its
layers, each stage sends its hidden states [T, hidden] to the next (point-to-point), the
last applies the final norm and lm_head and sends the sampled rows' logits to rank 0.
Nothing is summed across processes, so a split model computes what one process does, in
the same order. Steps are not interleaved (no micro-batches): this spreads memory, not time.
Every stage keeps the embedding, final norm and lm_head (only the first and last use them).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from servefleet.engine.model.conversion_cache import Checkpoint
from servefleet.engine.model.llama import LlamaForCausalLM
from servefleet.engine.parallel.group import ParallelGroup
from servefleet.engine.parallel.plan import StepPlan
from servefleet.engine.parallel.shard import ShardingError
from servefleet.engine.runner import ModelRunner


def stage_checkpoint(checkpoint: Checkpoint, stage: int, stages: int) -> Checkpoint:
    """Stage `stage`'s layers of `checkpoint`, renumbered from 0."""
    layers = checkpoint.config.num_layers
    if layers % stages:
        raise ShardingError(
            f"--pipeline-parallel-size {stages} does not divide the model's layers ({layers})"
        )
    per = layers // stages
    first = stage * per

    def keep(name: str) -> str | None:
        if not name.startswith("layers."):
            return name
        index, _, rest = name.removeprefix("layers.").partition(".")
        local = int(index) - first
        return f"layers.{local}.{rest}" if 0 <= local < per else None

    weights = {new: t for n, t in checkpoint.weights.items() if (new := keep(n)) is not None}
    packed = {new: w for n, w in checkpoint.packed.items() if (new := keep(n)) is not None}
    config = checkpoint.config.model_copy(update={"num_layers": per})
    return replace(checkpoint, config=config, weights=weights, packed=packed)


def stage_step(runner: ModelRunner, group: ParallelGroup, plan: StepPlan) -> torch.Tensor | None:
    """This stage's share of a step; rank 0 (the first stage) gets the logits back."""
    model = runner.model
    assert isinstance(model, LlamaForCausalLM)
    rank, last = group.rank, group.world_size - 1
    hidden_in = None
    if rank > 0:
        hidden_in = torch.empty(
            plan.ids.numel(), model.config.hidden_size, dtype=model.norm.dtype, device=group.device
        )
        group.point_to_point("recv", hidden_in, rank - 1)
    hidden = model.forward(plan.ids, plan.positions, runner.kv_caches, plan.meta, hidden_in)
    if rank < last:
        group.point_to_point("send", hidden.contiguous(), rank + 1)
    logits: torch.Tensor | None = None
    if plan.logit_rows and rank == last:
        rows = torch.tensor(plan.logit_rows, dtype=torch.long, device=hidden.device)
        logits = model.compute_logits(hidden.index_select(0, rows)).float().contiguous()
        if last > 0:
            group.point_to_point("send", logits, 0)
    elif plan.logit_rows and rank == 0:
        vocab = model.config.vocab_size
        logits = torch.empty(len(plan.logit_rows), vocab, dtype=torch.float32, device=group.device)
        group.point_to_point("recv", logits, last)
    return None if logits is None or rank != 0 else logits.cpu()
