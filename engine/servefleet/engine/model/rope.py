"""Rotary position embedding: inverse frequencies per scaling variant, and a cos/sin table.

The table is computed once in float32 for every position the engine may see and stored in
the model dtype, so a step only gathers rows by position (one index op per step, shared by
all layers). The layout is HF's `rotate_half` one (first half / second half of head_dim),
which is why GGUF llama q/k weights are un-permuted at load time.
"""

from __future__ import annotations

import math

import torch

from servefleet.engine.model.config import ModelConfig, RopeScaling


def inverse_frequencies(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim // 2] float32, attention factor applied to cos/sin)."""
    dim = config.head_dim
    base = config.rope_theta
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    inv_freq = 1.0 / (base**exponents)
    attention_factor = 1.0
    scaling = config.rope_scaling
    if scaling is not None:
        if scaling.rope_type == "linear":
            inv_freq = inv_freq / scaling.factor
        elif scaling.rope_type == "llama3":
            inv_freq = _llama3(inv_freq, scaling, config.max_position_embeddings)
        elif scaling.rope_type == "yarn":
            inv_freq, attention_factor = _yarn(config, scaling)
        # "dynamic": NTK rescaling only kicks in beyond the trained context, where HF
        # recomputes frequencies per sequence length; within it the base frequencies are exact.
    if config.rope_freq_factors is not None:
        factors = torch.tensor(config.rope_freq_factors, dtype=torch.float32)
        if factors.numel() != inv_freq.numel():
            raise ValueError(
                f"rope_freq_factors has {factors.numel()} entries, expected {inv_freq.numel()}"
            )
        inv_freq = inv_freq / factors
    return inv_freq, attention_factor


def _llama3(inv_freq: torch.Tensor, s: RopeScaling, max_positions: int) -> torch.Tensor:
    if s.low_freq_factor is None or s.high_freq_factor is None:
        raise ValueError("llama3 rope scaling needs low_freq_factor and high_freq_factor")
    old_context = s.original_max_position_embeddings or max_positions
    low_wavelen = old_context / s.low_freq_factor
    high_wavelen = old_context / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(config: ModelConfig, s: RopeScaling) -> tuple[torch.Tensor, float]:
    dim = config.head_dim
    base = config.rope_theta
    original = s.original_max_position_embeddings or config.max_position_embeddings
    factor = s.factor
    if s.attention_factor is not None:
        attention_factor = s.attention_factor
    elif s.mscale and s.mscale_all_dim:
        attention_factor = _yarn_mscale(factor, s.mscale) / _yarn_mscale(factor, s.mscale_all_dim)
    else:
        attention_factor = _yarn_mscale(factor)
    beta_fast = s.beta_fast or 32.0
    beta_slow = s.beta_slow or 1.0

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = base ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight
    return inv_freq, attention_factor


def rope_table(
    config: ModelConfig, max_positions: int, dtype: torch.dtype, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [max_positions, head_dim], float32 math, stored in `dtype`."""
    inv_freq, attention_factor = inverse_frequencies(config)
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = (emb.cos() * attention_factor).to(device=device, dtype=dtype)
    sin = (emb.sin() * attention_factor).to(device=device, dtype=dtype)
    return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos/sin: [T, 1, head_dim]. HF rotate_half convention."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin
