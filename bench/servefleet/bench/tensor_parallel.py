"""Tensor (and pipeline) parallelism's costs here: TP=2 against TP=1, same model, same run.

Ranks are processes talking over gloo (TCP on loopback). Per decode step it records the
step's time, the time rank 0 spends inside collectives (waiting for the slower rank
included), the bytes it moves (the plan broadcast, the all-reduces of o/down/embedding,
the logits gather: the bytes of the tensors rank 0 hands to collectives, not wire bytes)
per generated token, and start-up (group join, load, shard, KV cache). Both sides get the
same cores: TP=1 runs tp × pp × --threads torch threads, each rank --threads. `--pp 2`
splits the compared model into 2 pipeline stages as well (TP × PP ranks), and
`--micro-batches M` cuts its steps (`--pipeline-micro-batches`).
On a 2-core CPU the split model is slower: the two ranks share the cores the single
process had, and ~2 all-reduces a layer add latency; the figures say by how much.

    uv run python -m servefleet.bench.tensor_parallel [--tp 2] [--pp 1] [--tokens 32] [--batch 1 4]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from servefleet.bench.bench_output import save_result

SHAPE = {"vocab": 32000, "hidden": 512, "inter": 1536, "layers": 8, "heads": 8, "kv_heads": 4}


def write_model(folder: Path) -> str:
    """A random Llama of SmolLM2's order of size whose heads split over 2, 4 and 8 ranks."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models

    s, gen = SHAPE, torch.Generator().manual_seed(0)
    hd = s["hidden"] // s["heads"]

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.05

    t = {"model.embed_tokens.weight": rand(s["vocab"], s["hidden"]) * 20}
    t["model.norm.weight"] = torch.ones(s["hidden"])
    for i in range(s["layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = torch.ones(s["hidden"])
        t[p + "post_attention_layernorm.weight"] = torch.ones(s["hidden"])
        for name, rows in (("q", s["heads"]), ("k", s["kv_heads"]), ("v", s["kv_heads"])):
            t[f"{p}self_attn.{name}_proj.weight"] = rand(rows * hd, s["hidden"])
        t[p + "self_attn.o_proj.weight"] = rand(s["hidden"], s["heads"] * hd)
        for name in ("gate", "up"):
            t[f"{p}mlp.{name}_proj.weight"] = rand(s["inter"], s["hidden"])
        t[p + "mlp.down_proj.weight"] = rand(s["hidden"], s["inter"])
    folder.mkdir(parents=True, exist_ok=True)
    save_file(t, str(folder / "model.safetensors"))
    config = {
        "model_type": "llama", "vocab_size": s["vocab"], "hidden_size": s["hidden"],
        "intermediate_size": s["inter"], "num_hidden_layers": s["layers"],
        "num_attention_heads": s["heads"], "num_key_value_heads": s["kv_heads"],
        "max_position_embeddings": 1024, "tie_word_embeddings": True, "eos_token_id": 2,
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    vocab = {f"t{i}": i for i in range(s["vocab"])}
    Tokenizer(models.WordLevel(vocab, unk_token="t0")).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t2"}))
    return str(folder)


def _decode_run(built: Any, batch: int, tokens: int) -> dict[str, float]:
    """Time `tokens` greedy decode steps of `batch` sequences (prefill excluded)."""
    from servefleet.engine.sampling_params import SamplingParams
    from servefleet.engine.sequence import Sequence

    scheduler, runner = built.engine.scheduler, built.engine.runner
    group = getattr(runner, "group", None)
    params = SamplingParams(max_tokens=tokens + 1, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        scheduler.add(Sequence([5 + i * 7 + j for j in range(32)], params, 0.0))
    out = scheduler.schedule()  # the prompts' step: not timed
    scheduler.update(out, runner.execute(out).token_by_seq_id())
    comm = (group.stats.seconds, group.stats.bytes, runner.plan_bytes) if group else (0.0, 0, 0)
    started, steps = time.perf_counter(), 0
    while scheduler.num_unfinished:
        out = scheduler.schedule()
        scheduler.update(out, runner.execute(out).token_by_seq_id())
        steps += 1
    elapsed = time.perf_counter() - started
    now = (group.stats.seconds, group.stats.bytes, runner.plan_bytes) if group else (0.0, 0, 0)
    generated = steps * batch
    return {
        "batch": batch,
        "steps": steps,
        "step_ms": 1000 * elapsed / steps,
        "comm_ms_per_step": 1000 * (now[0] - comm[0]) / steps,
        "bytes_per_token": (now[1] - comm[1]) / generated,
        "plan_bytes_per_step": (now[2] - comm[2]) / steps,
    }


def _leader(settings: dict[str, Any], batches: list[int], tokens: int) -> dict[str, Any]:
    from servefleet.engine.config import EngineConfig
    from servefleet.engine.parallel.setup import leader_group
    from servefleet.engine.process import build_engine, resolve_device

    config = EngineConfig(**settings)
    started = time.perf_counter()
    built = build_engine(config, group=leader_group(config, resolve_device("cpu")))
    startup = time.perf_counter() - started
    runs = [_decode_run(built, b, tokens) for b in batches]
    built.engine.runner.close()
    return {"startup_s": startup, "runs": runs}


def _rank_main(rank: int, world: int, port: int, job: tuple[Any, ...], results: Any) -> None:
    place = {"RANK": rank, "WORLD_SIZE": world, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    os.environ.update({name: str(value) for name, value in place.items()})
    from servefleet.engine.config import EngineConfig
    from servefleet.engine.parallel.worker import run_worker

    settings, batches, tokens = job
    if rank == 0:
        results.put(_leader(settings, batches, tokens))
    else:
        run_worker(EngineConfig(**settings))


def measure(
    model: str, tp: int, threads: int, batches: list[int], tokens: int, pp: int = 1, micro: int = 1
) -> dict[str, Any]:
    settings = {
        "model": model,
        "tensor_parallel_size": tp,
        "pipeline_parallel_size": pp,
        "pipeline_micro_batches": micro,
        "threads": threads,
        "kv_cache_memory": "64MiB",
        "max_num_seqs": max(batches),
    }
    job = (settings, batches, tokens)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    world = tp * pp
    procs = [
        ctx.Process(target=_rank_main, args=(r, world, port, job, results)) for r in range(world)
    ]
    for p in procs:
        p.start()
    result: dict[str, Any] = results.get(timeout=900)
    for p in procs:
        p.join(60)
    label = _label(tp, pp) + (f", {micro} micro-batches" if micro > 1 else "")
    return {"tp": tp, "pp": pp, "label": label, "threads_per_rank": threads, **result}


def _label(tp: int, pp: int) -> str:
    return f"TP={tp}" + (f" x PP={pp}" if pp > 1 else "")


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for label, key in (("step ms", "step_ms"), ("in collectives, ms", "comm_ms_per_step")):
        for run in result["configs"]:
            xs = [r["batch"] for r in run["runs"]]
            axes[0].plot(xs, [r[key] for r in run["runs"]], "o-", label=f"{run['label']} {label}")
    axes[0].set(xlabel="decode batch", ylabel="ms per step", title="decode step (rank 0)")
    axes[0].legend(fontsize=7)
    for run in result["configs"]:
        xs = [r["batch"] for r in run["runs"]]
        axes[1].plot(
            xs, [r["bytes_per_token"] / 1024 for r in run["runs"]], "o-", label=run["label"]
        )
    axes[1].set(
        xlabel="decode batch", ylabel="KiB per generated token", title="bytes moved (rank 0)"
    )
    axes[1].legend(fontsize=7)
    axes[2].bar(
        [r["label"] for r in result["configs"]], [r["startup_s"] for r in result["configs"]]
    )
    axes[2].set(ylabel="seconds", title="start-up (join, load, shard, KV)")
    fig.suptitle(result["note"], fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=2, help="the split size compared with 1")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages of the split side")
    parser.add_argument("--micro-batches", type=int, default=1, help="--pipeline-micro-batches")
    parser.add_argument("--tokens", type=int, default=32, help="decode steps timed per batch")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each rank")
    parser.add_argument("--model", default=None, help="default: a random 8-layer model")
    parser.add_argument("--out", type=Path, default=Path("bench/results/tensor_parallel.json"))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or write_model(Path(tmp) / "model")
        # Same cores both ways: one process with ranks × threads threads, each rank threads.
        ranks = args.tp * args.pp
        configs = [
            measure(model, 1, ranks * args.threads, args.batch, args.tokens),
            measure(
                model, args.tp, args.threads, args.batch, args.tokens, args.pp, args.micro_batches
            ),
        ]
    one, split = configs[0]["runs"], configs[1]["runs"]
    fields = {
        "model": args.model or {"random_llama": SHAPE},
        "configs": configs,
        "split_over_one_step_time": [
            s["step_ms"] / o["step_ms"] for s, o in zip(split, one, strict=True)
        ],
        "cores": os.cpu_count(),
        "note": f"gloo over loopback, {os.cpu_count()} cores; {_label(args.tp, args.pp)}: "
        f"{args.threads} torch thread(s) a rank, TP=1: {ranks * args.threads}; a shared "
        "machine: one run's ratios",
    }
    result = save_result(args.out, "tensor_parallel", fields, plot)
    print(json.dumps({k: result[k] for k in ("split_over_one_step_time",)}))


if __name__ == "__main__":
    main()
