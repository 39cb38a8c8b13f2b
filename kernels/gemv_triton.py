"""A weight-streaming GEMV for the few rows of a decode step: ``y = x W^T`` (imported for CUDA tensors, and
on the CPU by the tests under ``TRITON_INTERPRET=1``).

At one row a projection is a read of its weight. For the small weights of a decode step (a few MB)
cuBLAS runs a split-K GEMM and a reduce, two launches of a fixed 3-5 us whatever the bytes
(``benchmarks/bench_decode_gemm.py``). Here one launch does it: a program takes ``BLOCK_N`` whole weight
rows and loads them in one unrolled pass, so every byte it needs is in flight at once (a loop over the
reduction would wait one HBM round trip per step, which is why a GEMV with too few programs starves),
then multiplies them with each row of ``x`` in turn (the weight tile stays in registers) and writes
the rounded outputs. Launched with PDL (``kernels/pdl``), the weight loads overlap the previous
kernel. The grid is ``cdiv(N, BLOCK_N)`` programs, each reading ``BLOCK_N * K`` weights.

Each output is one fp32 dot product over the whole row, rounded once to ``y``'s dtype, as a GEMM's
output is; a row's result does not depend on the other rows of the batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .common import MAX_K, MAX_ROWS
from .pdl_triton import pdl_launch_next, pdl_wait


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, n_out, k_in, stride_x, stride_w, stride_y,
                 ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PDL: tl.constexpr):
    pdl_launch_next(PDL)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    rows = tl.arange(0, BLOCK_M)
    nmask = n < n_out
    kmask = k < k_in
    w = tl.load(w_ptr + n.to(tl.int64)[:, None] * stride_w + k[None, :],
                mask=nmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
    pdl_wait(PDL)  # the weights are loading; x is the previous kernel's output
    # Every row's result is kept until one store at the end: a store between the rows would hold the
    # next row's load behind it (the compiler must assume y may alias x).
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for m in tl.static_range(ROWS):
        x = tl.load(x_ptr + m * stride_x + k, mask=kmask, other=0.0).to(tl.float32)
        acc = tl.where(rows[:, None] == m, tl.sum(w * x[None, :], axis=1)[None, :], acc)
    tl.store(y_ptr + rows[:, None] * stride_y + n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rows < ROWS)[:, None] & nmask[None, :])


def block_n(n_out: int, k_in: int, tile: int = 4096) -> int:
    """Weight rows a program reads: a tile of about ``tile`` weights, at least one row."""
    return max(1, min(triton.next_power_of_2(n_out), tile // triton.next_power_of_2(k_in)))


def gemv_triton(x: torch.Tensor, weight: torch.Tensor, tile: int = 4096, num_warps: int = 8) -> torch.Tensor:
    """``x @ weight.T`` for ``x [M, K]`` (M <= :data:`MAX_ROWS`, unit column stride) and ``weight [N, K]``
    (unit column stride, K <= :data:`MAX_K`), in ``x``'s dtype; one launch. ``tile`` (weights a program
    reads) and ``num_warps`` are the launch's shape."""
    rows, k_in = x.shape
    n_out = weight.shape[0]
    if weight.shape[1] != k_in:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} do not multiply")
    if rows > MAX_ROWS or k_in > MAX_K:
        raise ValueError(f"gemv_triton takes at most {MAX_ROWS} rows and {MAX_K} input features, "
                         f"got {rows} x {k_in}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    y = torch.empty(rows, n_out, dtype=x.dtype, device=x.device)
    if rows == 0 or n_out == 0:
        return y
    if k_in == 0:
        return y.zero_()
    bn = block_n(n_out, k_in, tile)
    _gemv_kernel[(triton.cdiv(n_out, bn),)](x, weight, y, n_out, k_in, x.stride(0), weight.stride(0), y.stride(0),
                                            ROWS=rows, BLOCK_M=triton.next_power_of_2(rows), BLOCK_N=bn,
                                            BLOCK_K=triton.next_power_of_2(k_in), num_warps=num_warps,
                                            **pdl.launch_args(x))
    return y
