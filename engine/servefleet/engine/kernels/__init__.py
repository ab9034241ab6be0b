"""Decode-attention kernels and the choice between them.

Every kernel has the `DecodeKernel` signature of `torch_paged_decode`, so the
engine can swap them freely; the PyTorch reference is always there as fallback.
"""

from __future__ import annotations

import functools
import logging
from typing import Literal, cast

import torch

from servefleet.engine.attention import DecodeKernel, torch_paged_decode
from servefleet.engine.kernels.cpu_paged_decode import load_cpu_paged_decode
from servefleet.engine.kernels.triton_paged_decode import triton_paged_decode, triton_unavailable

logger = logging.getLogger("servefleet.engine.kernels")

KernelName = Literal["torch", "cpu-c", "triton"]
KERNEL_NAMES: tuple[KernelName, ...] = ("torch", "cpu-c", "triton")


class KernelUnavailableError(RuntimeError):
    """A kernel was asked for by name but cannot run here."""


def _forced_kernel(name: str, device_type: str) -> DecodeKernel:
    if name == "torch":
        return torch_paged_decode
    if name == "cpu-c":
        if device_type != "cpu":
            raise KernelUnavailableError(f"cpu-c runs on CPU tensors, not {device_type}")
        kernel = load_cpu_paged_decode()
        if kernel is None:
            raise KernelUnavailableError("cpu-c could not be built (see the warning logged)")
        return kernel
    if name == "triton":
        reason = triton_unavailable(device_type)
        if reason is not None:
            raise KernelUnavailableError(f"triton: {reason}")
        return triton_paged_decode
    raise ValueError(
        f"unknown decode kernel {name!r}; choose one of auto, {', '.join(KERNEL_NAMES)}"
    )


def _auto_kernel(device_type: str) -> tuple[KernelName, DecodeKernel]:
    if device_type == "cuda":
        reason = triton_unavailable(device_type)
        if reason is None:
            return "triton", triton_paged_decode
        logger.info("Triton decode kernel unavailable (%s)", reason)
    elif device_type == "cpu":
        kernel = load_cpu_paged_decode()
        if kernel is not None:
            return "cpu-c", kernel
    return "torch", torch_paged_decode


@functools.cache
def _select(device_type: str, prefer: str) -> tuple[KernelName, DecodeKernel]:
    """Cached so the choice (and its log line) happens once per device type."""
    if prefer == "auto":
        name, kernel = _auto_kernel(device_type)
    else:
        kernel = _forced_kernel(prefer, device_type)
        name = cast(KernelName, prefer)  # _forced_kernel rejected unknown names
    logger.info("decode attention kernel for %s: %s (prefer=%s)", device_type, name, prefer)
    return name, kernel


def select_decode_kernel(
    device: torch.device | str, prefer: str = "auto"
) -> tuple[KernelName, DecodeKernel]:
    """Fastest kernel for `device`: CUDA → Triton, CPU → the C kernel, else PyTorch.

    `prefer` forces one ("torch", "cpu-c", "triton"); a forced kernel that cannot
    run raises KernelUnavailableError instead of silently falling back.
    """
    return _select(torch.device(device).type, prefer)


__all__ = [
    "KERNEL_NAMES",
    "DecodeKernel",
    "KernelName",
    "KernelUnavailableError",
    "select_decode_kernel",
    "torch_paged_decode",
]
