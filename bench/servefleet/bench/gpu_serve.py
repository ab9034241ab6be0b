"""`servefleet engine` on a CUDA GPU over HTTP: the process a GPU pod runs.

Started as the chart starts it (dtype auto: bfloat16 on CUDA; LoRA on), it must answer a
chat with the real SmolLM2 (what it says is for `gpu_check`'s greedy section to judge),
load PEFT adapters through `/v1/load_lora_adapter` and answer with one, and then serve
`servefleet bench`'s random 200/128 workload at each concurrency (c=1, 16 and 64 by
default: output tokens/s, TTFT and ITL), and c=16 spread over eight adapters against the
base model alone. Used by `gpu_check`'s `serve` section.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx

from servefleet.bench.benchmark import BenchOptions, run_benchmark
from servefleet.bench.engine_process import EngineProcess

QUESTION = "What is the capital of France?"


def _chat(url: str, model: str, prompt: str) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 24, "temperature": 0}  # fmt: skip
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    reply.raise_for_status()
    return str(reply.json()["choices"][0]["message"]["content"])


def _load(url: str, name: str, path: Path) -> int:
    body = {"lora_name": name, "lora_path": str(path)}
    return httpx.post(f"{url}/v1/load_lora_adapter", json=body, timeout=120).status_code


def _options(url: str, model: str, concurrency: int, seed: int = 0) -> BenchOptions:
    return BenchOptions(url=url, model=model, concurrency=concurrency, seed=seed,
                        num_prompts=max(8, 2 * concurrency), input_tokens=200,
                        output_tokens=128, warmup=min(concurrency, 8))  # fmt: skip


def _bench(url: str, model: str, concurrency: int) -> dict[str, Any]:
    summary = asyncio.run(run_benchmark(_options(url, model, concurrency)))
    found = summary.summary.model_dump(mode="json")
    keep = ("completed", "failed", "errors", "output_token_throughput_tps", "ttft_ms", "itl_ms",
            "duration_s")  # fmt: skip
    return {"model": model, "concurrency": concurrency,
            **{k: found[k] for k in keep if k in found}}  # fmt: skip


def _bench_mix(url: str, models: list[str], concurrency: int) -> dict[str, Any]:
    """`concurrency` clients split evenly over `models` at once (one adapter each, or the
    base model under as many names): the summed output tokens/s."""

    async def together() -> list[Any]:
        each = concurrency // len(models)
        runs = [run_benchmark(_options(url, m, each, seed=i)) for i, m in enumerate(models)]
        return list(await asyncio.gather(*runs))

    summaries = [run.summary for run in asyncio.run(together())]
    return {"models": models, "concurrency": concurrency,
            "failed": sum(s.failed for s in summaries),
            "output_token_throughput_tps": sum(s.output_token_throughput_tps
                                               for s in summaries)}  # fmt: skip


def serve_check(gguf: Path, out: Path, device: str, concurrency: list[int]) -> dict[str, Any]:
    """Chat, adapter load and chat, then the load sweep; the adapters come from `gpu_check`'s
    `lora` section (`out/adapters`) when it ran."""
    adapters = sorted(p for p in (out / "adapters").glob("a*") if p.is_dir())
    args = ["--device", device, "--enable-lora", "--max-loras", "8", "--max-lora-rank", "16"]
    found: dict[str, Any] = {"runs": []}
    with EngineProcess(str(gguf), out / "engine.log", args, ready_timeout_s=300) as engine:
        url = engine.base_url
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        found["answer"] = _chat(url, model, QUESTION)
        found["adapter_loads"] = [_load(url, p.name, p) for p in adapters]
        if adapters:
            found["adapter_answer"] = _chat(url, adapters[0].name, QUESTION)
        for clients in concurrency:
            found["runs"].append(_bench(url, model, clients))
            print(found["runs"][-1], flush=True)
        if len(adapters) >= 8:  # c=16: eight adapters, two clients each, vs the base model
            names = [p.name for p in adapters[:8]]
            found["mix"] = [_bench_mix(url, [model] * 8, 16), _bench_mix(url, names, 16)]
            print(found["mix"], flush=True)
    found["ok"] = (
        bool(found["answer"].strip())  # its words: `gpu_check`'s greedy section judges them
        and all(code == 200 for code in found["adapter_loads"])
        and all(r.get("failed", 1) == 0 for r in found["runs"] + found.get("mix", []))
    )
    return found
