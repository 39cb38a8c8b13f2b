"""RMS norms as Qwen4-Exp computes them (fp32 statistics, ``1 + weight`` scale).

``rms_norm_ref`` and ``gated_rms_norm_ref`` are the torch references (the CPU path and the oracle of
the Triton kernels in ``norm_triton``); ``rms_norm`` and ``gated_rms_norm`` dispatch between them
with :func:`~tidal.kernels.backend.use_triton`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .backend import use_triton
from .common import MAX_WIDTH


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int | None = None) -> torch.Tensor:
    """``x / rms(x) * (1 + weight)`` in fp32, optionally over groups of ``group_size`` features."""
    h = x.float()
    if group_size is not None:
        h = h.reshape(*h.shape[:-1], -1, group_size)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if group_size is not None:
        h = h.flatten(-2)
    return (h * (1.0 + weight.float())).type_as(x)


def gated_rms_norm_ref(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                       activation: str = "silu") -> torch.Tensor:
    """GDN output norm: ``weight * x / rms(x) * act(gate)``; plain (not ``1 +``) weight.

    The normalised ``x`` is rounded to x's dtype before the weight multiplies it, and the product to
    the promoted dtype of the two; the Triton kernel copies both roundings so bf16 results agree.
    """
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(dtype)
    g = gate.float()
    g = F.silu(g) if activation == "silu" else torch.sigmoid(g)
    return (h * g).to(dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int | None = None) -> torch.Tensor:
    """:func:`rms_norm_ref`, by a Triton kernel for CUDA tensors whose groups have at most
    :data:`~tidal.kernels.common.MAX_WIDTH` features."""
    if use_triton(x, "norm") and (group_size or x.shape[-1]) <= MAX_WIDTH:
        from .norm_triton import rms_norm_triton

        return rms_norm_triton(x, weight, eps, group_size)
    return rms_norm_ref(x, weight, eps, group_size)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                   activation: str = "silu") -> torch.Tensor:
    """:func:`gated_rms_norm_ref`, by a Triton kernel for CUDA tensors of at most
    :data:`~tidal.kernels.common.MAX_WIDTH` features a row and a gate of ``x``'s shape."""
    if use_triton(x, "norm") and x.shape[-1] <= MAX_WIDTH and gate.shape == x.shape:
        from .norm_triton import gated_rms_norm_triton

        return gated_rms_norm_triton(x, gate, weight, eps, activation)
    return gated_rms_norm_ref(x, gate, weight, eps, activation)
