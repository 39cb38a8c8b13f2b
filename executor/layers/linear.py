"""Linear projections and norms holding checkpoint-named parameters."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...kernels.norm import rms_norm


class Linear(nn.Module):
    """``y = x W^T`` (no bias in Qwen4-Exp unless ``attention_bias``)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """Qwen4-Exp RMSNorm: scale ``1 + weight``, optional groups of ``group_size`` features."""

    def __init__(self, dim: int, eps: float, group_size: int | None = None):
        super().__init__()
        self.eps, self.group_size = eps, group_size
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.group_size)
