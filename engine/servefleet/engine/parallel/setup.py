"""What a tensor-parallel engine refuses at start-up, and how a rank loads its shard.

Refused by name (one line, exit 2), because they would be wrong rather than slow split
over ranks: speculative decoding (its draft model and verification are one process's),
LoRA adapters (their low-rank products are not split), and a WORLD_SIZE other than the
TP × PP ranks the sizes need. KV-block transfer and embeddings are turned off rather than
refused (their endpoints answer 400): they read one process's KV cache or hidden states,
which hold only that rank's heads (or layers).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from servefleet.api.rank_place import RankPlace, rank_place
from servefleet.engine.config import EngineConfig, EngineSettingsError
from servefleet.engine.model.conversion_cache import Checkpoint
from servefleet.engine.model.loader import LoadedModel
from servefleet.engine.parallel.group import ParallelGroup, join_group
from servefleet.engine.parallel.shard import shard_checkpoint
from servefleet.engine.parallel.stages import stage_checkpoint

log = logging.getLogger("servefleet.engine.parallel")


def check_parallel_settings(config: EngineConfig, place: RankPlace) -> None:
    """Refuse what does not combine with a split model (`EngineSettingsError`, one line)."""
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    sizes = [f"--tensor-parallel-size {tp}"] if tp > 1 or pp == 1 else []
    if pp > 1:
        sizes.append(f"--pipeline-parallel-size {pp}")
    size = " with ".join(sizes)
    if place.world_size != tp * pp:
        raise EngineSettingsError(
            f"{size} needs WORLD_SIZE={tp * pp} processes, "
            f"the environment says WORLD_SIZE={place.world_size}"
        )
    if config.pipeline_micro_batches > 1 and pp == 1:
        raise EngineSettingsError(
            f"--pipeline-micro-batches {config.pipeline_micro_batches} needs "
            "--pipeline-parallel-size > 1 (micro-batches overlap pipeline stages)"
        )
    if tp * pp == 1:
        return
    refused = {
        "--speculative-config": config.speculative_config is not None,
        "--enable-lora": config.enable_lora,
    }
    for flag, asked in refused.items():
        if asked:
            raise EngineSettingsError(f"{flag} is not supported with {size}")


def parallel_device(device: torch.device, place: RankPlace) -> torch.device:
    """CUDA ranks take one GPU each (cuda:LOCAL_RANK); CPU ranks share the CPU."""
    if device.type != "cuda" or place.world_size == 1:
        return device
    chosen = torch.device("cuda", place.local_rank)
    torch.cuda.set_device(chosen)
    return chosen


def attach_group(loaded: LoadedModel, group: ParallelGroup) -> None:
    """Make the loaded share a rank of `group`: a tensor shard's partial sums meet in
    all-reduces within its stage; a pipeline stage hands its output to the next stage."""
    if group.pipeline:
        loaded.model.set_pipeline_stage(last=group.stage == group.stages - 1)
    if group.tensor_size > 1:
        vocab_start = group.tensor_rank * loaded.config.vocab_size  # the shard's own rows
        loaded.model.set_tensor_parallel(group.all_reduce, vocab_start)


def shard_for(group: ParallelGroup) -> Callable[[Checkpoint], Checkpoint]:
    """The checkpoint transform giving `group`'s rank its share: its stage's layers, then
    its tensor shard of those (heads, KV heads, MLP columns, vocabulary rows)."""

    def share(checkpoint: Checkpoint) -> Checkpoint:
        if group.pipeline:
            checkpoint = stage_checkpoint(checkpoint, group.stage, group.stages)
        if group.tensor_size > 1:
            checkpoint = shard_checkpoint(checkpoint, group.tensor_rank, group.tensor_size)
        return checkpoint

    return share


def this_place() -> RankPlace:
    """This process's place from torch's environment; a malformed one refused in one line."""
    try:
        return rank_place()
    except ValueError as exc:
        raise EngineSettingsError(f"tensor parallel environment: {exc}") from None


def leader_group(config: EngineConfig, device: torch.device) -> ParallelGroup | None:
    """Rank 0's group when the model is split (None: one process holds it all)."""
    place = this_place()
    check_parallel_settings(config, place)
    if place.world_size == 1:
        return None
    if not place.is_leader:
        raise EngineSettingsError(f"rank {place.rank} runs the worker loop, not the server")
    return join_rank(config, place, device)


def join_rank(config: EngineConfig, place: RankPlace, device: torch.device) -> ParallelGroup:
    """Join this replica's group: --pipeline-parallel-size stages of
    --tensor-parallel-size shards each."""
    tensor = config.tensor_parallel_size
    group = join_group(place, parallel_device(device, place), config.dist_timeout, tensor)
    group.micro_batch_parts = config.pipeline_micro_batches
    return group
