"""Triton GEMV for projections of a few rows: ``y = x W^T`` for ``x [M <= 4, K]``, one launch.

Imported only for CUDA tensors (and on the CPU by the tests, under ``TRITON_INTERPRET=1``).

At decode sizes a projection is a weight stream. For long reductions and few outputs (a
hyper-connection's ``hc * hidden -> lowrank`` mix, an output projection) cuBLAS picks split-K
kernels followed by a separate reduction kernel; here each program owns ``BLOCK_N`` output columns
over the whole of ``K``, so there is one launch and no partial sums in memory. Grid
``(cdiv(N, BLOCK_N),)``; each step loads a ``[BLOCK_N, BLOCK_K]`` weight tile (contiguous along K)
and the ``[BLOCK_M, BLOCK_K]`` rows of x, and accumulates their products in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROWS = 4


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, rows, n_out, k_dim, sx_m, sw_n, sy_m,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < n_out
    m = tl.arange(0, BLOCK_M)
    mmask = m < rows
    ks = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + n.to(tl.int64)[:, None] * sw_n
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        kmask = k0 + ks < k_dim
        w = tl.load(w_rows + k0 + ks[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
        x = tl.load(x_ptr + m[:, None] * sx_m + k0 + ks[None, :], mask=mmask[:, None] & kmask[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], 2)
    tl.store(y_ptr + m[:, None] * sy_m + n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


def gemv(x: torch.Tensor, weight: torch.Tensor, block_n: int = 4, block_k: int = 512,
         num_warps: int = 4) -> torch.Tensor:
    """``F.linear(x, weight)`` for ``x [M, K]`` with ``M <= MAX_ROWS``; weight ``[N, K]`` contiguous along K."""
    rows, k_dim = x.shape
    n_out = weight.shape[0]
    assert rows <= MAX_ROWS and weight.shape[1] == k_dim and weight.stride(1) == 1
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty(rows, n_out, dtype=x.dtype, device=x.device)
    if rows:
        _gemv_kernel[(triton.cdiv(n_out, block_n),)](
            x, weight, y, rows, n_out, k_dim, x.stride(0), weight.stride(0), y.stride(0),
            BLOCK_M=triton.next_power_of_2(rows), BLOCK_N=block_n, BLOCK_K=min(block_k, triton.next_power_of_2(k_dim)),
            num_warps=num_warps)
    return y
