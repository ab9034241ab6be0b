"""Pipeline parallelism: the layers split into consecutive stages (each TP processes).

Stage s holds layers [s·L/P, (s+1)·L/P) and their KV cache (the same block tables: every
stage gets the step's plan); with TP > 1 each of its ranks holds its tensor shard of
them (`shard`), KV heads included. A step runs the stages in turn: stage 0 embeds and
runs its layers, each stage sends its hidden states [T, hidden] to the next
(point-to-point), the last applies the final norm and lm_head and sends the sampled
rows' logits to rank 0, whose scheduler samples them (the counter-based sampler: output
stays a pure function of (seed, position)). Nothing is summed across stages, so a split
model computes what one process does (or, with TP, what TP shards in one stage do).

Hidden states go from tensor rank t of stage s to tensor rank t of stage s + 1, as vLLM
sends them: after each layer's all-reduce every shard of a stage holds the same
[T, hidden], so each pair passes a copy in parallel and the next stage needs no
broadcast (one fewer collective a stage a step, and no rank waits on its stage's rank 0).
The last stage's vocabulary slices are gathered on its tensor rank 0, which alone sends
the [N, vocab] logits to rank 0 (with one stage that is rank 0 itself).

With --pipeline-micro-batches M > 1 a step of several sequences runs as up to M
micro-batches (`micro_batches`): a stage sends one on without waiting for it to arrive
and runs the next, so stages overlap.
Every stage keeps the embedding, final norm and lm_head (only the first and last use them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from servefleet.engine.model.conversion_cache import Checkpoint
from servefleet.engine.model.llama import LlamaForCausalLM
from servefleet.engine.parallel.group import ParallelGroup
from servefleet.engine.parallel.micro_batches import micro_batches
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
    """This rank's share of a step (its stage's layers, its tensor shard of them), one
    micro-batch after another; rank 0 gets the whole vocabulary's logits back."""
    model = runner.model
    assert isinstance(model, LlamaForCausalLM)
    parts = micro_batches(plan, group.micro_batch_parts)
    if len(parts) > 1:
        group.micro_batches_run += len(parts)
    waits: list[Callable[[], None]] = []
    logits: list[torch.Tensor] = []
    for part in parts:
        hidden = _stage_forward(runner, model, group, part.plan, waits if len(parts) > 1 else None)
        if group.stage == group.stages - 1 and part.plan.logit_rows:
            rows = torch.tensor(part.plan.logit_rows, dtype=torch.long, device=hidden.device)
            logits.append(model.compute_logits(hidden.index_select(0, rows)).float())
    for wait in waits:
        wait()
    return _logits_to_leader(model, group, plan, logits) if plan.logit_rows else None


def _stage_forward(
    runner: ModelRunner,
    model: LlamaForCausalLM,
    group: ParallelGroup,
    plan: StepPlan,
    waits: list[Callable[[], None]] | None,
) -> torch.Tensor:
    """One micro-batch through this stage: received from the previous stage's shard of
    the same tensor rank, sent on to the next one's; with `waits` (several micro-batches)
    without waiting for it to arrive, else at once and without a copy."""
    stage, tp = group.stage, group.tensor_size
    hidden_in = None
    if stage > 0:
        hidden_in = torch.empty(
            plan.ids.numel(), model.config.hidden_size, dtype=model.norm.dtype, device=group.device
        )
        group.point_to_point("recv", hidden_in, group.rank - tp)
    hidden = model.forward(plan.ids, plan.positions, runner.kv_caches, plan.meta, hidden_in)
    if stage == group.stages - 1:
        return hidden
    if waits is None:
        group.point_to_point("send", hidden.contiguous(), group.rank + tp)
    else:  # a copy: the next micro-batch may reuse the model's buffers
        sent = hidden.clone(memory_format=torch.contiguous_format)
        waits.append(group.send_later(sent, group.rank + tp))
    return hidden


def _logits_to_leader(
    model: LlamaForCausalLM, group: ParallelGroup, plan: StepPlan, parts: list[torch.Tensor]
) -> torch.Tensor | None:
    """The last stage's logits (its vocabulary slices gathered on its tensor rank 0) on
    rank 0, as [logit rows, vocab] float32 on the CPU; None on every other rank."""
    tp = group.tensor_size
    if group.stage == group.stages - 1:
        local = torch.cat(parts).contiguous()
        logits = group.gather_columns(local) if tp > 1 else local
        if logits is None or group.rank != 0:
            if logits is not None:  # the last stage's tensor rank 0
                group.point_to_point("send", logits, 0)
            return None
        return logits.cpu()
    if group.rank != 0:
        return None
    vocab = model.config.vocab_size * tp  # rank 0 holds a 1/TP slice of the rows
    logits = torch.empty(len(plan.logit_rows), vocab, dtype=torch.float32, device=group.device)
    group.point_to_point("recv", logits, (group.stages - 1) * tp)
    return logits.cpu()
