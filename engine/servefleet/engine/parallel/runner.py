"""Rank 0's runner: one scheduler drives every rank, one plan broadcast a step.

As in vLLM v1 and nano-vllm, only rank 0 schedules, holds block tables and samples. Each
step it broadcasts the step's plan (`plan`), every rank runs its shard of the model on
it (`stages.stage_step`: its stage's layers, its tensor shard of them), and the logits'
vocabulary slices come back to rank 0, where the counter-based sampler picks tokens, so output
stays a pure function of (seed, position) whatever the split. The other ranks run
`worker.run_worker`'s loop over the same plans.
"""

from __future__ import annotations

import logging

import torch

from servefleet.engine.attention import AttentionMetadata
from servefleet.engine.parallel.group import GroupLostError, ParallelGroup
from servefleet.engine.parallel.plan import Command, StepPlan, decode, encode, header
from servefleet.engine.parallel.stages import stage_step
from servefleet.engine.runner import CausalLM, ModelRunner

log = logging.getLogger("servefleet.engine.parallel")


class ParallelRunner(ModelRunner):
    """ModelRunner whose model is rank 0's shard; the step goes to every rank first."""

    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        device: torch.device,
        group: ParallelGroup,
    ) -> None:
        super().__init__(model, kv_caches, block_size, device)
        self.group = group
        self.world_size = group.world_size
        self.plan_bytes = 0  # bytes of plans broadcast (the bench reads it)
        self._closed = False

    def run_model(
        self,
        ids: torch.Tensor,
        pos: torch.Tensor,
        meta: AttentionMetadata,
        logit_rows: list[int],
    ) -> torch.Tensor | None:
        head, payload = encode(StepPlan(ids, pos, meta, logit_rows))
        self.group.broadcast(head)
        self.group.broadcast(payload)
        self.plan_bytes += 8 * (head.numel() + payload.numel())
        return stage_step(self, self.group, StepPlan(ids, pos, meta, logit_rows))

    def idle(self) -> None:
        self.group.broadcast(header(Command.IDLE))

    def close(self) -> None:
        """Tell the other ranks to exit (they leave their loop with status 0)."""
        if not self._closed:
            self._closed = True
            try:
                self.group.broadcast(header(Command.STOP))
            except GroupLostError as exc:  # draining anyway: the others exit on their own
                log.warning("tensor_parallel_stop_not_sent: %s", exc)


@torch.inference_mode()
def follow_plans(runner: ModelRunner, group: ParallelGroup) -> int:
    """A non-zero rank's loop: run every step rank 0 broadcasts until it says stop.
    Returns the steps run; GroupLostError when rank 0 (or a peer) is gone."""
    steps = 0
    head = header(Command.IDLE)
    while True:
        group.broadcast(head)
        command = Command(int(head[0]))
        if command == Command.STOP:
            return steps
        if command == Command.IDLE:
            continue
        payload = torch.empty(int(head[7]), dtype=torch.long)
        group.broadcast(payload)
        stage_step(runner, group, decode(head, payload, runner.block_size, runner.device))
        steps += 1
