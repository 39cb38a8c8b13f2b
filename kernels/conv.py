"""Depthwise causal conv1d with carried history (GDN and PLE short convs)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d(x: torch.Tensor, history: torch.Tensor, weight: torch.Tensor, dilation: int = 1,
                  silu: bool = True) -> torch.Tensor:
    """Depthwise causal convolution of one sequence that continues from ``history``.

    Args:
        x: ``[L, C]`` new rows.
        history: ``[W, C]`` the ``W = (k - 1) * dilation`` rows before ``x`` (zeros at a sequence start).
        weight: ``[C, k]`` per-channel taps.
    Returns ``[L, C]`` in ``x``'s dtype; the arithmetic runs in ``weight``'s dtype.
    """
    length = x.shape[0]
    full = torch.cat([history.to(x.dtype), x], dim=0).to(weight.dtype)
    out = F.conv1d(full.t().unsqueeze(0), weight.unsqueeze(1), dilation=dilation, groups=weight.shape[0])
    out = out[0, :, -length:].t()
    if silu:
        out = F.silu(out)
    return out.to(x.dtype)


def conv_history(x: torch.Tensor, history: torch.Tensor, upto: int) -> torch.Tensor:
    """The ``W`` rows immediately before local offset ``upto`` of ``x`` (``0 <= upto <= L``).

    This is what a state checkpoint at an internal offset stores: no recomputation, only the
    rows the next forward's convolution will read.
    """
    width = history.shape[0]
    if width == 0:
        return history.clone()
    full = torch.cat([history.to(x.dtype), x[:upto]], dim=0)
    return full[full.shape[0] - width:].clone()
