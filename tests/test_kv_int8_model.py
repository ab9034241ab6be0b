"""int8 KV cache on SmolLM2: perplexity gate, greedy agreement with float32 KV, capacity
in /metrics, no leaked blocks, and the Triton kernel refused at start-up."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
import torch

from servefleet.api.kv_cache import KV_CACHE_BYTES_PER_TOKEN_METRIC
from servefleet.engine.attention import AttentionMetadata, PrefillSpan
from servefleet.engine.config import EngineConfig, EngineSettingsError
from servefleet.engine.kernels.triton_paged_decode import triton_paged_decode
from servefleet.engine.model.kv_layout import allocate_kv_cache
from servefleet.engine.model.loader import LoadedModel
from servefleet.engine.process import build_engine
from servefleet.engine.sampling_params import SamplingParams
from tests.support.engine_harness import generate_all, running_engine, wait_idle

TEXT = Path(__file__).parent / "data" / "heldout_prose.txt"
CHUNK = 128  # prefill chunk: later chunks attend over the quantized cache of earlier ones
BLOCK = 16
PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "List three uses of a paperclip:",
    "Explain what a hash table is in one paragraph.",
]
GEN_TOKENS = 32

pytestmark = pytest.mark.usefixtures("require_compiler")


def text_perplexity(loaded: LoadedModel, ids: list[int], dtype: torch.dtype) -> float:
    """Perplexity of one long sequence prefilled in chunks through a paged cache of `dtype`."""
    model = loaded.model
    num_blocks = math.ceil(len(ids) / BLOCK)
    kv = allocate_kv_cache(model.config, num_blocks, BLOCK, dtype, "cpu")
    table = torch.arange(num_blocks).flip(0)  # scattered: block order is not memory order
    nll = 0.0
    with torch.inference_mode():
        for start in range(0, len(ids) - 1, CHUNK):
            end = min(start + CHUNK, len(ids) - 1)
            positions = torch.arange(start, end)
            slots = table[positions // BLOCK] * BLOCK + positions % BLOCK
            span = PrefillSpan(0, end - start, start, table[: math.ceil(end / BLOCK)])
            meta = AttentionMetadata(slots, BLOCK, prefills=[span])
            hidden = model(torch.tensor(ids[start:end]), positions, kv, meta)
            logits = model.compute_logits(hidden).float()
            targets = torch.tensor(ids[start + 1 : end + 1])
            nll += float(torch.nn.functional.cross_entropy(logits, targets, reduction="sum"))
    return math.exp(nll / (len(ids) - 1))


def test_int8_kv_perplexity_within_one_percent(smollm2: LoadedModel) -> None:
    ids = smollm2.tokenizer.encode(TEXT.read_text(encoding="utf-8"), add_special_tokens=False)
    assert len(ids) > 4 * CHUNK
    exact = text_perplexity(smollm2, ids, torch.float32)
    quantized = text_perplexity(smollm2, ids, torch.int8)
    print(f"held-out perplexity: float32 KV {exact:.4f}, int8 KV {quantized:.4f}")
    assert quantized <= exact * 1.01
    assert quantized != exact  # the int8 path really ran


def greedy(loaded: LoadedModel, kv_cache_dtype: str) -> list[list[int]]:
    prompts = [loaded.tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(max_tokens=GEN_TOKENS, temperature=0.0, ignore_eos=True)

    async def go() -> list[list[int]]:
        out = await generate_all(built, prompts, params)
        await wait_idle(built)
        return out

    with running_engine(loaded, kv_cache_dtype=kv_cache_dtype, kv_cache_memory="64MiB") as built:
        assert built.engine.runner.kv_caches[0][0].dtype == getattr(torch, kv_cache_dtype)
        outputs = asyncio.run(go())
        built.kv_cache.check_all_free()  # no block leaked by the int8 path
    return outputs


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def test_int8_kv_greedy_output_matches_float32_mostly(smollm2: LoadedModel) -> None:
    exact, quantized = greedy(smollm2, "float32"), greedy(smollm2, "int8")
    same = sum(
        a == b for e, q in zip(exact, quantized, strict=True) for a, b in zip(e, q, strict=True)
    )
    agreement = same / (len(PROMPTS) * GEN_TOKENS)
    prefixes = [first_difference(e, q) for e, q in zip(exact, quantized, strict=True)]
    print(f"greedy agreement int8 vs float32 KV: {agreement:.3f}, identical prefix {prefixes}")
    assert agreement >= 0.9  # measured: 1.0 (4 prompts x 32 tokens, every token the same)
    assert min(prefixes) >= 16


def test_metrics_report_dtype_and_bytes_per_token(smollm2: LoadedModel) -> None:
    with running_engine(smollm2, kv_cache_dtype="int8", kv_cache_memory="64MiB") as built:
        text = built.engine.metrics.render().decode()
        blocks = built.kv_cache.num_blocks
    per_token = 2 * 30 * 3 * (64 + 4)  # layers x kv heads x (values + float32 scale), K and V
    series = f'{KV_CACHE_BYTES_PER_TOKEN_METRIC}{{cache_dtype="int8",model_name='
    line = next(x for x in text.splitlines() if x.startswith(series))
    assert float(line.rsplit(" ", 1)[1]) == per_token
    assert blocks == (64 << 20) // (BLOCK * per_token)
    assert blocks / ((64 << 20) // (BLOCK * 2 * 30 * 3 * 64 * 4)) == pytest.approx(3.76, abs=0.01)


def test_triton_kernel_refuses_int8_at_start(
    smollm2: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(smollm2.model.attn_impl, "decode_kernel", triton_paged_decode)
    config = EngineConfig(model="smollm2-135m-instruct", device="cpu", kv_cache_dtype="int8")
    with pytest.raises(EngineSettingsError, match=r"--kv-cache-dtype int8 .* triton"):
        build_engine(config, smollm2)
