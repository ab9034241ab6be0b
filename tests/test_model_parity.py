"""Our model on the SmolLM2 GGUF against transformers' own GGUF loading: same greedy tokens."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from servefleet.engine.attention import AttentionMetadata, PagedAttention, PrefillSpan
from servefleet.engine.kernels import (
    TORCH_MATMUL,
    select_decode_kernel,
    select_fused_ops,
    select_matmul,
)
from servefleet.engine.kv_plan import resolve_kv_cache_dtype
from servefleet.engine.model.conversion_cache import entry_dir
from servefleet.engine.model.kv_layout import allocate_kv_cache
from servefleet.engine.model.llama import LlamaForCausalLM
from servefleet.engine.model.loader import LoadedModel, load_model, read_checkpoint
from servefleet.text.builtin import resolve_builtin

NEW_TOKENS = 32
# Plain PyTorch on packed weights unpacks every weight at every step: its tokens are
# compared over a shorter stretch (the engine paths take the full NEW_TOKENS).
REFERENCE_PATH_TOKENS = 8
BLOCK_SIZE = 16


def greedy_generate(
    model: LlamaForCausalLM,
    prompt: list[int],
    max_new: int,
    eos: set[int],
    kv_dtype: torch.dtype = torch.float32,
) -> list[int]:
    """One sequence through the paged path: a single prefill span, then decode steps.

    Blocks are handed out in a shuffled order so that the block table really is used.
    """
    total = len(prompt) + max_new
    num_blocks = math.ceil(total / BLOCK_SIZE) + 1
    kv_caches = allocate_kv_cache(model.config, num_blocks, BLOCK_SIZE, kv_dtype, "cpu")
    block_table = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0))

    def slots(positions: torch.Tensor) -> torch.Tensor:
        return block_table[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE

    positions = torch.arange(len(prompt))
    span = PrefillSpan(
        start=0,
        end=len(prompt),
        num_cached=0,
        block_table=block_table[: math.ceil(len(prompt) / BLOCK_SIZE)],
    )
    meta = AttentionMetadata(slot_mapping=slots(positions), block_size=BLOCK_SIZE, prefills=[span])
    with torch.inference_mode():
        hidden = model(torch.tensor(prompt), positions, kv_caches, meta)
        logits = model.compute_logits(hidden[-1:])
        out: list[int] = []
        while True:
            token = int(logits.argmax(-1))
            out.append(token)
            if token in eos or len(out) == max_new:
                return out
            position = torch.tensor([len(prompt) + len(out) - 1])
            context = int(position) + 1
            meta = AttentionMetadata(
                slot_mapping=slots(position),
                block_size=BLOCK_SIZE,
                num_decodes=1,
                decode_block_tables=block_table[None, : math.ceil(context / BLOCK_SIZE)].int(),
                decode_context_lens=torch.tensor([context], dtype=torch.int32),
            )
            hidden = model(torch.tensor([out[-1]]), position, kv_caches, meta)
            logits = model.compute_logits(hidden)


PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about autumn leaves."}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "List three prime numbers."},
    ],
    [{"role": "user", "content": "Translate 'good morning' into Spanish and German."}],
    [{"role": "user", "content": "def fibonacci(n):\n    # complete this Python function"}],
    [{"role": "user", "content": "Explain photosynthesis to a five year old."}],
]
RAW_PROMPTS = ["Once upon a time, in a small village", "The three laws of thermodynamics are"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def ours(cache_root: Path) -> LoadedModel:
    return load_model("smollm2-135m-instruct", torch.float32, "cpu", cache_root=cache_root)


@pytest.fixture(scope="module")
def reference() -> tuple[object, object]:
    os.environ["HF_HUB_OFFLINE"] = "1"
    transformers = pytest.importorskip("transformers")
    path: Path = resolve_builtin("smollm2-135m-instruct")
    kwargs = {"gguf_file": path.name}
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), **kwargs)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), dtype=torch.float32, **kwargs
    )
    return model.eval(), tokenizer


def _prompts(tokenizer: object) -> list[list[int]]:
    texts = [
        tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False)  # type: ignore[attr-defined]
        for m in PROMPTS
    ]
    return [list(tokenizer.encode(t, add_special_tokens=False)) for t in texts + RAW_PROMPTS]  # type: ignore[attr-defined]


@pytest.fixture(params=["reference-path", "engine-defaults", "engine-float16-kv"])
def configured(
    request: pytest.FixtureRequest, ours: LoadedModel
) -> Iterator[tuple[torch.dtype, int]]:
    """The model as plain PyTorch with a float32 cache, or as `servefleet engine` runs it
    on this machine by default (C matmuls on packed 4/8-bit weights, fused ops, decode
    kernel, the default KV-cache dtype), or so with `--kv-cache-dtype float16`; yields
    the KV-cache dtype and how many tokens to compare."""
    if request.param == "reference-path":
        yield torch.float32, REFERENCE_PATH_TOKENS
        return
    model = ours.model
    assert model.packed_summary()["tensors"] == 4 * model.config.num_layers + 1
    model.set_matmul(select_matmul("cpu"))
    model.set_fused_ops(select_fused_ops("cpu"))
    model.set_attention(PagedAttention(select_decode_kernel("cpu")[1]))
    try:
        kv = "float16" if request.param == "engine-float16-kv" else "auto"
        yield resolve_kv_cache_dtype(kv, torch.float32), NEW_TOKENS
    finally:
        model.set_matmul(TORCH_MATMUL)
        model.set_fused_ops(None)
        model.set_attention(PagedAttention())


_HF_TOKENS: dict[tuple[int, ...], list[int]] = {}  # prompt -> transformers' NEW_TOKENS


def _transformers_greedy(hf_model: object, prompt: list[int], eos: set[int]) -> list[int]:
    """transformers' greedy continuation of `prompt`, generated once for every case."""
    key = tuple(prompt)
    if key not in _HF_TOKENS:
        with torch.inference_mode():
            generated = hf_model.generate(  # type: ignore[attr-defined]
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=sorted(eos),
                pad_token_id=sorted(eos)[0],
            )
        _HF_TOKENS[key] = generated[0, len(prompt) :].tolist()
    return _HF_TOKENS[key]


