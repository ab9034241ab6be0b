"""GGUF weight loading: every supported tensor type, llama.cpp's q/k permutation, metadata."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from servefleet.engine.model.config import ModelConfig
from servefleet.engine.model.conversion_cache import source_key
from servefleet.engine.model.gguf_loader import (
    GGUFLoadError,
    config_from_gguf,
    dequantize_tensor,
    hf_name,
    open_gguf,
    read_gguf_weights,
)

HIDDEN, HEADS, KV_HEADS, FFN, VOCAB = 256, 4, 2, 512, 64
HEAD_DIM = HIDDEN // HEADS


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to q/k rows."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def write_model(path: Path, tensors: dict[str, tuple[np.ndarray, Q]]) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(50000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(VOCAB)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, (values, qtype) in tensors.items():
        if qtype in (Q.F32, Q.F16):
            dtype = np.float32 if qtype == Q.F32 else np.float16
            writer.add_tensor(name, values.astype(dtype))
        else:
            writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(0)


def test_every_quantizable_type_round_trips_through_the_loader(
    tmp_path: Path, rng: np.random.Generator
) -> None:
    def rand(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32) * 0.05

    q = rand(HEADS * HEAD_DIM, HIDDEN)
    k = rand(KV_HEADS * HEAD_DIM, HIDDEN)
    tensors = {
        "token_embd.weight": (rand(VOCAB, HIDDEN), Q.Q8_0),
        "output_norm.weight": (1 + rand(HIDDEN), Q.F32),
        "output.weight": (rand(VOCAB, HIDDEN), Q.BF16),
        "blk.0.attn_norm.weight": (1 + rand(HIDDEN), Q.F32),
        "blk.0.ffn_norm.weight": (1 + rand(HIDDEN), Q.F16),
        "blk.0.attn_q.weight": (llama_cpp_permute(q, HEADS), Q.F32),
        "blk.0.attn_k.weight": (llama_cpp_permute(k, KV_HEADS), Q.F16),
        "blk.0.attn_v.weight": (rand(KV_HEADS * HEAD_DIM, HIDDEN), Q.Q4_0),
        "blk.0.attn_output.weight": (rand(HIDDEN, HIDDEN), Q.Q4_1),
        "blk.0.ffn_gate.weight": (rand(FFN, HIDDEN), Q.Q5_0),
        "blk.0.ffn_up.weight": (rand(FFN, HIDDEN), Q.Q5_1),
        "blk.0.ffn_down.weight": (rand(HIDDEN, FFN), Q.Q8_0),
    }
    path = tmp_path / "tiny.gguf"
    write_model(path, tensors)
    reader = open_gguf(path)
    config = config_from_gguf(reader)
    weights = read_gguf_weights(reader, config)

    # Un-permuted back to HF order, exactly (F32) or to f16 precision.
    torch.testing.assert_close(
        weights["model.layers.0.self_attn.q_proj.weight"], torch.from_numpy(q)
    )
    torch.testing.assert_close(
        weights["model.layers.0.self_attn.k_proj.weight"],
        torch.from_numpy(k.astype(np.float16).astype(np.float32)),
    )
    torch.testing.assert_close(
        weights["model.layers.0.post_attention_layernorm.weight"],
        torch.from_numpy(tensors["blk.0.ffn_norm.weight"][0].astype(np.float16).astype(np.float32)),
    )
    bf16 = torch.from_numpy(tensors["output.weight"][0]).to(torch.bfloat16).float()
    torch.testing.assert_close(weights["lm_head.weight"], bf16, atol=0, rtol=0)
    # Quantized types: right shape, right values up to that type's rounding.
    tolerances = {Q.Q8_0: 2e-3, Q.Q4_0: 2e-2, Q.Q4_1: 2e-2, Q.Q5_0: 1e-2, Q.Q5_1: 1e-2}
    for gguf_name, (values, qtype) in tensors.items():
        name = hf_name(gguf_name)
        assert name is not None
        loaded = weights[name]
        assert loaded.dtype == torch.float32
        assert tuple(loaded.shape) == values.shape, gguf_name
        if qtype in tolerances:
            error = (loaded - torch.from_numpy(values)).abs().max().item()
            assert error < tolerances[qtype], (gguf_name, qtype.name, error)
            assert error > 0  # really quantized, not stored as float


def test_config_from_gguf_metadata(tmp_path: Path, rng: np.random.Generator) -> None:
    tensors = {"token_embd.weight": (rng.standard_normal((VOCAB, HIDDEN), np.float32), Q.F32)}
    path = tmp_path / "meta.gguf"
    write_model(path, tensors)
    config = ModelConfig.from_gguf(open_gguf(path))
    assert config.architecture == "llama"
    assert (config.hidden_size, config.num_heads, config.num_kv_heads) == (HIDDEN, HEADS, KV_HEADS)
    assert (config.head_dim, config.intermediate_size, config.num_layers) == (HEAD_DIM, FFN, 1)
    assert config.rope_theta == 50000.0
    assert config.max_position_embeddings == 512
    assert config.tie_word_embeddings  # no output.weight in the file
    assert config.bos_token_id == 1 and config.eos_token_ids == [2]


def _q4_k_block(d: float, dmin: float, sc: list[int], m: list[int], qs_byte: int) -> bytes:
    """One Q4_K super-block laid out per llama.cpp's block_q4_K (scales < 64, upper < 16)."""
    scales = bytearray(12)
    for j in range(4):
        scales[j] = sc[j]
        scales[j + 4] = m[j]
        scales[j + 8] = (sc[j + 4] & 0xF) | ((m[j + 4] & 0xF) << 4)
    head = np.array([d, dmin], dtype=np.float16).tobytes()
    return head + bytes(scales) + bytes([qs_byte]) * 128


