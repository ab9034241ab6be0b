"""Turns a scheduled step into tensors, runs the model, samples.

Decode tokens come first in the flat batch (one per sequence, batched through
the decode kernel), prompt chunks after them (one SDPA call each). A decode with
speculative proposals adds one decode row per proposal: the same block table, a
context one longer each, so verification runs through the same decode kernels (and
the same one-call decode program) as a plain step and its logits are the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from servefleet.engine.attention import AttentionMetadata, PrefillSpan
from servefleet.engine.lora.adapter import LoraAdapter
from servefleet.engine.lora.batch import LoraBatch
from servefleet.engine.sampler import TokenLogprobs, sample
from servefleet.engine.scheduler import ScheduledChunk, SchedulerOutput
from servefleet.engine.sequence import Sequence
from servefleet.engine.spec.verify import verify_drafts


class CausalLM(Protocol):
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


@dataclass
class StepResult:
    sampled_seqs: list[Sequence]
    token_ids: list[list[int]]  # per sampled sequence: accepted proposals + one token
    logprobs: list[list[TokenLogprobs]]  # per sampled sequence, one per token when asked

    def token_by_seq_id(self) -> dict[int, list[int]]:
        return {s.seq_id: t for s, t in zip(self.sampled_seqs, self.token_ids, strict=True)}


def _by_adapter(chunk: ScheduledChunk) -> tuple[bool, int]:
    lora = chunk.seq.lora
    return (lora is not None, id(lora))


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device

    def _slots(self, seq: Sequence, start: int, count: int) -> list[int]:
        bs, table = self.block_size, seq.block_table
        return [table[p // bs] * bs + p % bs for p in range(start, start + count)]

    def build_inputs(
        self, out: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Flat input ids, positions, attention metadata and the rows whose logits are needed.

        Decodes under adapters are put next to those under the same adapter (the order of
        `out.decodes` is the order of the step's rows and results), so each adapter's decode
        rows are one run of the batch: sliced, not gathered and scattered back."""
        if any(chunk.seq.lora is not None for chunk in out.decodes):
            out.decodes.sort(key=_by_adapter)
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logit_rows: list[int] = []
        decode_tables: list[list[int]] = []
        context_lens: list[int] = []
        lora_spans: list[tuple[LoraAdapter, int, int]] = []  # (adapter, first row, rows)
        for chunk in out.decodes:
            seq, start = chunk.seq, chunk.num_computed_before
            rows = 1 + len(chunk.draft_token_ids)
            if seq.lora is not None:
                lora_spans.append((seq.lora, len(input_ids), rows))
            if chunk.samples:  # a one-token prompt chunk short of the prompt's end does not
                logit_rows.extend(range(len(input_ids), len(input_ids) + rows))
            input_ids.append(seq.token_ids[start])
            input_ids.extend(chunk.draft_token_ids)
            positions.extend(range(start, start + rows))
            slots.extend(self._slots(seq, start, rows))
            decode_tables.extend([seq.block_table] * rows)
            context_lens.extend(range(start + 1, start + rows + 1))
        prefills: list[PrefillSpan] = []
        for chunk in out.prefills:
            seq, start, count = chunk.seq, chunk.num_computed_before, chunk.num_new_tokens
            row0 = len(input_ids)
            if seq.lora is not None:
                lora_spans.append((seq.lora, row0, count))
            input_ids.extend(seq.token_ids[start : start + count])
            positions.extend(range(start, start + count))
            slots.extend(self._slots(seq, start, count))
            table = seq.block_table[: -(-(start + count) // self.block_size)]
            prefills.append(
                PrefillSpan(row0, row0 + count, start, torch.tensor(table, dtype=torch.long))
            )
            if chunk.samples:
                logit_rows.append(row0 + count - 1)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            block_size=self.block_size,
            num_decodes=len(decode_tables),
            prefills=prefills,
            lora=LoraBatch.for_spans(lora_spans, self.device) if lora_spans else None,
        )
        if decode_tables:
            width = max(len(t) for t in decode_tables)
            padded = [t + [0] * (width - len(t)) for t in decode_tables]
            meta.decode_block_tables = torch.tensor(padded, dtype=torch.int32, device=self.device)
            meta.decode_context_lens = torch.tensor(
                context_lens, dtype=torch.int32, device=self.device
            )
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        return ids, pos, meta, logit_rows

    world_size = 1  # processes the model is split over (`parallel.runner`)

    def idle(self) -> None:
        """Called by the engine loop while it has nothing to run (about once a second)."""

    def close(self) -> None:
        """The engine is done: release what the runner holds beyond this process."""

    def run_model(
        self,
        ids: torch.Tensor,
        pos: torch.Tensor,
        meta: AttentionMetadata,
        logit_rows: list[int],
    ) -> torch.Tensor | None:
        """The step through the model: float32 CPU logits of `logit_rows` (None: none)."""
        hidden = self.model.forward(ids, pos, self.kv_caches, meta)
        if not logit_rows:
            return None
        rows = torch.tensor(logit_rows, dtype=torch.long, device=hidden.device)
        return self.model.compute_logits(hidden.index_select(0, rows)).float().cpu()

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepResult:
        ids, pos, meta, logit_rows = self.build_inputs(out)
        for span in meta.prefills:
            span.block_table = span.block_table.to(self.device)
        logits = self.run_model(ids, pos, meta, logit_rows)
        chunks = out.decodes + out.prefills
        sampled = [c for c in chunks if c.samples]
        if not sampled:
            return StepResult([], [], [])
        assert logits is not None
        seqs = [c.seq for c in sampled]
        if any(c.draft_token_ids for c in sampled):
            tokens, logprobs = verify_drafts(logits, seqs, [c.draft_token_ids for c in sampled])
            return StepResult(seqs, tokens, logprobs)
        result = sample(logits, seqs)
        return StepResult(
            seqs,
            [[t] for t in result.token_ids],
            [[lp] if lp is not None else [] for lp in result.logprobs],
        )
