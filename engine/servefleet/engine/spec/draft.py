"""Draft-model proposals: a smaller model of the same vocabulary writes k greedy tokens.

The draft keeps a shadow of each target sequence (the target's tokens, then its own
proposals) in a paged KV cache of its own: its own block pool and cache tensors, with
the target's block size and block count, so whatever the target holds, the draft can
hold too. Each step the shadow is synced with the target: proposals the target accepted
keep their KV, the rest is rolled back, and tokens the draft has not seen yet (the
prompt, the target's own tokens) are caught up in the first of the k draft passes.

Proposals are greedy, so the proposal is a deterministic function of the tokens; the
verifier's rule (accept while the target's own draw at that position equals the
proposal) is then rejection sampling with a one-hot draft distribution, min(1, p/q) =
p(proposal), and every output is exactly what the target alone would write.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from servefleet.engine.kv_cache import KVCacheManager
from servefleet.engine.runner import CausalLM, ModelRunner
from servefleet.engine.sampling_params import SamplingParams
from servefleet.engine.scheduler import ScheduledChunk, SchedulerOutput
from servefleet.engine.sequence import Sequence

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
    ) -> None:
        self.runner = ModelRunner(model, kv_caches, kv_cache.block_size, device)
        self.kv_cache = kv_cache
        self._shadows: dict[int, _Shadow] = {}  # by the target's seq_id

    def propose(self, requests: list[tuple[Sequence, int]]) -> list[list[int]]:
        """Up to `limit` greedy proposals for each (target sequence, limit), in one batched
        draft pass per proposed position."""
        shadows = [self._sync(seq) for seq, _ in requests]
        drafts: list[list[int]] = [[] for _ in requests]
        for _ in range(max((limit for _, limit in requests), default=0)):
            out = SchedulerOutput()
            for (seq, limit), shadow, draft in zip(requests, shadows, drafts, strict=True):
                if len(draft) < limit and seq.seq_id in self._shadows:
                    chunk = self._schedule(seq, shadow)
                    if chunk is not None:
                        (out.decodes if chunk.num_new_tokens == 1 else out.prefills).append(chunk)
            if out.is_empty:
                break
            result = self.runner.execute(out)
            tokens = result.token_by_seq_id()
            for chunk in out.chunks:
                chunk.seq.num_computed_tokens += chunk.num_new_tokens
            for shadow, draft in zip(shadows, drafts, strict=True):
                new = tokens.get(shadow.seq.seq_id)
                if new:
                    shadow.seq.token_ids.append(new[0])
                    draft.append(new[0])
        return drafts

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
