"""Synthetic Llama-family GGUF files in any block format, for quantization tests and benchmarks.

Nothing is downloaded: the weights are random and the tokenizer is a small SentencePiece
vocabulary padded to the wanted size. Float and legacy block types (F32, Q4_0 … Q8_0)
are quantized by the `gguf` package itself; it cannot quantize K-quants, so their blocks
are random bytes with small, finite float16 super-block scales — every such block is a
valid K-quant block, and the reference dequantization (`gguf.quants`) defines its values.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

# Byte offsets of the float16 super-block scales (d, dmin) of each K-quant block.
K_QUANT_F16_FIELDS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
ROLES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


@dataclass(frozen=True)
class LlamaShape:
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    layers: int
    vocab: int
    tied: bool = True

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


# Small enough for a test, K-quant friendly (every input size a multiple of 256).
TINY = LlamaShape(hidden=256, heads=4, kv_heads=2, ffn=512, layers=2, vocab=320, tied=False)

# Tensor type by role ("token_embd", "output" and ROLES), per scheme; norms are F32.
SCHEMES: dict[str, dict[str, str]] = {
    "F32": {role: "F32" for role in (*ROLES, "token_embd", "output")},
    "Q8_0": {role: "Q8_0" for role in (*ROLES, "token_embd", "output")},
    "Q4_K": {role: "Q4_K" for role in (*ROLES, "token_embd", "output")},
    "Q5_K": {role: "Q5_K" for role in (*ROLES, "token_embd", "output")},
    "Q6_K": {role: "Q6_K" for role in (*ROLES, "token_embd", "output")},
    # llama.cpp's Q4_K_M: Q6_K for v, down and the output, Q4_K elsewhere.
    "Q4_K_M": {
        **{role: "Q4_K" for role in (*ROLES, "token_embd")},
        **{"attn_v": "Q6_K", "ffn_down": "Q6_K", "output": "Q6_K"},
    },
}


def random_blocks(type_name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Raw blocks [rows, bytes per row] of a random [rows, cols] weight in `type_name`."""
    qtype = GGMLQuantizationType[type_name]
    if type_name not in K_QUANT_F16_FIELDS:
        values = rng.standard_normal((rows, cols), dtype=np.float32) * 0.05
        return gguf.quants.quantize(values, qtype)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows * cols // block_size, type_size), dtype=np.uint8)
    for at in K_QUANT_F16_FIELDS[type_name]:
        scale = rng.uniform(2e-5, 2e-4, (raw.shape[0], 1)).astype(np.float16)
        raw[:, at : at + 2] = scale.view(np.uint8)
    if type_name == "Q6_K":  # signed 8-bit sub-block scales: keep them moderate
        raw[:, 192:208] = (rng.integers(-40, 40, (raw.shape[0], 16))).astype(np.int8).view(np.uint8)
    return raw.reshape(rows, -1)


def _tokens(vocab: int) -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece vocabulary of `vocab` pieces: controls, 256 bytes, letters, fillers."""
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "\u2581", *letters]
    tokens += [f"\u2581w{i}" for i in range(vocab - len(tokens))]
    if len(tokens) != vocab:
        raise ValueError(f"a vocabulary needs at least {len(tokens)} pieces, not {vocab}")
    scores = [0.0] * 259 + [-float(i) for i in range(vocab - 259)]
    types = [2, 3, 3] + [6] * 256 + [1] * (vocab - 259)
    return tokens, scores, types


def write_llama_gguf(
    path: Path, shape: LlamaShape, scheme: dict[str, str], rng: np.random.Generator
) -> None:
    """A llama-architecture GGUF with random weights stored as `scheme` says."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(shape.layers)
    writer.add_context_length(2048)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(shape.vocab)
    tokens, scores, types = _tokens(shape.vocab)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)

    def add(name: str, role: str, rows: int, cols: int) -> None:
        type_name = scheme[role]
        if type_name == "F32":
            values = rng.standard_normal((rows, cols), dtype=np.float32) * 0.05
            writer.add_tensor(name, values)
        else:
            qtype = GGMLQuantizationType[type_name]
            writer.add_tensor(name, random_blocks(type_name, rows, cols, rng), raw_dtype=qtype)

    def norm(name: str) -> None:
        writer.add_tensor(name, 1 + 0.1 * rng.standard_normal(shape.hidden, dtype=np.float32))

    q_rows, kv_rows = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    add("token_embd.weight", "token_embd", shape.vocab, shape.hidden)
    norm("output_norm.weight")
    if not shape.tied:
        add("output.weight", "output", shape.vocab, shape.hidden)
    for index in range(shape.layers):
        blk = f"blk.{index}."
        norm(blk + "attn_norm.weight")
        norm(blk + "ffn_norm.weight")
        add(blk + "attn_q.weight", "attn_q", q_rows, shape.hidden)
        add(blk + "attn_k.weight", "attn_k", kv_rows, shape.hidden)
        add(blk + "attn_v.weight", "attn_v", kv_rows, shape.hidden)
        add(blk + "attn_output.weight", "attn_output", shape.hidden, q_rows)
        add(blk + "ffn_gate.weight", "ffn_gate", shape.ffn, shape.hidden)
        add(blk + "ffn_up.weight", "ffn_up", shape.ffn, shape.hidden)
        add(blk + "ffn_down.weight", "ffn_down", shape.hidden, shape.ffn)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
