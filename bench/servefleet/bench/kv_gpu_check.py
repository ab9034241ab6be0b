"""KV transfer on one device: blocks moved between two caches through the wire format, checked
and timed against recomputing them (CUDA, where the CPU tests cannot go; runs on a CPU too).

    python -m servefleet.bench.kv_gpu_check [--model FILE.gguf] [--device cuda] [--out DIR]

Two caches (engines A and B below the HTTP server: scheduler, runner, one storage each) on
the device, float32 and int8 KV. A runs a prompt of ~`--prompt-tokens` tokens greedy; its
full blocks are pinned and read out of A's storage, framed (`kv_wire`), decoded and verified
as a puller does, then staged, written and published in B's cache; B runs the same prompt:
its prefix hit must cover every block and its tokens must equal A's and those of a third,
recomputing cache. Times (device synchronised): the prompt's prefill, the export (pin + read
to host bytes), the wire (encode + decode + verify), and the import (stage + write +
publish). The HTTP hop between pods is not in it (`kv_transfer` measures that on loopback).
Writes JSON (with the CPU's flags).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from servefleet.api.kv_blocks import chain, root_hash
from servefleet.api.kv_transfer import WINDOW_BLOCKS
from servefleet.engine.config import EngineConfig
from servefleet.engine.kv_cache import KVCacheManager
from servefleet.engine.kv_fingerprint import fingerprint_fields, kv_fingerprint
from servefleet.engine.kv_store import KVStore, VerifiedBlock
from servefleet.engine.kv_transfer import header_fields
from servefleet.engine.kv_wire import END, WireReader, encode_frame, encode_header
from servefleet.engine.model.kv_layout import allocate_kv_storage, layer_views
from servefleet.engine.model.loader import LoadedModel
from servefleet.engine.process import load_for
from servefleet.engine.runner import ModelRunner
from servefleet.engine.sampling_params import SamplingParams
from servefleet.engine.scheduler import Scheduler, SchedulerConfig
from servefleet.engine.sequence import Sequence

BLOCK = 16
T = TypeVar("T")


class Cache:
    """One engine's cache and the path that fills it: a scheduler and a runner over it."""

    def __init__(self, loaded: LoadedModel, blocks: int, dtype: torch.dtype, device: str):
        storage = allocate_kv_storage(loaded.config, blocks, BLOCK, dtype, device)
        self.kv = KVCacheManager(blocks, BLOCK)
        self.scheduler = Scheduler(SchedulerConfig(8, 4096, 2048), self.kv, [])
        self.runner = ModelRunner(loaded.model, layer_views(storage), BLOCK, torch.device(device))
        fields = fingerprint_fields(loaded, dtype, BLOCK, {})
        self.store = KVStore(storage, self.kv, kv_fingerprint(fields), fields)

    def run(self, prompt: list[int], new_tokens: int) -> Sequence:
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        seq = Sequence(list(prompt), params, 0.0)
        self.scheduler.add(seq)
        with torch.inference_mode():
            while self.scheduler.num_unfinished:
                out = self.scheduler.schedule()
                self.scheduler.update(out, self.runner.execute(out).token_by_seq_id())
        return seq


def timed(device: str, fn: Callable[[], T]) -> tuple[T, float]:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    started = time.perf_counter()
    result = fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return result, time.perf_counter() - started


def export(store: KVStore, hashes: list[int]) -> list[bytes]:
    """The held run of `hashes` as wire frames (header first, end marker last)."""
    frames = [encode_header(header_fields(store, None, len(hashes)))]
    for start in range(0, len(hashes), WINDOW_BLOCKS):
        held, _ = store.pin(hashes[start : start + WINDOW_BLOCKS])
        data = store.read([b.block_id for b in held])
        store.unpin(held)
        frames += [
            encode_frame(b.block_hash, b.parent_hash, b.token_ids, None, d)
            for b, d in zip(held, data, strict=True)
        ]
    return [*frames, END]


def import_(store: KVStore, blocks: list[VerifiedBlock]) -> int:
    committed = 0
    for start in range(0, len(blocks), WINDOW_BLOCKS):
        window = blocks[start : start + WINDOW_BLOCKS]
        ids = store.stage(len(window))
        store.write(ids, [b.data for b in window[: len(ids)]])
        committed += store.commit(ids, window[: len(ids)])
    return committed


def check(
    loaded: LoadedModel, dtype: torch.dtype, device: str, prompt: list[int]
) -> dict[str, Any]:
    # a transfer window (32 blocks) must fit in 10% of the pool, the prompt in the rest
    blocks = max(10 * WINDOW_BLOCKS + 16, 2 * len(prompt) // BLOCK + 64)
    a, b, c = (Cache(loaded, blocks, dtype, device) for _ in range(3))
    on_a, prefill_s = timed(device, lambda: a.run(prompt, 1))
    on_a = a.run(prompt, 16)  # a prefix hit now: only the tokens are wanted
    full = (len(prompt) - 1) // BLOCK
    hashes = chain(root_hash(None), prompt[: full * BLOCK], BLOCK)
    frames, export_s = timed(device, lambda: export(a.store, hashes))
    reader = WireReader(b.store.fingerprint, BLOCK, b.store.bytes_per_block, hashes)
    verified, wire_s = timed(device, lambda: [v for f in frames for v in reader.feed(f)])
    committed, import_s = timed(device, lambda: import_(b.store, verified))
    on_b, recompute = b.run(prompt, 16), c.run(prompt, 16)
    moved = sum(map(len, frames))
    return {
        "ok": on_b.output_token_ids == on_a.output_token_ids == recompute.output_token_ids
        and committed == full == len(verified)
        and on_b.num_cached_tokens == full * BLOCK,
        "prompt_tokens": len(prompt), "blocks": full, "committed": committed,
        "cached_tokens_after_import": on_b.num_cached_tokens, "bytes": moved,
        "prefill_s": round(prefill_s, 4), "export_s": round(export_s, 4),
        "wire_s": round(wire_s, 4), "import_s": round(import_s, 4),
        "transfer_vs_prefill": round((export_s + wire_s + import_s) / prefill_s, 3),
        "export_mb_s": round(moved / export_s / 1e6), "import_mb_s": round(moved / import_s / 1e6),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    from servefleet.engine.cpu_isa import cpu_flags, ensure_safe_cpu_isa

    ensure_safe_cpu_isa()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="a GGUF file or a builtin")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--kv-dtypes", default="float32,int8", help="int8: CPU engines only")
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    args = p.parse_args(argv)
    loaded = load_for(EngineConfig(model=args.model, device=args.device, dtype="float32"))
    words = " ".join(f"Note {i}: the tide rose {i * 7 % 13} feet at the pier." for i in range(400))
    prompt = loaded.tokenizer.encode(words)[: args.prompt_tokens]
    result: dict[str, Any] = {
        "benchmark": "kv_gpu_check", "device": args.device, "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
        "cpu_flags": sorted(cpu_flags()),
    }  # fmt: skip
    names = args.kv_dtypes.split(",")
    for name in names:
        dtype = getattr(torch, name)
        check(loaded, dtype, args.device, prompt[:64])  # warm-up: first-call costs
        result[name] = check(loaded, dtype, args.device, prompt)
        print(name, json.dumps(result[name]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kv_gpu_check.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0 if all(result[n]["ok"] for n in names) else 1


if __name__ == "__main__":
    sys.exit(main())
