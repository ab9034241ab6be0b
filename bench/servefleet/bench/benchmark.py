"""One benchmark run: build the prompts, warm up, measure, summarise, and write the outputs."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from servefleet.bench.client import (
    BenchClient,
    ClientConfig,
    Endpoint,
    RequestResult,
    make_http_client,
)
from servefleet.bench.report import BenchSummary, summarize
from servefleet.bench.workloads import (
    Prompt,
    PromptFormat,
    WorkloadKind,
    WorkloadSpec,
    build_prompts,
    load_token_counter,
)


class BenchOptions(BaseModel):
    model_config = ConfigDict(frozen=True)

    url: str
    model: str
    workload: WorkloadKind = WorkloadKind.RANDOM
    concurrency: int = Field(default=8, ge=1)
    num_prompts: int = Field(default=64, ge=1)
    input_tokens: int = Field(default=200, ge=1)
    output_tokens: int = Field(default=128, ge=1)
    seed: int = 0
    api_key: str | None = None
    warmup: int = Field(default=2, ge=0)
    endpoint: Endpoint = Endpoint.COMPLETIONS
    shared_prefix_tokens: int = Field(default=1000, ge=1)
    num_prefixes: int = Field(default=1, ge=1)
    request_timeout_s: float = Field(default=300.0, gt=0)
    total_timeout_s: float = Field(default=3600.0, gt=0)
    tokenizer_model: str | None = None

    def client_config(self) -> ClientConfig:
        return ClientConfig(
            url=self.url,
            model=self.model,
            endpoint=self.endpoint,
            concurrency=self.concurrency,
            output_tokens=self.output_tokens,
            api_key=self.api_key,
            request_timeout_s=self.request_timeout_s,
            total_timeout_s=self.total_timeout_s,
        )

    def parameters(self) -> dict[str, Any]:
        """The options as reported in the summary; the API key is never echoed."""
        params = self.model_dump(mode="json", exclude={"api_key"})
        params["api_key_set"] = self.api_key is not None
        return params


@dataclass
class BenchRun:
    summary: BenchSummary
    results: list[RequestResult]


class BenchProgress:
    """What a progress display is told: the phase starting (with its request count), and
    each request as it finishes."""

    def phase(self, name: str, total: int) -> None:
        pass

    def finished(self, result: RequestResult) -> None:
        pass


def make_prompts(options: BenchOptions) -> tuple[list[Prompt], list[Prompt]]:
    """(measured, warm-up) prompts.

    Both come from one seeded stream of `num_prompts + warmup` prompts, measured first, so
    the measured prompts do not depend on `--warmup` while warm-up prompts share the
    shared-prefix workload's prefixes (the server reaches its steady state before measuring).
    """
    spec = WorkloadSpec(
        kind=options.workload,
        num_prompts=options.num_prompts + options.warmup,
        input_tokens=options.input_tokens,
        seed=options.seed,
        shared_prefix_tokens=options.shared_prefix_tokens,
        num_prefixes=options.num_prefixes,
    )
    if options.endpoint is Endpoint.CHAT:
        counter = load_token_counter(options.tokenizer_model) if options.tokenizer_model else None
        prompts = build_prompts(spec, PromptFormat.TEXT, counter)
    else:
        prompts = build_prompts(spec, PromptFormat.TOKEN_IDS)
    return prompts[: options.num_prompts], prompts[options.num_prompts :]


async def run_prompts(
    config: ClientConfig,
    prompts: list[Prompt],
    warmup_prompts: list[Prompt],
    parameters: dict[str, Any],
    progress: BenchProgress | None = None,
) -> BenchRun:
    """Warm up (results dropped), then measure `prompts` from first send to last byte."""
    progress = progress or BenchProgress()
    async with make_http_client(config) as http:
        client = BenchClient(config, http)
        if warmup_prompts:
            progress.phase("warm-up", len(warmup_prompts))
            await client.run(warmup_prompts, progress.finished)
        progress.phase("measure", len(prompts))
        start = time.perf_counter()
        results = await client.run(prompts, progress.finished)
        duration = time.perf_counter() - start
    params = {**parameters, "stream_usage": client.include_usage}
    return BenchRun(summary=summarize(results, duration, params), results=results)


async def run_benchmark(options: BenchOptions, progress: BenchProgress | None = None) -> BenchRun:
    prompts, warmup_prompts = make_prompts(options)
    return await run_prompts(
        options.client_config(), prompts, warmup_prompts, options.parameters(), progress
    )


def write_outputs(run: BenchRun, json_path: Path) -> Path:
    """Write the summary JSON and its PNG (same stem); returns the PNG's path."""
    from servefleet.bench.plot import plot_run  # matplotlib only when a plot is asked for

    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(run.summary.model_dump(mode="json"), indent=2) + "\n")
    png_path = json_path.with_suffix(".png")
    plot_run(run.results, run.summary, png_path)
    return png_path
