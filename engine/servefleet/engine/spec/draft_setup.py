"""A draft model made ready to propose: its vocabulary checked, its own paged KV cache."""

from __future__ import annotations

import logging

import torch

from servefleet.engine.config import EngineSettingsError
from servefleet.engine.kv_cache import KVCacheManager
from servefleet.engine.model.kv_layout import allocate_kv_cache
from servefleet.engine.model.loader import LoadedModel
from servefleet.engine.spec.draft import DraftProposer

log = logging.getLogger(__name__)


def check_same_vocabulary(draft: LoadedModel, target: LoadedModel) -> None:
    """A proposal is a token id of the draft's vocabulary, verified as one of the target's:
    the two must name the same tokens by the same ids."""
    if draft.config.vocab_size != target.config.vocab_size:
        raise EngineSettingsError(
            f"the draft model {draft.name!r} has {draft.config.vocab_size} token ids, the "
            f"target {target.name!r} {target.config.vocab_size}: they must share a tokenizer"
        )
    if draft.tokenizer.backend.get_vocab() != target.tokenizer.backend.get_vocab():
        raise EngineSettingsError(
            f"the draft model {draft.name!r} and the target {target.name!r} have different "
            "vocabularies: they must share a tokenizer"
        )


def build_draft_proposer(
    draft: LoadedModel,
    target: LoadedModel,
    num_blocks: int,
    block_size: int,
    kv_dtype: torch.dtype,
    *,
    sample_proposals: bool = False,
) -> DraftProposer:
    """The draft's KV cache has the target's block count and size, so it never runs out
    where the target does not (its bytes are the draft's: layers x KV heads x head size)."""
    check_same_vocabulary(draft, target)
    device = next(draft.model.parameters()).device
    kv_caches = allocate_kv_cache(draft.config, num_blocks, block_size, kv_dtype, device)
    log.info(
        "draft_model: model=%s layers=%d kv_blocks=%d kv_bytes=%d",
        draft.name,
        draft.config.num_layers,
        num_blocks,
        sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv_caches),
    )
    manager = KVCacheManager(num_blocks, block_size, enable_caching=False)
    return DraftProposer(draft.model, kv_caches, manager, device, sample_proposals=sample_proposals)
