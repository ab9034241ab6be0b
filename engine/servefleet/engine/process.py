"""Assemble an engine from its config, warm it up, and serve it until drained.

Cold start (process start to ready) is measured here and logged, because it is
what the autoscaler pays for every replica it adds.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from servefleet.engine.attention import PagedAttention
from servefleet.engine.chunk_budget import chunk_budget_for
from servefleet.engine.config import EngineConfig, EngineSettingsError
from servefleet.engine.http_server import EngineHttpServer
from servefleet.engine.kernels import (
    KernelUnavailableError,
    select_decode_kernel,
    select_fused_ops,
    select_lora_kernel,
    select_matmul,
)
from servefleet.engine.kv_cache import KVCacheManager
from servefleet.engine.kv_fingerprint import fingerprint_fields, kv_fingerprint
from servefleet.engine.kv_plan import kv_cache_plan
from servefleet.engine.kv_store import KVStore
from servefleet.engine.kv_warm_gate import WarmGate
from servefleet.engine.loop import Engine
from servefleet.engine.lora.setup import build_lora_registry
from servefleet.engine.metrics import EngineMetrics
from servefleet.engine.model.kv_layout import (
    allocate_kv_storage,
    layer_views,
)
from servefleet.engine.model.loader import LoadedModel, load_model
from servefleet.engine.parallel.group import GroupLostError, ParallelGroup, leave_group
from servefleet.engine.parallel.runner import ParallelRunner
from servefleet.engine.parallel.setup import attach_group, leader_group, shard_for
from servefleet.engine.parallel.shard import ShardingError
from servefleet.engine.runner import ModelRunner
from servefleet.engine.sampling_params import SamplingParams
from servefleet.engine.scheduler import Scheduler, SchedulerConfig
from servefleet.engine.sequence import Sequence
from servefleet.engine.server import build_app
from servefleet.engine.serving_state import ServingState
from servefleet.engine.spec.draft_setup import build_draft_proposer
from servefleet.engine.spec.speculator import Speculator
from servefleet.engine.step_cost import StepCostModel
from servefleet.text.builtin import UnknownModelError
from servefleet.text.chat_template import ChatTemplate

log = logging.getLogger("servefleet.engine")


def process_uptime() -> float:
    """Seconds since this process started (from /proc where available)."""
    try:
        ticks = os.sysconf("SC_CLK_TCK")
        start = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19]) / ticks
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - start)
    except (OSError, ValueError, IndexError):
        return time.process_time()


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        # Without native bf16 units a CPU runs bf16 matmuls slower than float32.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


@dataclass
class BuiltEngine:
    engine: Engine
    state: ServingState
    loaded: LoadedModel
    kv_cache: KVCacheManager


def load_for(config: EngineConfig, group: ParallelGroup | None = None) -> LoadedModel:
    """The model `config` names (with `group`: this rank's shard of it)."""
    device = resolve_device(config.device) if group is None else group.device
    dtype = resolve_dtype(config.dtype, device)
    kernel_name, kernel = select_decode_kernel(device, prefer=config.decode_kernel)
    if config.matmul_dtype != "float32" and dtype != torch.float32:
        raise EngineSettingsError(
            f"--matmul-dtype {config.matmul_dtype} rounds a float32 model's matmuls; "
            f"this one runs in {str(dtype).removeprefix('torch.')} throughout"
        )
    matmul = select_matmul(device, prefer=config.matmul, dtype=getattr(torch, config.matmul_dtype))
    t0 = time.monotonic()
    loaded = load_model(
        config.model,
        dtype=dtype,
        device=str(device),
        attn_impl=PagedAttention(kernel),
        max_positions=config.max_model_len,
        packed_weights=config.packed_weights and matmul.name != "torch",
        quantization=config.quantization,
        shard=None if group is None else shard_for(group),
    )
    if group is not None:
        attach_group(loaded, group)
    loaded.model.set_matmul(matmul)
    # The fused ops go with the C matmuls: --matmul torch keeps the model all-PyTorch.
    fused = select_fused_ops(device) if matmul.name != "torch" else None
    loaded.model.set_fused_ops(fused)
    loaded.model.set_lora_kernel(select_lora_kernel(device, matmul))
    packed = loaded.model.packed_summary()
    log.info(
        "model_loaded: model=%s dtype=%s device=%s decode_kernel=%s matmul=%s fused_ops=%s "
        "packed_weights=%d packed_mb=%.1f load_s=%.2f",
        loaded.name,
        str(dtype).removeprefix("torch."),
        device,
        kernel_name,
        matmul.name,
        fused is not None,
        packed["tensors"],
        packed["bytes"] / 1e6,
        time.monotonic() - t0,
    )
    return loaded


def build_speculator(
    config: EngineConfig,
    loaded: LoadedModel,
    kv_cache: tuple[int, torch.dtype],
    draft: LoadedModel | None = None,
) -> Speculator | None:
    """Proposals stay within the rows the C decode matmuls take, where a step's logits are
    the same bits whatever its rows (so verification equals a plain step). `kv_cache`:
    the target's block count and dtype, which a draft model's own cache takes too."""
    spec = config.speculative_config
    if spec is None:
        return None
    max_rows = getattr(loaded.model.matmul, "max_rows", config.max_num_batched_tokens)
    log.info("speculative_decoding: %s", spec.model_dump_json())
    if spec.method != "draft_model" or spec.model is None:
        return Speculator(spec, max_rows)
    draft = draft or load_for(config.model_copy(update={"model": spec.model}))
    proposer = build_draft_proposer(
        draft,
        loaded,
        kv_cache[0],
        config.block_size,
        kv_cache[1],
        sample_proposals=spec.draft_proposals == "sampled",
    )
    return Speculator(spec, max_rows, proposer)


def build_engine(
    config: EngineConfig,
    loaded: LoadedModel | None = None,
    draft: LoadedModel | None = None,
    group: ParallelGroup | None = None,
) -> BuiltEngine:
    """Everything but the HTTP server; `loaded` (and `draft`, a draft model for
    speculative decoding) let tests share one model between engines; `group`: rank 0 of
    a tensor-parallel replica (the model is its shard, every step goes to all ranks)."""
    if config.threads:
        torch.set_num_threads(config.threads)
    loaded = loaded or load_for(config, group)
    device = next(loaded.model.parameters()).device
    num_blocks, per_block, dtype, max_model_len = kv_cache_plan(config, loaded)
    invariant = loaded.model.attn_impl.per_row_prefill
    if group is not None:  # every rank holds as many blocks: the scheduler's tables index all
        num_blocks = group.agree_min(num_blocks)
    storage = allocate_kv_storage(loaded.config, num_blocks, config.block_size, dtype, device)
    log.info(
        "kv_cache: blocks=%d tokens=%d bytes=%d dtype=%s block_size=%d max_model_len=%d "
        "prefix_caching=%s batch_invariant=%s",
        num_blocks,
        num_blocks * config.block_size,
        num_blocks * per_block,
        str(dtype).removeprefix("torch."),
        config.block_size,
        max_model_len,
        config.enable_prefix_caching,
        invariant,
    )
    kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
    step_cost = StepCostModel()
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=max_model_len,
        ),
        kv,
        loaded.tokenizer.eos_token_ids,
        build_speculator(config, loaded, (num_blocks, dtype), draft),
        chunk_budget_for(config.decode_step_target, step_cost, config.block_size),
    )
    runner = (
        ModelRunner(loaded.model, layer_views(storage), config.block_size, device)
        if group is None
        else ParallelRunner(loaded.model, layer_views(storage), config.block_size, device, group)
    )
    metrics = EngineMetrics(config.name)
    metrics.set_kv_cache_layout(str(dtype).removeprefix("torch."), per_block // config.block_size)
    engine = Engine(scheduler, runner, loaded.tokenizer, metrics, config.stall_timeout, step_cost)
    state = ServingState(
        engine=engine,
        tokenizer=loaded.tokenizer,
        chat_template=ChatTemplate(loaded.chat_template, loaded.tokenizer.special_tokens_map()),
        served_model_name=config.name,
        max_model_len=max_model_len,
        block_size=config.block_size,
        num_kv_blocks=num_blocks,
        max_queue_depth=config.max_queue_depth,
        tool_call_parser=config.tool_call_parser,
        prepare_timeout_s=config.prepare_timeout,
        loras=build_lora_registry(config, loaded, engine) if config.enable_lora else None,
        # A rank's cache holds its heads only: no blocks to move between engines.
        kv_store=build_kv_store(config, loaded, storage, kv) if group is None else None,
        kv_peer_networks=config.peer_networks,
    )
    return BuiltEngine(engine, state, loaded, kv)


def build_kv_store(
    config: EngineConfig, loaded: LoadedModel, storage: torch.Tensor, kv: KVCacheManager
) -> KVStore:
    """The cache's storage and identity, for moving blocks between engines."""
    settings = {
        "matmul_dtype": config.matmul_dtype,
        "packed_weights": config.packed_weights,
        "quantization": config.quantization,
    }
    fields = fingerprint_fields(loaded, storage.dtype, config.block_size, settings)
    return KVStore(storage, kv, kv_fingerprint(fields), fields)


def warm_up(built: BuiltEngine) -> None:
    """Run prefill and batched decode once so the first real request pays no first-call costs."""
    scheduler, runner = built.engine.scheduler, built.engine.runner
    vocab = built.loaded.config.vocab_size
    for batch in (1, 4):
        for i in range(batch):
            prompt = [(7 + 13 * (i + j)) % vocab for j in range(24 + i)]
            scheduler.add(Sequence(prompt, SamplingParams(max_tokens=3, ignore_eos=True), 0.0))
        while scheduler.num_unfinished:
            out = scheduler.schedule()
            scheduler.update(out, runner.execute(out).token_by_seq_id())
    built.kv_cache.pool.reset_prefix_cache()
    built.kv_cache.check_all_free()
    built.kv_cache.prefix_queries = built.kv_cache.prefix_hits = 0


def load_and_warm(
    config: EngineConfig, group: ParallelGroup | None = None
) -> tuple[BuiltEngine, float]:
    """The engine, warmed up, and the warm-up's seconds."""
    built = build_engine(config, group=group)
    t0 = time.monotonic()
    warm_up(built)
    return built, time.monotonic() - t0


def _warm_compiler(built: BuiltEngine) -> None:
    try:
        built.state.structured.warm_up()
    except Exception as exc:  # the first constrained request will try again, and say why
        log.warning("grammar compiler warm-up failed: %r", exc)


def serve(config: EngineConfig, http_server: EngineHttpServer) -> int:
    """Engine loop on the main thread, HTTP server on a second one, until drained.

    The HTTP server already answers "loading" on its bound port (see http_server); the
    model loads behind it, then the gate opens onto the real app (a signal before that ends
    the process, see DrainingServer).
    """
    server, gate, http = http_server.server, http_server.gate, http_server.thread
    try:
        group = leader_group(config, resolve_device(config.device))
        built, warm_s = load_and_warm(config, group)
        built.state.api_key = config.api_key
        gate.open(build_app(built.state))
        server.serving = built.state  # from here on a signal drains
    except GroupLostError as exc:
        log.error("tensor_parallel_group_lost: %s", exc)
        server.should_exit = True
        http.join(5)
        return 1
    except (UnknownModelError, KernelUnavailableError, EngineSettingsError, ShardingError) as exc:
        log.error("cannot start: %s", exc)  # one line: the cause is the user's input
        server.should_exit = True
        http.join(5)
        return 2
    if not http.is_alive():
        log.error("http server stopped during start-up")
        return 1
    if config.kv_warm_start_seconds > 0 and config.enable_prefix_caching:
        built.state.kv_warm = WarmGate(config.kv_warm_start_seconds)  # /ready: kv-warming
    built.state.ready = True
    # The grammar compiler's processes start now, beside the loop, not at the first
    # constrained request (their first start imports xgrammar and torch: seconds of CPU,
    # which the model load, the cold start the autoscaler pays, does not share).
    threading.Thread(target=_warm_compiler, args=(built,), daemon=True).start()
    cold = process_uptime()
    built.engine.metrics.cold_start.set(cold)
    log.info(
        "ready: url=http://%s:%d model=%s cold_start_s=%.2f warmup_s=%.2f api_key=%s",
        config.host,
        config.port,
        config.name,
        cold,
        warm_s,
        "required" if config.api_key else "off",
    )
    built.engine.run()
    fatal = built.engine.fatal_error
    if fatal is not None:
        if isinstance(fatal, GroupLostError):
            log.error("tensor_parallel_group_lost: %s; exiting", fatal)
        else:
            log.error("engine loop died, exiting: %r", fatal)
        server.should_exit = True
        http.join(10)
        return 1
    built.engine.runner.close()
    http.join(config.drain_timeout + 10)
    leave_group()
    return 0
