"""One rank's share of a checkpoint: attention heads, MLP columns and vocabulary rows.

Megatron's split, on the fused layout (`model.weights`, projections [in, out]):
q/k/v and gate/up are column-parallel (each rank its heads' and its slice's columns),
o and down are row-parallel (each rank the matching input rows; the partial sums meet in
one all-reduce, and only rank 0 keeps their bias), the embedding and lm_head are split
by vocabulary rows (a token's embedding comes from the one rank holding it; logits are
gathered on rank 0). The KV cache then holds each rank's own KV heads. Packed weights
stay packed where the cut falls on their blocks (`packed_slices`), else that shard is
dequantized to float32 here and the log says which.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from servefleet.engine.kernels.packed_weights import PackedWeight, unpack
from servefleet.engine.model.config import ModelConfig
from servefleet.engine.model.conversion_cache import Checkpoint
from servefleet.engine.model.weights import LM_HEAD
from servefleet.engine.parallel.packed_slices import packed_columns, packed_rows

log = logging.getLogger("servefleet.engine.parallel")

Span = tuple[int, int]


class ShardingError(ValueError):
    """The model does not split evenly over this many ranks (named by what does not)."""


@dataclass(frozen=True)
class Shard:
    """Rank `rank` of `world`: which columns and rows of each fused weight it holds."""

    config: ModelConfig  # the whole model's
    rank: int
    world: int

    def _part(self, total: int, base: int = 0) -> Span:
        size = total // self.world
        return base + self.rank * size, base + (self.rank + 1) * size

    @property
    def vocab(self) -> Span:
        return self._part(self.config.vocab_size)

    def qkv_columns(self) -> list[Span]:
        c = self.config
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        return [self._part(q), self._part(kv, q), self._part(kv, q + kv)]

    def gate_up_columns(self) -> list[Span]:
        inter = self.config.intermediate_size
        return [self._part(inter), self._part(inter, inter)]

    def o_rows(self) -> Span:
        return self._part(self.config.num_heads * self.config.head_dim)

    def down_rows(self) -> Span:
        return self._part(self.config.intermediate_size)

    def local_config(self) -> ModelConfig:
        c, w = self.config, self.world
        return c.model_copy(
            update={
                "vocab_size": c.vocab_size // w,
                "num_heads": c.num_heads // w,
                "num_kv_heads": c.num_kv_heads // w,
                "intermediate_size": c.intermediate_size // w,
            }
        )


def check_divisible(config: ModelConfig, world: int) -> None:
    """Refuse, by name, a model whose heads, MLP or vocabulary do not split over `world`."""
    for what, count in (
        ("attention heads", config.num_heads),
        ("KV heads", config.num_kv_heads),
        ("intermediate size", config.intermediate_size),
        ("vocabulary", config.vocab_size),
    ):
        if count % world:
            raise ShardingError(
                f"--tensor-parallel-size {world} does not divide the model's {what} ({count})"
            )


def _columns(tensor: torch.Tensor, spans: list[Span]) -> torch.Tensor:
    """Columns of an [in, out] weight (or entries of a bias) for each span, concatenated."""
    return torch.cat([tensor[..., s:e] for s, e in spans], dim=-1).contiguous()


def shard_checkpoint(checkpoint: Checkpoint, rank: int, world: int) -> Checkpoint:
    """Rank `rank`'s share of `checkpoint` (its config is the shard's: heads, MLP and
    vocabulary divided by `world`)."""
    config = checkpoint.config
    check_divisible(config, world)
    shard = Shard(config, rank, world)
    weights: dict[str, torch.Tensor] = {}
    for name, tensor in checkpoint.weights.items():
        weights[name] = _shard_dense(shard, name, tensor)
    packed: dict[str, PackedWeight] = {}
    unpacked: list[str] = []
    for name, weight in checkpoint.packed.items():
        sliced = _shard_packed(shard, name, weight)
        if sliced is not None:
            packed[name] = sliced
            continue
        unpacked.append(name)
        full = unpack(weight)  # exact: what the packed matmul computes with
        if name != LM_HEAD:
            weights[name] = _shard_dense(shard, name, full)
        elif not config.tie_word_embeddings:  # tied: the embedding's shard serves
            weights["lm_head"] = _columns(full, [shard.vocab]).t().contiguous()
    if unpacked:
        log.info(
            "tensor_parallel_unpacked: rank=%d weights=%d (cut inside a packed block, "
            "held as float32), first=%s",
            rank,
            len(unpacked),
            unpacked[0],
        )
    return replace(checkpoint, config=shard.local_config(), weights=weights, packed=packed)


def _shard_dense(shard: Shard, name: str, tensor: torch.Tensor) -> torch.Tensor:
    param = name.rpartition(".")[2]
    if name in ("embed_tokens", "lm_head"):  # [vocab, hidden]
        start, end = shard.vocab
        return tensor[start:end].contiguous()
    if param in ("qkv_weight", "qkv_bias"):
        return _columns(tensor, shard.qkv_columns())
    if param == "gate_up_weight":
        return _columns(tensor, shard.gate_up_columns())
    if param in ("o_weight", "down_weight"):
        start, end = shard.o_rows() if param == "o_weight" else shard.down_rows()
        return tensor[start:end].contiguous()
    if param == "o_bias":  # added once: by rank 0, before the all-reduce
        return tensor.clone() if shard.rank == 0 else torch.zeros_like(tensor)
    return tensor  # norms: every rank holds them whole


def _shard_packed(shard: Shard, name: str, weight: PackedWeight) -> PackedWeight | None:
    param = name.rpartition(".")[2]
    if name == LM_HEAD:
        return packed_columns(weight, [shard.vocab])
    if param == "qkv_weight":
        return packed_columns(weight, shard.qkv_columns())
    if param == "gate_up_weight":
        return packed_columns(weight, shard.gate_up_columns())
    start, end = shard.o_rows() if param == "o_weight" else shard.down_rows()
    return packed_rows(weight, start, end)
