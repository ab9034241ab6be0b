"""Draft-model proposals: a smaller model of the same vocabulary writes k tokens.

The draft keeps a shadow of each target sequence (the target's tokens, then its own
proposals) in a paged KV cache of its own: its own block pool and cache tensors, with
the target's block size and block count, so whatever the target holds, the draft can
hold too. Each step the shadow is synced with the target: proposals the target accepted
keep their KV, the rest is rolled back, and tokens the draft has not seen yet (the
prompt, the target's own tokens) are caught up in the first of the k draft passes.

For a greedy request the proposals are the draft's argmax, a deterministic function of
the tokens: verification accepts while the target's own token equals them, so outputs are
exactly what the target alone writes. For a sampled request the draft draws each proposal
from its own distribution q, processed as the target processes its rows (logit bias,
penalties, temperature, top-k/top-p: the target's own chain, `sampler.request_probs`) with a
counter-based uniform of its own stream, and hands q to verification (`verify.Proposal`),
which applies standard speculative sampling: a draft that resembles the target is accepted
with probability sum(min(p, q)) per token instead of p(argmax q).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from servefleet.engine.kv_cache import KVCacheManager
from servefleet.engine.runner import CausalLM, ModelRunner
from servefleet.engine.sampler import draw_token, request_probs
from servefleet.engine.sampling_params import SamplingParams
from servefleet.engine.scheduler import ScheduledChunk, SchedulerOutput
from servefleet.engine.sequence import Sequence
from servefleet.engine.spec.verify import DRAFT_STREAM, Proposal, stream_uniform

DRAFT_PARAMS = SamplingParams(max_tokens=1 << 30, temperature=0.0, ignore_eos=True)


@dataclass
class _Shadow:
    seq: Sequence  # the draft's view: token_ids, block_table, num_computed_tokens
    num_synced: int  # target tokens it held at the last proposal; later ones were drafted


class DraftProposer:
    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        kv_cache: KVCacheManager,
        device: torch.device,
        *,
        sample_proposals: bool = False,
    ) -> None:
        self.runner = ModelRunner(model, kv_caches, kv_cache.block_size, device)
        self.model = model
        self.kv_cache = kv_cache
        self.sample_proposals = sample_proposals  # False: argmax proposals for every request
        self._shadows: dict[int, _Shadow] = {}  # by the target's seq_id

    def propose(self, requests: list[tuple[Sequence, int]]) -> list[Proposal]:
        """Up to `limit` proposals for each (target sequence, limit), in one batched draft
        pass per proposed position: argmax for greedy requests, sampled (with q) otherwise."""
        shadows = [self._sync(seq) for seq, _ in requests]
        drafts = [Proposal() for _ in requests]
        for _ in range(max((limit for _, limit in requests), default=0)):
            out = SchedulerOutput()
            for (seq, limit), shadow, draft in zip(requests, shadows, drafts, strict=True):
                if len(draft) < limit and seq.seq_id in self._shadows:
                    chunk = self._schedule(seq, shadow)
                    if chunk is not None:
                        (out.decodes if chunk.num_new_tokens == 1 else out.prefills).append(chunk)
            if out.is_empty:
                break
            logits = self._logits(out)
            for chunk in out.chunks:
                chunk.seq.num_computed_tokens += chunk.num_new_tokens
            for (seq, _), shadow, draft in zip(requests, shadows, drafts, strict=True):
                row = logits.get(shadow.seq.seq_id)
                if row is not None:
                    token = self._choose(seq, draft, row)
                    shadow.seq.token_ids.append(token)
                    draft.append(token)
        return drafts

    @torch.inference_mode()
    def _logits(self, out: SchedulerOutput) -> dict[int, torch.Tensor]:
        """The draft's next-token logits of every scheduled shadow, by its seq_id (each
        chunk runs to its shadow's last token, so every chunk has one row)."""
        ids, pos, meta, logit_rows = self.runner.build_inputs(out)
        device = self.runner.device
        for span in meta.prefills:
            span.block_table = span.block_table.to(device)
        hidden = self.model.forward(ids, pos, self.runner.kv_caches, meta)
        rows = torch.tensor(logit_rows, dtype=torch.long, device=hidden.device)
        logits = self.model.compute_logits(hidden.index_select(0, rows)).float().cpu()
        return {chunk.seq.seq_id: logits[i] for i, chunk in enumerate(out.chunks)}

    def _choose(self, seq: Sequence, draft: Proposal, row: torch.Tensor) -> int:
        """The next proposal for target `seq`: the draft's argmax when the request is greedy,
        else a draw from q at the target's output position (q kept for verification)."""
        if seq.params.greedy or not self.sample_proposals:
            return int(row.max(dim=-1).indices)  # first maximum on ties, as the sampler's
        q = request_probs(row, seq, draft)
        draft.probs.append(q)
        position = seq.num_output_tokens + len(draft)
        return draw_token(q, stream_uniform(seq, DRAFT_STREAM, position))

    def _schedule(self, seq: Sequence, shadow: _Shadow) -> ScheduledChunk | None:
        """The shadow's next pass: every token it has not computed yet."""
        draft_seq = shadow.seq
        before = draft_seq.num_computed_tokens
        num_new = draft_seq.num_tokens - before
        if self.kv_cache.allocate(draft_seq, num_new, []):
            return ScheduledChunk(draft_seq, num_new, before)
        self.forget(seq)  # no room: start afresh at a later step rather than hold blocks
        return None

    def _sync(self, seq: Sequence) -> _Shadow:
        """The shadow of `seq`, its tokens the target's and its KV valid up to where the
        draft's tokens and the target's agree (always leaving the last one to compute)."""
        shadow = self._shadows.get(seq.seq_id)
        if shadow is None:
            shadow = _Shadow(Sequence(list(seq.token_ids), DRAFT_PARAMS, 0.0), seq.num_tokens)
            self._shadows[seq.seq_id] = shadow
            return shadow
        mine, target = shadow.seq.token_ids, seq.token_ids
        agree = shadow.num_synced
        end = min(len(mine), len(target))
        while agree < end and mine[agree] == target[agree]:
            agree += 1
        del mine[agree:]
        mine.extend(target[agree:])
        draft_seq = shadow.seq
        draft_seq.num_computed_tokens = min(draft_seq.num_computed_tokens, agree, len(mine) - 1)
        self.kv_cache.trim(draft_seq)
        shadow.num_synced = len(mine)
        return shadow

    def forget(self, seq: Sequence) -> None:
        """Give the draft's blocks of `seq` back (it finished, or the draft ran out of room)."""
        shadow = self._shadows.pop(seq.seq_id, None)
        if shadow is not None:
            self.kv_cache.free(shadow.seq)

    def check_all_free(self) -> None:
        self.kv_cache.check_all_free()
