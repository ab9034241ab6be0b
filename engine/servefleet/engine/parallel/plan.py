"""A step's plan as two int64 tensors: what rank 0 broadcasts so every rank runs the step.

The scheduler and block tables live on rank 0 only; the other ranks need just the
step's tensors: token ids, positions, KV slots, decode block tables and context lengths,
prompt chunks and the rows whose logits rank 0 samples. A fixed-size header first (its
command and lengths), then one flat payload: two broadcasts a step, no pickling.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch

from servefleet.engine.attention import AttentionMetadata, PrefillSpan

HEADER = (
    8  # command, tokens, decode rows, table width, prefills, logit rows, prefill blocks, payload
)


class Command(IntEnum):
    STEP = 1  # run the step in the payload
    IDLE = 2  # nothing to run: rank 0 is alive (so a dead peer is noticed while idle)
    STOP = 3  # leave the loop and exit 0


@dataclass
class StepPlan:
    ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    meta: AttentionMetadata
    logit_rows: list[int]


def header(command: Command) -> torch.Tensor:
    out = torch.zeros(HEADER, dtype=torch.long)
    out[0] = int(command)
    return out


def encode(plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """(header, payload) of a step (every tensor on the CPU, int64)."""
    meta = plan.meta
    tables = meta.decode_block_tables
    lens = meta.decode_context_lens
    width = 0 if tables is None else tables.shape[1]
    spans = [
        torch.tensor([p.start, p.end, p.num_cached, p.block_table.numel()]) for p in meta.prefills
    ]
    parts = [plan.ids.cpu(), plan.positions.cpu(), meta.slot_mapping.cpu()]
    if tables is not None and lens is not None:
        parts += [tables.cpu().long().reshape(-1), lens.cpu().long()]
    parts += spans + [p.block_table.cpu().long() for p in meta.prefills]
    parts.append(torch.tensor(plan.logit_rows, dtype=torch.long))
    payload = torch.cat(parts)
    head = header(Command.STEP)
    head[1:] = torch.tensor(
        [
            plan.ids.numel(),
            meta.num_decodes if tables is not None else 0,
            width,
            len(meta.prefills),
            len(plan.logit_rows),
            sum(p.block_table.numel() for p in meta.prefills),
            payload.numel(),
        ]
    )
    return head, payload


def decode(
    head: torch.Tensor, payload: torch.Tensor, block_size: int, device: torch.device
) -> StepPlan:
    """The step `encode` wrote, its tensors on `device` (block tables as the runner makes them)."""
    tokens, decodes, width, prefills, rows, _, _ = (int(x) for x in head[1:].tolist())
    at = 0

    def take(count: int) -> torch.Tensor:
        nonlocal at
        at += count
        return payload[at - count : at]

    ids, positions, slots = take(tokens), take(tokens), take(tokens)
    meta = AttentionMetadata(slot_mapping=slots.to(device), block_size=block_size)
    if width:
        tables = take(decodes * width).view(decodes, width)
        meta.num_decodes = decodes
        meta.decode_block_tables = tables.to(device=device, dtype=torch.int32)
        meta.decode_context_lens = take(decodes).to(device=device, dtype=torch.int32)
    spans = [take(4).tolist() for _ in range(prefills)]
    for start, end, cached, blocks in spans:
        meta.prefills.append(PrefillSpan(start, end, cached, take(blocks).to(device)))
    logit_rows = take(rows).tolist()
    return StepPlan(ids.to(device), positions.to(device), meta, logit_rows)
