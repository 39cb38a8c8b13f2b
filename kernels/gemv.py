"""The projections of a decode step's few rows: the weight-streaming GEMV (``gemv_triton``) where it beats
cuBLAS, ``F.linear`` everywhere else (the CPU path, larger batches, a bias, ``TIDAL_KERNELS=torch:gemv``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .backend import use_triton
from .common import MAX_K

# Rows up to which a CUDA projection takes the GEMV (measured with ``benchmarks/bench_decode_kernels.py
# --parts gemv``; beyond it each extra row costs the kernel more than cuBLAS' whole GEMM).
GEMV_ROWS = 2


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; a 2-D ``x`` of at most :data:`GEMV_ROWS` CUDA rows without a bias runs
    one GEMV launch."""
    if (bias is None and x.dim() == 2 and x.shape[0] <= GEMV_ROWS and weight.shape[1] <= MAX_K
            and x.dtype == weight.dtype and use_triton(x, "gemv")):
        from .gemv_triton import gemv_triton

        return gemv_triton(x, weight)
    return F.linear(x, weight, bias)
