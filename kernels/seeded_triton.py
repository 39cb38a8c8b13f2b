"""Seeded n-gram table rows in one pass (imported for CUDA tensors, and on the CPU by the tests under
``TRITON_INTERPRET=1``): the values :func:`tidal.executor.weights.table_rows` computes, bit for bit.

The reference hashes each value's index through a dozen full-size int64 temporaries and a float64 inverse normal
CDF; a ``flash-next`` table is 51 G values. Here each program hashes its indices in registers and looks the value
up in the caller's table of the inverse CDF at every 24-bit code (computed once by the reference's own arithmetic,
so the bits are the same).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit(do_not_specialize=["total", "offset"])
def _seeded_rows_kernel(rows_ptr, lut_ptr, out_ptr, total, dim, offset, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < total
    row = tl.load(rows_ptr + i // dim, mask=mask, other=0)
    # splitmix64 of the value's index in the whole table, modulo 2^64
    x = (row * dim + i % dim).to(tl.uint64) * 0x9E3779B97F4A7C15 + offset.to(tl.uint64)
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB
    x = x ^ (x >> 31)
    value = tl.load(lut_ptr + (x >> 40).to(tl.int32), mask=mask, other=0.0)
    tl.store(out_ptr + i, value, mask=mask)


def seeded_rows(rows: torch.Tensor, dim: int, offset: int, lut: torch.Tensor) -> torch.Tensor:
    """fp32 ``[*rows.shape, dim]``: value ``lut[top 24 bits of splitmix64(row * dim + column, offset)]`` of each
    row of ``rows`` (long) and column (``lut``: float32 ``[2^24]`` on ``rows``' device)."""
    flat = rows.reshape(-1).to(torch.long, copy=True)  # a new (aligned) buffer: one pointer specialization
    out = torch.empty((*rows.shape, dim), dtype=torch.float32, device=rows.device)
    total = flat.numel() * dim
    if total:
        _seeded_rows_kernel[(triton.cdiv(total, BLOCK),)](flat, lut, out, total, dim, offset, BLOCK=BLOCK)
    return out
