"""A non-zero rank: join the group, load this rank's shard, then run rank 0's steps.

No HTTP, no scheduler: the KV cache is sized as rank 0 sizes it (the smallest count of
blocks over the ranks wins), and the loop runs each broadcast plan on this shard. A lost
group (rank 0 or a peer gone, or silent past --dist-timeout) is one log line and exit 1.
"""

from __future__ import annotations

import logging

import torch

from servefleet.engine.config import EngineConfig, EngineSettingsError
from servefleet.engine.kernels import KernelUnavailableError
from servefleet.engine.kv_plan import kv_cache_plan
from servefleet.engine.model.kv_layout import allocate_kv_storage, layer_views
from servefleet.engine.parallel.group import GroupLostError, leave_group
from servefleet.engine.parallel.runner import follow_plans
from servefleet.engine.parallel.setup import check_parallel_settings, join_rank, this_place
from servefleet.engine.parallel.shard import ShardingError
from servefleet.engine.process import load_for, resolve_device
from servefleet.engine.runner import ModelRunner
from servefleet.text.builtin import UnknownModelError

log = logging.getLogger("servefleet.engine.parallel")


def run_worker(config: EngineConfig) -> int:
    """Exit status: 0 when rank 0 said stop, 1 when the group was lost, 2 on bad settings."""
    try:
        place = this_place()
        check_parallel_settings(config, place)
        group = join_rank(config, place, resolve_device(config.device))
        device = group.device
        if config.threads:
            torch.set_num_threads(config.threads)
        loaded = load_for(config, group)
        num_blocks, _, dtype, _ = kv_cache_plan(config, loaded)
        num_blocks = group.agree_min(num_blocks)
        storage = allocate_kv_storage(loaded.config, num_blocks, config.block_size, dtype, device)
        runner = ModelRunner(loaded.model, layer_views(storage), config.block_size, device)
        log.info("tensor_parallel_worker_ready: rank=%d blocks=%d", place.rank, num_blocks)
        steps = follow_plans(runner, group)
    except GroupLostError as exc:
        log.error("tensor_parallel_group_lost: %s", exc)
        return 1
    except (UnknownModelError, KernelUnavailableError, EngineSettingsError, ShardingError) as exc:
        log.error("cannot start: %s", exc)
        return 2
    log.info("tensor_parallel_worker_stopped: rank=%d steps=%d", place.rank, steps)
    leave_group()
    return 0