def test_q4_k_known_values() -> None:
    sc = [1, 2, 3, 4, 5, 6, 7, 8]
    m = [0, 1, 2, 3, 4, 5, 6, 7]
    block = _q4_k_block(0.5, 0.25, sc, m, 0x53)  # low nibble 3, high nibble 5
    rows = np.frombuffer(block * 2, dtype=np.uint8).reshape(2, 144)
    loaded = dequantize_tensor(rows, Q.Q4_K, (2, 256))
    expected = []
    for j in range(8):  # sub-blocks of 32; even ones take the low nibble
        q = 3 if j % 2 == 0 else 5
        expected += [0.5 * sc[j] * q - 0.25 * m[j]] * 32
    want = torch.tensor([expected, expected], dtype=torch.float32)
    torch.testing.assert_close(loaded, want)


def test_q6_k_known_values() -> None:
    scales = np.arange(-8, 8, dtype=np.int8)
    d = 0.125
    block = (
        bytes([0x21]) * 128  # ql: low nibble 1, high nibble 2
        + bytes([0b11100100]) * 64  # qh: 2-bit groups 0,1,2,3
        + scales.tobytes()
        + np.array([d], dtype=np.float16).tobytes()
    )
    rows = np.frombuffer(block, dtype=np.uint8).reshape(1, 210)
    loaded = dequantize_tensor(rows, Q.Q6_K, (1, 256))
    # Within each half of 128: values [0,32) q=1, [32,64) q=1+16, [64,96) q=2+32, [96,128) q=2+48.
    quant = {0: 1, 1: 17, 2: 34, 3: 50}
    expected = [d * float(scales[v // 16]) * (quant[(v % 128) // 32] - 32) for v in range(256)]
    torch.testing.assert_close(loaded, torch.tensor([expected], dtype=torch.float32))


def test_unsupported_type_and_unknown_tensor_are_clear_errors() -> None:
    with pytest.raises(GGUFLoadError, match="not supported"):
        dequantize_tensor(np.zeros((1, 36), dtype=np.uint8), Q.Q8_1, (1, 32))
    with pytest.raises(GGUFLoadError, match="unexpected tensor"):
        hf_name("blk.0.attn_qkv.weight")
    assert hf_name("rope_freqs.weight") is None
    assert hf_name("blk.3.ffn_down.weight") == "model.layers.3.mlp.down_proj.weight"


def test_cache_key_follows_the_source_file_identity(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF" + bytes(100))
    first = source_key(path)
    assert source_key(path) == first
    path.write_bytes(b"GGUF" + bytes(99) + b"\x01")
    assert source_key(path) != first
