"""The projections of a decode step's few rows: the weight-streaming GEMV (``gemv_triton``) for one or two
rows, the tensor-core GEMM for few rows (``skinny_triton``) up to :data:`SKINNY_ROWS`, ``F.linear`` everywhere
else (the CPU path, larger batches, a bias, ``TIDAL_KERNELS=torch:gemv`` or ``torch:skinny``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .backend import use_triton
from .common import MAX_K

# Rows up to which a CUDA projection takes the GEMV (measured with ``benchmarks/bench_decode_kernels.py
# --parts gemv``; beyond it each extra row costs the kernel more than cuBLAS' whole GEMM).
GEMV_ROWS = 2
# Rows up to which a CUDA projection past GEMV_ROWS takes the few-row GEMM (``--parts skinny`` of the same
# benchmark: cuBLAS' split-K GEMM and reduce against it at the flash-next projections).
SKINNY_ROWS = 64


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; a 2-D ``x`` of CUDA rows without a bias runs one GEMV launch up to
    :data:`GEMV_ROWS` rows, the few-row GEMM up to :data:`SKINNY_ROWS`."""
    if bias is None and x.dim() == 2 and x.dtype == weight.dtype:
        rows = x.shape[0]
        if rows <= GEMV_ROWS and weight.shape[1] <= MAX_K and use_triton(x, "gemv"):
            from .gemv_triton import gemv_triton

            return gemv_triton(x, weight)
        if GEMV_ROWS < rows <= SKINNY_ROWS and use_triton(x, "skinny"):
            from .skinny_triton import skinny_triton

            return skinny_triton(x, weight)
    return F.linear(x, weight, bias)