def test_greedy_tokens_match_transformers(
    ours: LoadedModel, reference: tuple[object, object], configured: tuple[torch.dtype, int]
) -> None:
    hf_model, hf_tokenizer = reference
    kv_dtype, tokens = configured
    eos = set(ours.tokenizer.eos_token_ids)
    prompts = _prompts(hf_tokenizer)
    assert len(prompts) >= 8
    for prompt in prompts:
        mine = greedy_generate(ours.model, prompt, tokens, eos, kv_dtype)
        theirs = _transformers_greedy(hf_model, prompt, eos)[:tokens]
        assert mine == theirs, hf_tokenizer.decode(prompt)  # type: ignore[attr-defined]


def test_prefill_logits_match_transformers(
    ours: LoadedModel, reference: tuple[object, object]
) -> None:
    hf_model, hf_tokenizer = reference
    prompt = _prompts(hf_tokenizer)[0]
    kv = allocate_kv_cache(ours.config, 4, BLOCK_SIZE, torch.float32, "cpu")
    table = torch.tensor([2, 0, 3, 1])
    positions = torch.arange(len(prompt))
    meta = AttentionMetadata(
        slot_mapping=table[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE,
        block_size=BLOCK_SIZE,
        prefills=[PrefillSpan(0, len(prompt), 0, table[: math.ceil(len(prompt) / BLOCK_SIZE)])],
    )
    with torch.inference_mode():
        mine = ours.model.compute_logits(ours.model(torch.tensor(prompt), positions, kv, meta))
        theirs = hf_model(torch.tensor([prompt])).logits[0].float()  # type: ignore[operator]
    torch.testing.assert_close(mine, theirs, atol=2e-3, rtol=1e-3)


def test_paged_attention_impl_is_used_by_every_layer(ours: LoadedModel) -> None:
    calls: list[int] = []

    class CountingAttention(PagedAttention):
        def __call__(
            self,
            q: torch.Tensor,
            k: torch.Tensor,
            v: torch.Tensor,
            k_cache: torch.Tensor,
            v_cache: torch.Tensor,
            meta: AttentionMetadata,
            scale: float,
        ) -> torch.Tensor:
            calls.append(q.shape[0])
            return super().__call__(q, k, v, k_cache, v_cache, meta, scale)

    ours.model.set_attention(CountingAttention())
    try:
        greedy_generate(ours.model, [1, 4093, 198, 6004], 2, set())
    finally:
        ours.model.set_attention(PagedAttention())
    assert calls == [4] * ours.config.num_layers + [1] * ours.config.num_layers


def test_warm_start_reads_the_converted_cache(ours: LoadedModel, cache_root: Path) -> None:
    """The fixture converted the GGUF into its cache; a second load must come from there."""
    entries = list((cache_root / "converted").iterdir())
    assert len(entries) == 1 and (entries[0] / "meta.json").is_file()
    again = read_checkpoint("smollm2-135m-instruct", cache_root=cache_root)
    assert again.config == ours.config and again.name == "smollm2-135m-instruct"
    assert again.chat_template is not None and "<|im_start|>" in again.chat_template
    state = ours.model.state_dict()
    assert set(again.weights) == set(state)
    for name, tensor in again.weights.items():
        assert torch.equal(tensor, state[name]), name
    # The packed forms come back from the cache as they were written, and their float32
    # forms were never written (the model holds only the packed ones).
    fresh = read_checkpoint("smollm2-135m-instruct", use_cache=False)
    assert set(again.packed) == set(fresh.packed) and len(fresh.packed) == 121
    assert not set(again.weights) & set(again.packed)
    for name, packed in fresh.packed.items():
        cached = again.packed[name]
        assert (cached.k, cached.n) == (packed.k, packed.n), name
        for part in ("data", "formats", "offsets"):
            assert torch.equal(getattr(cached, part), getattr(packed, part)), (name, part)
    assert entry_dir(cache_root, resolve_builtin("smollm2-135m-instruct")) == entries[0]
