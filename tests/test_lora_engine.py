"""LoRA adapters in our engine against transformers + PEFT with the same adapters: the same
greedy tokens for each adapter alone and for a batch that mixes eight adapters and the base
model in every step; the prefix cache never shares KV across adapters.

The adapters are real PEFT files made here (`servefleet.bench.make_adapters`: random A and B
of several ranks and target sets; no hub), read by the engine's loader as the engine reads
them (`lora.setup.adapter_dtype`: bfloat16 weights under the C LoRA kernel), and every step
is checked to have run where the engine runs it: decode steps in the one-call C program with
the adapters inside, prompt steps through the C LoRA kernel; the mixed batch also with the
kernels built for AVX2 (`SERVEFLEET_MATMUL_ISA=avx2`'s build).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from servefleet.api.speculative import SpeculativeConfig
from servefleet.bench.make_adapters import applied, chat_ids, greedy, load_base, random_adapter
from servefleet.bench.one_batch import run_in_one_batch
from servefleet.engine.kernels.cpu_lora import CpuLoraKernel
from servefleet.engine.kernels.cpu_small_gemm import load_cpu_small_gemm
from servefleet.engine.kernels.matmul import SmallRowsMatmul
from servefleet.engine.kv_cache import KVCacheManager
from servefleet.engine.lora.adapter import LoraAdapter, load_adapter
from servefleet.engine.lora.batch import LoraBatch
from servefleet.engine.lora.setup import adapter_dtype
from servefleet.engine.model.kv_layout import allocate_kv_cache
from servefleet.engine.model.loader import LoadedModel
from servefleet.engine.runner import ModelRunner
from servefleet.engine.sampling_params import SamplingParams
from servefleet.engine.scheduler import Scheduler, SchedulerConfig
from servefleet.engine.sequence import Sequence
from servefleet.engine.spec.speculator import Speculator

NEW_TOKENS = 12
BLOCK = 16
# (seed, rank, target modules): ranks 4-16, attention only, MLP only, and everything.
ADAPTERS = [
    (1, 8, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
    (2, 4, ("q_proj", "v_proj")),
    (3, 16, ("gate_proj", "up_proj", "down_proj")),
    (4, 8, ("k_proj", "o_proj", "down_proj")),
    (5, 8, ("q_proj", "k_proj", "v_proj", "o_proj")),
    (6, 4, ("up_proj",)),
    (7, 16, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
    (8, 8, ("v_proj", "gate_proj")),
]
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "List three prime numbers.",
    "Explain photosynthesis to a five year old.",
]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def hf() -> tuple[object, object]:
    return load_base()  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory: pytest.TempPathFactory, hf: tuple[object, object]) -> list[Path]:
    root = tmp_path_factory.mktemp("adapters")
    return [
        random_adapter(root / f"a{seed}", seed=seed, rank=rank, target_modules=targets, base=hf[0])
        for seed, rank, targets in ADAPTERS
    ]


@pytest.fixture(scope="module")
def prompts(hf: tuple[object, object]) -> list[list[int]]:
    return [chat_ids(hf[1], p) for p in PROMPTS]


class References:
    """transformers + PEFT greedy tokens by (adapter index or None, prompt index), computed
    on first use: each costs a generation on the CPU."""

    def __init__(self, hf: tuple[object, object], dirs: list[Path], prompts: list[list[int]]):
        self.model, self.tokenizer = hf
        self.dirs, self.prompts = dirs, prompts
        self.known: dict[tuple[int | None, int], list[int]] = {}

    def __getitem__(self, key: tuple[int | None, int]) -> list[int]:
        if key not in self.known:
            index, p = key
            if index is None:
                self.known[key] = greedy(self.model, self.tokenizer, self.prompts[p], NEW_TOKENS)
            else:
                with applied(self.model, self.dirs[index]) as peft_model:
                    tokens = greedy(peft_model, self.tokenizer, self.prompts[p], NEW_TOKENS)
                self.known[key] = tokens
        return self.known[key]


@pytest.fixture(scope="module")
def references(
    hf: tuple[object, object], adapter_dirs: list[Path], prompts: list[list[int]]
) -> References:
    return References(hf, adapter_dirs, prompts)


@pytest.fixture(scope="module")
def ours(smollm2: LoadedModel, adapter_dirs: list[Path]) -> tuple[LoadedModel, list[LoraAdapter]]:
    """The engine's model as `servefleet engine` loads it here (C matmuls on packed weights,
    fused ops, the decode kernel, the C LoRA kernel) and the adapters read by the engine's
    loader, in the engine's dtype for them."""
    assert isinstance(smollm2.model.lora_kernel, CpuLoraKernel)
    dtype = adapter_dtype(smollm2.model)
    adapters = [
        load_adapter(f"a{i}", d, smollm2.config, max_rank=16, dtype=dtype)
        for i, d in enumerate(adapter_dirs)
    ]
    return smollm2, adapters


@pytest.fixture(params=["native", "avx2"])
def isa(
    request: pytest.FixtureRequest, ours: tuple[LoadedModel, list[LoraAdapter]]
) -> Iterator[str]:
    """The model's C matmuls and LoRA kernel as built for this instruction-set cap."""
    model = ours[0].model
    matmul, kernel = model.matmul, model.lora_kernel
    assert isinstance(matmul, SmallRowsMatmul)
    if request.param != "native":
        gemm = load_cpu_small_gemm(matmul.kernel.threading, request.param)
        assert gemm is not None
        model.set_matmul(replace(matmul, kernel=gemm))
        model.set_lora_kernel(CpuLoraKernel(gemm))
    try:
        yield request.param
    finally:
        model.set_matmul(matmul)
        model.set_lora_kernel(kernel)


