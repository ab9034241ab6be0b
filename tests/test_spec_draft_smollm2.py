"""Draft-model speculation in the real engine on SmolLM2: greedy outputs identical to a
plain run, alone and batched, with the model as its own draft (near-total acceptance)
and with a layer-truncated SmolLM2 (its first layers, built here) as the draft; the
spec-decode metrics count the draft's proposals; every block of both caches comes back."""

from __future__ import annotations

import asyncio

import pytest

from servefleet.engine.attention import PagedAttention
from servefleet.engine.config import EngineConfig
from servefleet.engine.model.llama import LlamaForCausalLM
from servefleet.engine.model.loader import LoadedModel, read_checkpoint
from servefleet.engine.process import BuiltEngine, build_engine
from servefleet.engine.sampling_params import SamplingParams
from tests.conftest import BUILTIN
from tests.support.engine_harness import generate, generate_all, wait_idle

TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived",
    "1, 2, 3, 4, 5,",
    "SELECT name FROM users WHERE",
]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
DRAFT_LAYERS = 10


def draft_json(model: str) -> str:
    return (
        f'{{"method": "draft_model", "model": "{model}", "num_speculative_tokens": 3, '
        '"disable_by_batch_size": null, "min_acceptance_rate": 0.0}'
    )


def truncated(target: LoadedModel, num_layers: int) -> LoadedModel:
    """The target's first `num_layers` layers, embeddings, final norm and head: a draft
    of the same vocabulary that disagrees now and then."""
    checkpoint = read_checkpoint(BUILTIN)
    config = checkpoint.config.model_copy(update={"num_layers": num_layers})

    def kept(name: str) -> bool:
        return not name.startswith("layers.") or int(name.split(".")[1]) < num_layers

    model = LlamaForCausalLM(
        config,
        PagedAttention(target.model.attn_impl.decode_kernel),
        max_positions=target.model.max_positions,
        device="meta",
    )
    model.load_weights(
        {k: v for k, v in checkpoint.weights.items() if kept(k)},
        device="cpu",
        packed={k: v for k, v in checkpoint.packed.items() if kept(k)},
    )
    model.set_matmul(target.model.matmul)
    model.set_fused_ops(target.model.fused_ops)
    return LoadedModel(model.eval(), config, target.tokenizer, None, f"first-{num_layers}")


def run(
    smollm2: LoadedModel, prompts: list[list[int]], batched: bool, **settings: object
) -> tuple[list[list[int]], BuiltEngine]:
    draft = settings.pop("draft", None)
    config = EngineConfig(model=BUILTIN, device="cpu", **settings)  # type: ignore[arg-type]
    built = build_engine(config, smollm2, draft)  # type: ignore[arg-type]
    built.engine.start()
    try:

        async def go() -> list[list[int]]:
            if batched:
                out = await generate_all(built, prompts, GREEDY)
            else:
                out = [await generate(built, p, GREEDY) for p in prompts]
            await wait_idle(built)
            return out

        return asyncio.run(go()), built
    finally:
        built.engine.stop()


@pytest.fixture(scope="module")
def prompts(smollm2) -> list[list[int]]:
    return [smollm2.tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]


@pytest.fixture(scope="module")
def plain(smollm2, prompts) -> list[list[int]]:
    return run(smollm2, prompts, batched=False, max_num_seqs=1)[0]


def acceptance(built: BuiltEngine) -> float:
    metrics = built.engine.metrics
    drafted = metrics.spec_draft_tokens._value.get()
    assert metrics.spec_drafts._value.get() > 0 and drafted > 0
    return float(metrics.spec_accepted_tokens._value.get() / drafted)


def check_freed(built: BuiltEngine) -> None:
    built.kv_cache.check_all_free()
    speculator = built.engine.scheduler.speculator
    assert speculator is not None and speculator.draft is not None
    speculator.draft.check_all_free()


@pytest.mark.parametrize("batched", [False, True])
def test_the_model_as_its_own_draft_is_exact_and_nearly_always_accepted(
    smollm2, prompts, plain, batched: bool
) -> None:
    out, built = run(smollm2, prompts, batched, speculative_config=draft_json(BUILTIN))
    assert out == plain
    assert acceptance(built) > 0.9
    check_freed(built)


@pytest.mark.parametrize("batched", [False, True])
def test_a_layer_truncated_draft_stays_exact(smollm2, prompts, plain, batched: bool) -> None:
    draft = truncated(smollm2, DRAFT_LAYERS)
    out, built = run(
        smollm2, prompts, batched, speculative_config=draft_json("first-layers"), draft=draft
    )
    assert out == plain
    assert 0.0 < acceptance(built) < 1.0  # right sometimes, rolled back sometimes
    check_freed(built)
