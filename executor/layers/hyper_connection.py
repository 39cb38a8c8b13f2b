"""Hyper-connections: ``hc_count`` residual streams mixed into one block input and re-injected."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .linear import Linear, RMSNorm


class GatedResidual(nn.Module):
    """Reads ``H [T, hc * hidden]``; returns the block input ``[T, hidden]`` and injection weights.

    The block input is the mean over streams of the grouped-normalised streams, each scaled by a
    low-rank sigmoid gate. Injection weights ``2 * sigmoid(.)`` (one per stream) scale the block
    output added back to every stream. The final mixer has no injection (``use_combine=False``).
    """

    def __init__(self, hc_count: int, hidden: int, lowrank: int, eps: float, use_combine: bool = True):
        super().__init__()
        self.hc_count, self.hidden = hc_count, hidden
        width = hc_count * hidden
        self.hc_norm = RMSNorm(width, eps, group_size=hidden)
        self.input_mix_weight_down = Linear(width, lowrank)
        self.input_mix_weight_up = Linear(lowrank, width)
        self.block_inject_weight = Linear(width, hc_count) if use_combine else None

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        normed = self.hc_norm(streams)
        mix = F.silu(self.input_mix_weight_down(normed) / self.hc_count)
        mix = torch.sigmoid(self.input_mix_weight_up(mix)).unflatten(-1, (self.hc_count, self.hidden))
        block_input = (mix * normed.unflatten(-1, (self.hc_count, self.hidden))).mean(dim=-2)
        if self.block_inject_weight is None:
            return block_input, None
        inject = 2 * torch.sigmoid(self.block_inject_weight(normed) / self.hc_count)
        return block_input, inject

    @staticmethod
    def residual(streams: torch.Tensor, block_out: torch.Tensor, inject: torch.Tensor) -> torch.Tensor:
        """``H + inject ⊗ block_out``."""
        return streams + (block_out.unsqueeze(-2) * inject.unsqueeze(-1)).flatten(-2)
