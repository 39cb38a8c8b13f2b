"""Rotary position embedding over the first ``rotary_dim`` features.

Qwen4-Exp's multimodal rotary gives each token three positions (frame, row, column) and interleaves
their frequencies: frequency ``j`` turns with the row position for ``j = 1, 4, 7, ...`` below
``3 * section[1]``, with the column position for ``j = 2, 5, 8, ...`` below ``3 * section[2]``, and with
the frame position otherwise. Text tokens carry the same position on all three, so for them it is
ordinary partial rotary; only vision tokens and the text after them need the three.
"""

from __future__ import annotations

import torch
from torch import nn

from ...kernels.backend import use_triton
from .linear import RMSNorm


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Rotary(nn.Module):
    def __init__(self, rotary_dim: int, theta: float, mrope_section: tuple[int, int, int] = (11, 11, 10)):
        super().__init__()
        self.rotary_dim = rotary_dim
        axis = torch.zeros(rotary_dim // 2, dtype=torch.long, device="cpu")
        axis[1:3 * mrope_section[1]:3] = 1
        axis[2:3 * mrope_section[2]:3] = 2
        self._axis = axis  # the position (0 frame, 1 row, 2 column) each frequency turns with
        # Kept in fp32 outside the parameter/buffer set so that a dtype cast never touches it.
        self._inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float, device="cpu")
                                          / rotary_dim))
        self._on_device: dict[torch.device, torch.Tensor] = {}
        self._axis_on_device: dict[torch.device, torch.Tensor] = {}

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        """The fp32 inverse frequencies ``[rotary_dim / 2]`` on ``device`` (copied there once)."""
        inv_freq = self._on_device.get(device)
        if inv_freq is None:
            inv_freq = self._on_device[device] = self._inv_freq.to(device)
        return inv_freq

    def axis(self, device: torch.device) -> torch.Tensor:
        """The axis (0 frame, 1 row, 2 column) each frequency turns with, ``[rotary_dim / 2]`` long on ``device``."""
        axis = self._axis_on_device.get(device)
        if axis is None:
            axis = self._axis_on_device[device] = self._axis.to(device)
        return axis

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``[T, rotary_dim]`` cos and sin for integer ``positions [T]``, or ``[3, T]`` (frame, row,
        column)."""
        inv_freq = self.inv_freq(positions.device)
        if positions.dim() == 2:
            picked = positions[self.axis(positions.device)].T  # [T, rotary_dim / 2]
            freqs = picked.float() * inv_freq
        else:
            freqs = positions.float().unsqueeze(-1) * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    @staticmethod
    def norm_apply(norm: RMSNorm, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``apply(norm(x), cos, sin)`` for ``x [T, heads, d]``: one Triton pass on the GPU."""
        if use_triton(x, "norm_rotary") and norm.group_size is None and x.dim() == 3 and x.stride(2) == 1:
            from ...kernels.norm_triton import rms_norm_rotary_triton

            return rms_norm_rotary_triton(x, norm.weight, norm.eps, cos, sin)
        return Rotary.apply(norm(x), cos, sin)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x [T, heads, d]`` (or ``[T, d]``) by per-row ``cos/sin [T, rotary_dim]``."""
        rd = cos.shape[-1]
        if x.dim() == 3:
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        rot, rest = x[..., :rd], x[..., rd:]
        return torch.cat([rot * cos + rotate_half(rot) * sin, rest], dim=-1)
