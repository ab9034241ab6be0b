"""Hugging Face `transformers` static-batch generation: the baseline our engine must beat.

Runs as its own process (`python -m servefleet.bench.hf_baseline ...`), one per dtype,
because a bf16 matmul can kill the process with SIGILL on some CPUs, and a crash there must
only cost that dtype's figure. `ONEDNN_MAX_CPU_ISA` must be set before torch is imported,
which is another reason for a fresh process.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field


class HFJob(BaseModel):
    model_path: str = Field(description="a GGUF file")
    dtype: str
    prompts: list[list[int]]
    batch_size: int = Field(ge=1)
    output_tokens: int = Field(ge=1)
    pad_token_id: int = 0


class HFResult(BaseModel):
    dtype: str
    num_prompts: int
    batch_size: int
    output_tokens_per_prompt: int
    total_output_tokens: int
    duration_s: float
    output_token_throughput_tps: float
    batch_durations_s: list[float]
    load_s: float


def run_job(job: HFJob) -> HFResult:
    import torch
    from transformers import AutoModelForCausalLM

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[job.dtype]
    path = Path(job.model_path)
    t0 = time.perf_counter()
    # Any: transformers' generate() typing does not survive the Auto* factory.
    model: Any = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=dtype
    )
    model.eval()
    load_s = time.perf_counter() - t0

    def batch_tensors(batch: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Left padding, so every row's last prompt token sits in the same column."""
        width = max(len(p) for p in batch)
        ids = torch.full((len(batch), width), job.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, prompt in enumerate(batch):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        return ids, mask

    def generate(batch: list[list[int]], new_tokens: int) -> int:
        ids, mask = batch_tensors(batch)
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=job.pad_token_id,
        )
        generated = out.shape[1] - ids.shape[1]
        if generated != new_tokens:
            raise RuntimeError(f"generate made {generated} tokens, expected {new_tokens}")
        return int(generated * len(batch))

    batches = [
        job.prompts[i : i + job.batch_size] for i in range(0, len(job.prompts), job.batch_size)
    ]
    with torch.inference_mode():
        generate(batches[0], 2)  # warm-up: first-call allocations and kernel selection
        durations = []
        total = 0
        for batch in batches:
            start = time.perf_counter()
            total += generate(batch, job.output_tokens)
            durations.append(time.perf_counter() - start)
    duration = sum(durations)
    return HFResult(
        dtype=job.dtype,
        num_prompts=len(job.prompts),
        batch_size=job.batch_size,
        output_tokens_per_prompt=job.output_tokens,
        total_output_tokens=total,
        duration_s=duration,
        output_token_throughput_tps=total / duration,
        batch_durations_s=durations,
        load_s=load_s,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one HF static-batch run (internal)")
    parser.add_argument("job", type=Path, help="HFJob JSON")
    parser.add_argument("result", type=Path, help="where the HFResult JSON goes")
    args = parser.parse_args(argv)
    job = HFJob.model_validate_json(args.job.read_text())
    args.result.write_text(run_job(job).model_dump_json(indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
