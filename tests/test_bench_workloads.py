"""The bench workloads: seeded determinism, exact lengths, shared-prefix structure."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from servefleet.bench.benchmark import BenchOptions, make_prompts
from servefleet.bench.workloads import (
    SAFE_TOKEN_ID_HIGH,
    SAFE_TOKEN_ID_LOW,
    PromptFormat,
    WorkloadKind,
    WorkloadSpec,
    build_prompts,
    load_token_counter,
)


def test_random_prompts_have_exact_lengths_and_safe_ids() -> None:
    spec = WorkloadSpec(num_prompts=20, input_tokens=37, seed=3)
    prompts = build_prompts(spec)
    assert len(prompts) == 20
    for p in prompts:
        assert p.token_ids is not None
        assert len(p.token_ids) == 37 == p.num_tokens
        assert all(SAFE_TOKEN_ID_LOW <= t < SAFE_TOKEN_ID_HIGH for t in p.token_ids)
        assert p.prefix_index is None
    # Fresh random tokens per prompt: no two prompts alike.
    assert len({tuple(p.token_ids or []) for p in prompts}) == 20


def test_same_seed_same_prompts_other_seed_other_prompts() -> None:
    spec = WorkloadSpec(num_prompts=5, input_tokens=16, seed=11)
    assert build_prompts(spec) == build_prompts(spec)
    other = build_prompts(spec.model_copy(update={"seed": 12}))
    assert other != build_prompts(spec)


def test_shared_prefix_structure_round_robin() -> None:
    spec = WorkloadSpec(
        kind=WorkloadKind.SHARED_PREFIX,
        num_prompts=9,
        input_tokens=8,
        shared_prefix_tokens=50,
        num_prefixes=3,
        seed=1,
    )
    prompts = build_prompts(spec)
    assert [p.prefix_index for p in prompts] == [0, 1, 2] * 3
    prefixes: dict[int, tuple[int, ...]] = {}
    suffixes = set()
    for p in prompts:
        assert p.token_ids is not None and p.prefix_index is not None
        assert len(p.token_ids) == 58 == p.num_tokens
        prefix = tuple(p.token_ids[:50])
        assert prefixes.setdefault(p.prefix_index, prefix) == prefix
        suffixes.add(tuple(p.token_ids[50:]))
    assert len(set(prefixes.values())) == 3  # distinct prefixes
    assert len(suffixes) == 9  # every suffix unique


def test_text_prompts_without_tokenizer_count_words() -> None:
    spec = WorkloadSpec(
        kind=WorkloadKind.SHARED_PREFIX, num_prompts=4, input_tokens=12, shared_prefix_tokens=30
    )
    prompts = build_prompts(spec, PromptFormat.TEXT)
    assert prompts == build_prompts(spec, PromptFormat.TEXT)
    for p in prompts:
        assert p.text is not None and p.system_text is not None
        assert len(p.text.split()) == 12
        assert len(p.system_text.split()) == 30
        assert p.num_tokens == 42
        assert p.token_ids is None
    assert len({p.system_text for p in prompts}) == 1


def test_text_prompts_calibrated_with_a_token_counter() -> None:
    # A counter where every word costs as many tokens as it has letters divided by 3, plus 1.
    def count(text: str) -> int:
        return sum(len(w) // 3 + 1 for w in text.split())

    spec = WorkloadSpec(num_prompts=6, input_tokens=40, seed=5)
    for p in build_prompts(spec, PromptFormat.TEXT, count):
        assert p.text is not None
        n = count(p.text)
        assert n == p.num_tokens
        assert 40 - 3 <= n <= 40  # the longest word fit: at most one word (<= 3 tokens) short


def test_measured_prompts_do_not_depend_on_warmup() -> None:
    def options(warmup: int) -> BenchOptions:
        return BenchOptions(
            url="http://x", model="m", num_prompts=6, input_tokens=10, warmup=warmup
        )

    a, warm_a = make_prompts(options(0))
    b, warm_b = make_prompts(options(3))
    assert a == b
    assert warm_a == [] and len(warm_b) == 3
    assert not set(map(str, warm_b)) & set(map(str, b))


def test_warmup_prompts_share_the_prefixes() -> None:
    options = BenchOptions(
        url="http://x",
        model="m",
        workload=WorkloadKind.SHARED_PREFIX,
        num_prompts=4,
        warmup=2,
        input_tokens=5,
        shared_prefix_tokens=20,
    )
    measured, warm = make_prompts(options)
    prefix = (measured[0].token_ids or [])[:20]
    assert all((p.token_ids or [])[:20] == prefix for p in measured + warm)


@pytest.mark.parametrize(
    "bad",
    [{"num_prompts": 0}, {"input_tokens": 0}, {"token_id_low": 500, "token_id_high": 100}],
)
def test_bad_specs_are_rejected(bad: dict[str, int]) -> None:
    params: dict[str, Any] = {"num_prompts": 1, "input_tokens": 1, **bad}
    with pytest.raises(ValidationError):
        WorkloadSpec.model_validate(params)


def test_text_prompts_calibrated_with_the_engine_tokenizer() -> None:
    count = load_token_counter("smollm2-135m-instruct")
    spec = WorkloadSpec(num_prompts=3, input_tokens=64, seed=2)
    for p in build_prompts(spec, PromptFormat.TEXT, count):
        assert p.text is not None
        assert p.num_tokens == count(p.text)
        assert 60 <= p.num_tokens <= 64


def test_unknown_tokenizer_model_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="no such model"):
        load_token_counter(str(tmp_path / "missing.gguf"))
