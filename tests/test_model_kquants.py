"""A K-quant GGUF model held packed: its bytes, its exactness, its cache entry.

A synthetic Q4_K_M-style file (Q4_K q/k/gate/up, Q6_K v/down/output: fused projections
mix formats) is loaded twice: packed, and expanded to float32 (`packed_weights=False`).
The packed model must hold no float32 copy of what it holds packed, and must compute the
same hidden states bit for bit through prefill (MKL on unpacked weights) and decode
steps (the packed kernels, per layer and in one C call). Logits agree to rounding: the
float32 lm_head [vocab, hidden] is read by a dot-product kernel, which sums differently.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from servefleet.bench.quant_models import SCHEMES, TINY, write_llama_gguf
from servefleet.engine.attention import AttentionMetadata, PagedAttention, PrefillSpan
from servefleet.engine.kernels import select_decode_kernel, select_fused_ops, select_matmul
from servefleet.engine.model.gguf_loader import open_gguf, read_gguf_weights
from servefleet.engine.model.kv_layout import allocate_kv_cache
from servefleet.engine.model.llama import LlamaForCausalLM
from servefleet.engine.model.loader import LoadedModel, load_model
from servefleet.engine.model.weights import fuse_hf_weights

BLOCK = 16

pytestmark = pytest.mark.usefixtures("require_compiler")


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("kquant") / "tiny-q4_k_m.gguf"
    write_llama_gguf(path, TINY, SCHEMES["Q4_K_M"], np.random.default_rng(0))
    return path


def load(path: Path, cache: Path, packed: bool) -> LoadedModel:
    loaded = load_model(str(path), cache_root=cache, packed_weights=packed)
    loaded.model.set_matmul(select_matmul("cpu"))
    loaded.model.set_fused_ops(select_fused_ops("cpu"))
    loaded.model.set_attention(PagedAttention(select_decode_kernel("cpu")[1]))
    return loaded


def test_packed_model_holds_packed_bytes_only(gguf_path: Path, tmp_path: Path) -> None:
    model = load(gguf_path, tmp_path, packed=True).model
    summary = model.packed_summary()
    assert summary["tensors"] == 4 * TINY.layers + 1  # every projection and the lm_head
    qkv = model.layers[0].packed["qkv_weight"]
    assert qkv.format_names == {"Q4", "Q6"}  # Q4_K q/k, Q6_K v: one weight
    assert model.packed_lm_head is not None and model.packed_lm_head.format_names == {"Q6"}
    # Floats left: the (untied) embedding and the norms; nothing packed exists as float32.
    names = {n for n, _ in model.named_parameters()}
    assert names == {"embed_tokens", "norm"} | {
        f"layers.{i}.{n}" for i in range(TINY.layers) for n in ("input_norm", "post_attn_norm")
    }
    expected_float = 4 * (TINY.vocab * TINY.hidden + (2 * TINY.layers + 1) * TINY.hidden)
    assert model.weight_bytes() == {"float": expected_float, "packed": summary["bytes"]}
    # What float32 projections would take, against what the packed ones take: Q4 blocks
    # are 6 bits a weight, Q6 8 bits (float32 scales included), so at most a quarter.
    float32_bytes = 4 * sum(w.k * w.n for w in _packed(model))
    assert summary["bytes"] < 0.25 * float32_bytes


def test_packed_model_computes_the_float32_models_bits(gguf_path: Path, tmp_path: Path) -> None:
    packed = load(gguf_path, tmp_path, packed=True)
    dense = load(gguf_path, tmp_path, packed=False)
    assert dense.model.packed_summary()["tensors"] == 0
    # The expanded model is the gguf package's dequantization of the file, exactly.
    reader = open_gguf(gguf_path)
    reference = fuse_hf_weights(dense.config, read_gguf_weights(reader, dense.config))
    state = dense.model.state_dict()
    assert set(state) == set(reference)
    for name, tensor in reference.items():
        assert torch.equal(state[name], tensor), name
    prompts = [list(range(3, 3 + 70)), [5, 9, 11]]  # 70 rows: prefill takes MKL
    for prompt in prompts:
        ours = run_steps(packed.model, prompt, steps=4)
        theirs = run_steps(dense.model, prompt, steps=4)
        for step, ((hidden, logits), (hidden_f32, logits_f32)) in enumerate(
            zip(ours, theirs, strict=True)
        ):
            assert torch.equal(hidden, hidden_f32), (len(prompt), step)
            assert torch.isfinite(logits).all()
            torch.testing.assert_close(logits, logits_f32, rtol=1e-5, atol=1e-5)
            assert torch.equal(logits.argmax(-1), logits_f32.argmax(-1))
    decode_program = packed.model._decode_layers  # built for the packed model's decode steps
    assert decode_program is not None and decode_program[1] is not None


def test_warm_start_keeps_the_packed_form(gguf_path: Path, tmp_path: Path) -> None:
    first = load(gguf_path, tmp_path, packed=True).model
    assert len(list((tmp_path / "converted").iterdir())) == 1
    again = load(gguf_path, tmp_path, packed=True).model
    for a, b in zip(_packed(first), _packed(again), strict=True):
        assert torch.equal(a.data, b.data) and torch.equal(a.formats, b.formats)
    assert first.weight_bytes() == again.weight_bytes()


def _packed(model: LlamaForCausalLM) -> list:  # type: ignore[type-arg]
    weights = [w for layer in model.layers for w in layer.packed.values()]  # type: ignore[union-attr]
    return weights + ([model.packed_lm_head] if model.packed_lm_head is not None else [])


def run_steps(
    model: LlamaForCausalLM, prompt: list[int], steps: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(hidden states, logits) of a prefill and `steps` greedy decode steps of one sequence."""
    blocks = math.ceil((len(prompt) + steps) / BLOCK) + 1
    kv = allocate_kv_cache(model.config, blocks, BLOCK, torch.float32, "cpu")
    table = torch.arange(blocks)

    def slots(positions: torch.Tensor) -> torch.Tensor:
        return table[positions // BLOCK] * BLOCK + positions % BLOCK

    positions = torch.arange(len(prompt))
    span = PrefillSpan(start=0, end=len(prompt), num_cached=0, block_table=table)
    meta = AttentionMetadata(slot_mapping=slots(positions), block_size=BLOCK, prefills=[span])
    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    with torch.inference_mode():
        hidden = model(torch.tensor(prompt), positions, kv, meta)
        out.append((hidden, model.compute_logits(hidden[-1:])))
        for step in range(steps):
            position = torch.tensor([len(prompt) + step])
            context = int(position) + 1
            meta = AttentionMetadata(
                slot_mapping=slots(position),
                block_size=BLOCK,
                num_decodes=1,
                decode_block_tables=table[None, : math.ceil(context / BLOCK)].int(),
                decode_context_lens=torch.tensor([context], dtype=torch.int32),
            )
            token = torch.tensor([int(out[-1][1].argmax(-1))])
            hidden = model(token, position, kv, meta)
            out.append((hidden, model.compute_logits(hidden)))
    return out
