"""What the torch references and the Triton kernels share, in one place both import (a Triton module never
imports its dispatcher): the shapes the Triton kernels take, which each dispatcher checks before it launches
one (anything larger takes the reference), the L2 norm, and the flat-batch helpers of the causal conv."""

from __future__ import annotations

import torch

# The widest reduction a weight-streaming GEMV takes (a weight row is one register tile) and the most rows
# one of its launches serves.
MAX_K = 16384
MAX_ROWS = 8
# The widest row, norm group or stream slice a fused norm kernel holds in registers.
MAX_WIDTH = 16384
L2_NORM_EPS = 1e-6


def l2_norm(x: torch.Tensor, eps: float = L2_NORM_EPS) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def row_segments(cu_seqlens: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Segment index of every row of a flat batch (int32 ``[num_rows]``), computed on the device.

    Row ``t`` belongs to segment ``i`` when ``cu_seqlens[i] <= t < cu_seqlens[i + 1]``; counting the
    segment ends ``<= t`` gives ``i`` (empty segments included). Every layer of one forward shares
    ``cu_seqlens``, so a caller may compute this once and pass it as ``row_segment``.
    """
    ends = cu_seqlens[1:].contiguous()
    rows = torch.arange(num_rows, device=cu_seqlens.device, dtype=ends.dtype)
    return torch.searchsorted(ends, rows, right=True, out_int32=True)


def check_l2_group(channels: int, l2_group: int) -> None:
    """Raise ``ValueError`` unless ``l2_group`` is 0 (no normalisation) or a positive divisor of ``channels``."""
    if l2_group < 0 or (l2_group and channels % l2_group):
        raise ValueError(f"l2_group={l2_group} must be 0 or a positive divisor of the channel count {channels}")


def l2_norm_groups(out: torch.Tensor, l2_group: int) -> torch.Tensor:
    """Each consecutive ``l2_group`` channels of every row of ``out`` L2-normalised by
    :func:`l2_norm` in fp32, rounded back to ``out``'s dtype (``l2_group`` divides
    the channel count: see :func:`check_l2_group`)."""
    return l2_norm(out.float().unflatten(-1, (-1, l2_group))).flatten(-2).to(out.dtype)
