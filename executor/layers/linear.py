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


def _version(t: torch.Tensor) -> int:
    """In-place write counter of ``t`` (-1 for inference tensors, which keep none)."""
    try:
        return t._version
    except RuntimeError:
        return -1


class StackedWeight:
    """The weights of several projections of one input stacked into one ``[sum N, K]`` matrix, so the
    GPU runs one GEMM where the checkpoint has several (the input read once, one launch). Once built,
    the projections' weights are views of the stack's rows (those of its dtype), so the weights are
    held once.

    ``get()`` rebuilds the stack when a source weight moves, is replaced or is written in place (the
    key: device, dtype, storage, write counter), so loading and ``.to()`` need no hook. Zero rows pad
    it to a multiple of 8 rows: the GEMM output's row stride stays 16-byte aligned in bf16, which
    cuBLAS' fast kernels want. A plain attribute, not a buffer (it stays out of ``state_dict``). Build
    it outside CUDA-graph capture (a warm-up forward does), or its memory would come from the graph's
    pool. ``split(y)`` cuts a stacked output back into the projections' column views.
    """

    def __init__(self, *linears: Linear):
        self.linears = linears
        self.sizes = [lin.weight.shape[0] for lin in linears]
        self._stack: torch.Tensor | None = None
        self._key: tuple | None = None

    def get(self) -> torch.Tensor:
        if self._stack is None or self._key != self._weights_key():
            weights = [lin.weight for lin in self.linears]
            first = weights[0]
            pad = -sum(self.sizes) % 8
            # A normal tensor even when built inside the runner's inference mode: the projections'
            # weights become views of it and must stay usable outside that mode.
            with torch.inference_mode(False):
                stack = torch.cat([w.to(first.dtype) for w in weights] + [first.new_zeros(pad, first.shape[1])])
            # Each weight of the stack's dtype becomes a view of its rows: one copy in memory, not two.
            offset = 0
            for lin, size in zip(self.linears, self.sizes, strict=True):
                if lin.weight.dtype == stack.dtype:
                    lin.weight.data = stack[offset:offset + size]
                offset += size
            if stack.is_cuda and not torch.cuda.is_current_stream_capturing():
                # Kernels launched with PDL (kernels/pdl) load their weights before they wait for the kernel
                # before them: the stack is complete in memory before any kernel can read it.
                torch.cuda.current_stream(stack.device).synchronize()
            self._stack = stack
            self._key = self._weights_key()
        return self._stack

    def _weights_key(self) -> tuple:
        return tuple((w.device, w.dtype, w.data_ptr(), _version(w)) for w in (lin.weight for lin in self.linears))

    def split(self, y: torch.Tensor) -> list[torch.Tensor]:
        return list(y[..., :sum(self.sizes)].split(self.sizes, dim=-1))


class RMSNorm(nn.Module):
    """Qwen4-Exp RMSNorm: scale ``1 + weight``, optional groups of ``group_size`` features."""

    def __init__(self, dim: int, eps: float, group_size: int | None = None):
        super().__init__()
        self.eps, self.group_size = eps, group_size
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.group_size)