def paths(steps: list[LoraBatch | None]) -> set[frozenset[str]]:
    """Where each step with adapters added their products."""
    return {frozenset(step.ran) for step in steps if step is not None}


def run_batch(
    loaded: LoadedModel,
    jobs: list[tuple[LoraAdapter | None, list[int]]],
    speculator: Speculator | None = None,
) -> tuple[list[Sequence], list[LoraBatch | None]]:
    """Every job in one engine batch (schedule -> execute -> update to the end); returns the
    sequences and each step's adapter grouping."""
    return run_in_one_batch(loaded, jobs, NEW_TOKENS, speculator=speculator)


def until_eos(tokens: list[int], reference: list[int]) -> list[int]:
    """Ours runs past EOS (ignore_eos); transformers stops there."""
    return tokens[: len(reference)]


def test_each_adapter_alone_matches_peft(
    ours: tuple[LoadedModel, list[LoraAdapter]],
    references: References,
    prompts: list[list[int]],
) -> None:
    loaded, adapters = ours
    changed = 0
    for index in (0, 1, 2):
        for p in (0, 1):
            (seq,), steps = run_batch(loaded, [(adapters[index], prompts[p])])
            want = references[(index, p)]
            assert until_eos(seq.output_token_ids, want) == want, (index, p)
            changed += want != references[(None, p)]
            assert paths(steps) == {frozenset({"cpu-c"}), frozenset({"program"})}
    assert changed >= 4, "the adapters barely change the output: the test would not notice"


def test_a_batch_of_eight_adapters_and_the_base_matches_peft(
    ours: tuple[LoadedModel, list[LoraAdapter]],
    references: References,
    prompts: list[list[int]],
    isa: str,
) -> None:
    """16 sequences: two per adapter except where the base model takes the slot, so every
    step holds eight adapters' rows beside base rows."""
    loaded, adapters = ours
    keys: list[tuple[int | None, int]] = []
    for row in range(16):
        index = None if row % 5 == 4 else row % 8
        keys.append((index, row % len(prompts)))
    jobs = [(adapters[i] if i is not None else None, prompts[p]) for i, p in keys]
    seqs, steps = run_batch(loaded, jobs)
    for key, seq in zip(keys, seqs, strict=True):
        assert until_eos(seq.output_token_ids, references[key]) == references[key], key
    mixed = [s for s in steps if s is not None and len(s.groups) >= 7]
    assert len(mixed) > NEW_TOKENS // 2, "few steps ran seven or more adapters at once"
    # the first step's prompts: one adapter's two prompts are apart (gathered rows); in
    # decode steps the runner puts each adapter's rows together (one slice each)
    assert any(not isinstance(g.rows, slice) for g in mixed[0].groups)
    assert all(isinstance(g.rows, slice) for g in mixed[-1].groups)
    # the prompts through the C LoRA kernel, every decode step in the one-call program
    assert mixed[0].ran == {"cpu-c"} and all(s.ran == {"program"} for s in mixed[1:])


def test_the_prefix_cache_never_shares_kv_across_adapters(
    ours: tuple[LoadedModel, list[LoraAdapter]], prompts: list[list[int]]
) -> None:
    loaded, adapters = ours
    prompt = prompts[3]
    assert len(prompt) > 2 * BLOCK
    blocks = 64
    kv = allocate_kv_cache(loaded.config, blocks, BLOCK, torch.float32, "cpu")
    scheduler = Scheduler(SchedulerConfig(64, 4096, 2048), KVCacheManager(blocks, BLOCK), [], None)
    runner = ModelRunner(loaded.model, kv, BLOCK, torch.device("cpu"))
    cached = []
    for adapter in (adapters[0], None, adapters[1], adapters[0], None):
        seq = Sequence(
            list(prompt), SamplingParams(max_tokens=2, temperature=0.0), 0.0, lora=adapter
        )
        scheduler.add(seq)
        while scheduler.num_unfinished:
            out = scheduler.schedule()
            scheduler.update(out, runner.execute(out).token_by_seq_id())
        cached.append(seq.num_cached_tokens)
    assert cached[:3] == [0, 0, 0]
    assert cached[3] > 0 and cached[4] > 0  # the same adapter (or the base) again: a hit


def test_speculative_proposals_are_verified_under_the_adapter(
    ours: tuple[LoadedModel, list[LoraAdapter]], hf: tuple[object, object]
) -> None:
    """n-gram proposals come from the text, and are accepted only where the adapted model
    agrees: the output is the adapter's greedy output, proposals or not."""
    loaded, adapters = ours
    text = "Repeat this exactly: red green blue red green blue red green blue red green blue"
    prompt = chat_ids(hf[1], text)
    config = SpeculativeConfig.model_validate(
        {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": None,
         "min_acceptance_rate": 0.0}
    )  # fmt: skip
    speculator = Speculator(config, 64)
    jobs: list[tuple[LoraAdapter | None, list[int]]] = [(adapters[0], prompt), (None, prompt)]
    (with_spec, base_spec), steps = run_batch(loaded, jobs, speculator)
    (plain, base_plain), _ = run_batch(loaded, jobs)
    # proposal rows (spans of several decode rows) verified in the one-call program
    assert any(
        s is not None and s.ran == {"program"} and any(rows > 1 for _, _, rows in s.spans)
        for s in steps
    )
    assert with_spec.output_token_ids == plain.output_token_ids
    assert base_spec.output_token_ids == base_plain.output_token_ids
    stats = speculator.take_stats()
    assert stats.num_draft_tokens > 0, "nothing was proposed: the test checks nothing"
