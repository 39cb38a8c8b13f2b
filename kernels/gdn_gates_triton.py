"""Triton form of :func:`tidal.kernels.gdn.gdn_gates_ref`: a GDN layer's decay and update gates in one
pass over the ``a`` and ``b`` projections, where torch runs sigmoid, cast, add, softplus, exp, negate
and multiply as separate launches.

Imported only for CUDA tensors (and on the CPU by the tests, under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .pdl_triton import pdl_enter


@triton.jit
def _gates_kernel(a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, g_ptr, beta_ptr, rows, heads, sa_t, sb_t,
                  BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    h = tl.arange(0, BLOCK_H)
    hmask = h < heads
    m = (r < rows)[:, None] & hmask[None, :]
    r64 = r.to(tl.int64)[:, None]
    a = tl.load(a_ptr + r64 * sa_t + h[None, :], mask=m, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + r64 * sb_t + h[None, :], mask=m, other=0.0).to(tl.float32)
    a_log = tl.load(a_log_ptr + h, mask=hmask, other=0.0).to(tl.float32)[None, :]
    dt_bias = tl.load(dt_bias_ptr + h, mask=hmask, other=0.0).to(tl.float32)[None, :]
    g, beta = gates(a, b, a_log, dt_bias)
    tl.store(g_ptr + r64 * heads + h[None, :], g, mask=m)
    tl.store(beta_ptr + r64 * heads + h[None, :], beta.to(beta_ptr.dtype.element_ty), mask=m)


@triton.jit
def gates(a, b, a_log, dt_bias):
    """``(g, beta)`` in fp32 from fp32 ``a``, ``b``, ``A_log`` and ``dt_bias`` (elementwise): the log decay
    ``-exp(A_log) * softplus(a + dt_bias)`` and ``sigmoid(b)``, which the reference rounds to b's dtype."""
    x = a + dt_bias
    # torch's softplus, log1p(exp(x)), x itself past the threshold of 20. For exp(x) < 0.1 the series of
    # log1p to its sixth term (error below e^7 / 7, 1e-7 relative): log(1 + e) would lose e's low bits.
    e = tl.exp(tl.minimum(x, 20.0))
    es = tl.minimum(e, 0.1)
    series = es * (1.0 - es * (0.5 - es * (1.0 / 3.0 - es * (0.25 - es * (0.2 - es / 6.0)))))
    softplus = tl.where(x > 20.0, x, tl.where(e < 0.1, series, tl.log(1.0 + e)))
    return -tl.exp(a_log) * softplus, 1.0 / (1.0 + tl.exp(-b))


def gdn_gates(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(g [T, Hv] fp32, beta [T, Hv] in b's dtype)``; a, b ``[T, Hv]`` with unit stride along heads."""
    rows, heads = a.shape
    g = torch.empty(rows, heads, dtype=torch.float32, device=a.device)
    beta = torch.empty(rows, heads, dtype=b.dtype, device=b.device)
    if rows:
        assert a.stride(1) == 1 and b.stride(1) == 1
        block_h = triton.next_power_of_2(heads)
        block_r = max(1, min(64, 2048 // block_h))
        _gates_kernel[(triton.cdiv(rows, block_r),)](a, b, a_log, dt_bias, g, beta, rows, heads, a.stride(0),
                                                     b.stride(0), BLOCK_R=block_r, BLOCK_H=block_h,
                                                     num_warps=4, **pdl.launch_args(a))
    return g, beta
