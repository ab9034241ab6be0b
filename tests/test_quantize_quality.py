"""Quality gate for quantization at load: perplexity and top-1 agreement vs float32.

The float model is SmolLM2 (the built-in GGUF) dequantized to float32; the same float
weights are then quantized at load with int8 and int4 (`--quantization`). Perplexity is
measured on held-out prose shipped with the tests (`tests/data/heldout_prose.txt`, split
into independent prompts of `PROMPT_TOKENS`), and top-1 agreement is the share of
positions, over every prompt, where the quantized model's argmax is the float model's.
Goals: int8 perplexity within +1 %, int4 within +5 %.

The file's projections are Q4_1 (a min/max 4-bit grid per 32 inputs) and its embedding
Q8_0, so int4 (same grid) and the int8 lm_head reproduce those nearly exactly; int8
projections and an int4 lm_head are what move the figures (the latter costs ~+4.8 %,
why int4 keeps the lm_head int8).
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from servefleet.engine.attention import AttentionMetadata, PagedAttention, PrefillSpan
from servefleet.engine.kernels import (
    SmallRowsMatmul,
    select_decode_kernel,
    select_fused_ops,
    select_matmul,
    select_small_mm,
)
from servefleet.engine.model.conversion_cache import Checkpoint
from servefleet.engine.model.kv_layout import allocate_kv_cache
from servefleet.engine.model.loader import LoadedModel, model_from_checkpoint, read_checkpoint
from servefleet.engine.model.weights import dense_from_packed

BUILTIN = "smollm2-135m-instruct"
TEXT = Path(__file__).parent / "data" / "heldout_prose.txt"
PROMPT_TOKENS = 48
BLOCK = 16
GOALS = {"int8": 0.01, "int4": 0.05}  # relative perplexity increase allowed
MIN_AGREEMENT = {"int8": 0.95, "int4": 0.90}
EMULATED_PROMPTS = 4

pytestmark = pytest.mark.usefixtures("require_compiler")


def float_model(float_checkpoint: Checkpoint, quantization: str | None) -> LoadedModel:
    """SmolLM2 with every weight as float32, optionally quantized at load from that float."""
    checkpoint = replace(float_checkpoint, weights=dict(float_checkpoint.weights), packed={})
    loaded = model_from_checkpoint(checkpoint, quantization=quantization)
    loaded.model.set_matmul(select_matmul("cpu"))
    loaded.model.set_fused_ops(select_fused_ops("cpu"))
    loaded.model.set_attention(PagedAttention(select_decode_kernel("cpu")[1]))
    return loaded


def prompt_logits(loaded: LoadedModel, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Logits at every position of each prompt, each prompt prefilled on its own."""
    model = loaded.model
    per_seq = math.ceil(PROMPT_TOKENS / BLOCK)
    kv = allocate_kv_cache(model.config, per_seq, BLOCK, torch.float32, "cpu")
    table = torch.arange(per_seq)
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            positions = torch.arange(len(prompt))
            slots = table[positions // BLOCK] * BLOCK + positions % BLOCK
            span = PrefillSpan(0, len(prompt), 0, table[: math.ceil(len(prompt) / BLOCK)])
            meta = AttentionMetadata(slots, BLOCK, prefills=[span])
            hidden = model(torch.tensor(prompt), positions, kv, meta)
            out.append(model.compute_logits(hidden).float())
    return out


def perplexity(logits: list[torch.Tensor], prompts: list[list[int]]) -> float:
    """exp(mean next-token negative log-likelihood) over every prompt."""
    nll, count = 0.0, 0
    for row, prompt in zip(logits, prompts, strict=True):
        targets = torch.tensor(prompt[1:])
        nll += float(torch.nn.functional.cross_entropy(row[:-1], targets, reduction="sum"))
        count += len(targets)
    return math.exp(nll / count)


def agreement(logits: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    pairs = zip(logits, reference, strict=True)
    same = sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in pairs)
    return same / sum(r.shape[0] for r in reference)


@pytest.fixture(scope="module")
def float_checkpoint() -> Checkpoint:
    """The built-in GGUF with its packed weights dequantized: the float32 model."""
    checkpoint = read_checkpoint(BUILTIN)
    checkpoint.weights.update(dense_from_packed(checkpoint.config, checkpoint.packed))
    return replace(checkpoint, packed={})


@pytest.fixture(scope="module")
def prompts(float_checkpoint: Checkpoint) -> list[list[int]]:
    ids = float_checkpoint.tokenizer.encode(
        TEXT.read_text(encoding="utf-8"), add_special_tokens=False
    )
    return [ids[i : i + PROMPT_TOKENS] for i in range(0, len(ids) - PROMPT_TOKENS, PROMPT_TOKENS)]


@pytest.fixture(scope="module")
def reference(
    float_checkpoint: Checkpoint, prompts: list[list[int]]
) -> tuple[float, list[torch.Tensor]]:
    logits = prompt_logits(float_model(float_checkpoint, None), prompts)
    return perplexity(logits, prompts), logits


def test_heldout_text_gives_many_prompts(prompts: list[list[int]]) -> None:
    assert len(prompts) >= 20
    assert all(len(p) == PROMPT_TOKENS for p in prompts)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_perplexity_and_agreement_meet_the_goals(
    mode: str,
    float_checkpoint: Checkpoint,
    prompts: list[list[int]],
    reference: tuple[float, list[torch.Tensor]],
) -> None:
    base_ppl, base_logits = reference
    loaded = float_model(float_checkpoint, mode)
    summary = loaded.model.packed_summary()
    assert summary["tensors"] == 4 * loaded.config.num_layers + 1  # every projection, lm_head
    logits = prompt_logits(loaded, prompts)
    ppl, top1 = perplexity(logits, prompts), agreement(logits, base_logits)
    print(
        f"{mode}: perplexity {ppl:.4f} vs float32 {base_ppl:.4f} "
        f"({ppl / base_ppl - 1:+.2%}), top-1 agreement {top1:.2%} over "
        f"{sum(len(p) for p in prompts)} positions, packed {summary['bytes'] / 1e6:.1f} MB"
    )
    assert ppl <= base_ppl * (1 + GOALS[mode])
    assert top1 >= MIN_AGREEMENT[mode]


def test_bfloat16_prompt_matmuls_meet_the_int8_goals(
    float_checkpoint: Checkpoint,
    prompts: list[list[int]],
    reference: tuple[float, list[torch.Tensor]],
) -> None:
    """`--matmul-dtype bfloat16` on float weights, every projection call taken as a
    prompt-sized one (max_rows=0: oneDNN): +0.12 % perplexity, 99.3 % top-1 when written."""
    kernel = select_small_mm("cpu")
    assert kernel is not None
    # Without bfloat16 hardware oneDNN emulates every product (minutes for all the prompts):
    # there the goals are checked on the first EMULATED_PROMPTS (~190 positions).
    count = len(prompts) if kernel.bf16_products else EMULATED_PROMPTS
    prompts, base_logits = prompts[:count], reference[1][:count]
    base_ppl = perplexity(base_logits, prompts)
    loaded = float_model(float_checkpoint, None)
    loaded.model.set_matmul(SmallRowsMatmul(kernel, max_rows=0, bf16_min_rows=1))
    logits = prompt_logits(loaded, prompts)
    ppl, top1 = perplexity(logits, prompts), agreement(logits, base_logits)
    print(f"bfloat16 (oneDNN): perplexity {ppl:.4f} ({ppl / base_ppl - 1:+.2%}), top-1 {top1:.2%}")
    assert logits[0].ne(base_logits[0]).any()  # the matmuls did run in bfloat16
    assert ppl <= base_ppl * (1 + GOALS["int8"])
    assert top1 >= MIN_AGREEMENT["int8"]


def test_bfloat16_packed_products_meet_the_int8_goals(prompts: list[list[int]]) -> None:
    """`--matmul-dtype bfloat16` on the GGUF's packed weights, every call (projections and
    lm_head) through the C kernel's bfloat16 products, against the same packed model in
    float32."""
    kernel = select_small_mm("cpu")
    assert kernel is not None
    if not kernel.bf16_products:
        pytest.skip("bfloat16 products need AVX512_BF16 hardware, which this CPU lacks")
    packed = read_checkpoint(BUILTIN)
    assert packed.packed
    runs = []
    for bf16_min_rows in (None, 1):
        checkpoint = replace(packed, weights=dict(packed.weights), packed=dict(packed.packed))
        loaded = model_from_checkpoint(checkpoint)
        loaded.model.set_matmul(SmallRowsMatmul(kernel, max_rows=64, bf16_min_rows=bf16_min_rows))
        loaded.model.set_fused_ops(select_fused_ops("cpu"))
        loaded.model.set_attention(PagedAttention(select_decode_kernel("cpu")[1]))
        assert loaded.model.packed_summary()["tensors"] == 4 * loaded.config.num_layers + 1
        runs.append(prompt_logits(loaded, prompts))
    base_ppl, ppl = (perplexity(logits, prompts) for logits in runs)
    top1 = agreement(runs[1], runs[0])
    print(
        f"bfloat16 (packed C): perplexity {ppl:.4f} ({ppl / base_ppl - 1:+.2%}), top-1 {top1:.2%}"
    )
    assert runs[1][0].ne(runs[0][0]).any()
    assert ppl <= base_ppl * (1 + GOALS["int8"])
    assert top1 >= MIN_AGREEMENT["int8"]
