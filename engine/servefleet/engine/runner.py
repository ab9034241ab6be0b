"""Turns a scheduled step into tensors, runs the model, samples.

Decode tokens come first in the flat batch (one per sequence, batched through
the decode kernel), prompt chunks after them (one SDPA call each).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from servefleet.engine.attention import AttentionMetadata, PrefillSpan
from servefleet.engine.sampler import SampleResult, sample
from servefleet.engine.scheduler import ScheduledChunk, SchedulerOutput
from servefleet.engine.sequence import Sequence


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
    samples: SampleResult

    def token_by_seq_id(self) -> dict[int, int]:
        return {s.seq_id: t for s, t in zip(self.sampled_seqs, self.samples.token_ids, strict=True)}


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
        """Flat input ids, positions, attention metadata and the rows whose logits are needed."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logit_rows: list[int] = []
        tagged: list[tuple[ScheduledChunk, bool]] = [(c, True) for c in out.decodes]
        tagged += [(c, False) for c in out.prefills]
        prefills: list[PrefillSpan] = []
        for chunk, is_decode in tagged:
            seq, start, count = chunk.seq, chunk.num_computed_before, chunk.num_new_tokens
            row0 = len(input_ids)
            input_ids.extend(seq.token_ids[start : start + count])
            positions.extend(range(start, start + count))
            slots.extend(self._slots(seq, start, count))
            if not is_decode:
                table = seq.block_table[: -(-(start + count) // self.block_size)]
                prefills.append(
                    PrefillSpan(row0, row0 + count, start, torch.tensor(table, dtype=torch.long))
                )
            if chunk.samples:
                logit_rows.append(row0 + count - 1)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            block_size=self.block_size,
            num_decodes=len(out.decodes),
            prefills=prefills,
        )
        if out.decodes:
            width = max(len(c.seq.block_table) for c in out.decodes)
            tables = [
                c.seq.block_table + [0] * (width - len(c.seq.block_table)) for c in out.decodes
            ]
            meta.decode_block_tables = torch.tensor(tables, dtype=torch.int32, device=self.device)
            meta.decode_context_lens = torch.tensor(
                [c.num_computed_before + 1 for c in out.decodes],
                dtype=torch.int32,
                device=self.device,
            )
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        return ids, pos, meta, logit_rows

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepResult:
        ids, pos, meta, logit_rows = self.build_inputs(out)
        for span in meta.prefills:
            span.block_table = span.block_table.to(self.device)
        hidden = self.model.forward(ids, pos, self.kv_caches, meta)
        chunks = out.decodes + out.prefills
        sampled = [c.seq for c in chunks if c.samples]
        if not sampled:
            return StepResult([], SampleResult([], []))
        rows = torch.tensor(logit_rows, dtype=torch.long, device=hidden.device)
        logits = self.model.compute_logits(hidden.index_select(0, rows)).float().cpu()
        return StepResult(sampled, sample(logits, sampled))
