"""Dequantization of stacked expert weights in one pass (imported for CUDA tensors, and on the CPU by the tests under
``TRITON_INTERPRET=1``): the values :mod:`tidal.kernels.quant`'s references compute, bit for bit.

The references build each value through several full-size float32 temporaries (codes, magnitudes, per-value
scales); a layer of ``flash-next``'s experts is 2.5 G values, so each reference call moves tens of GB. Here each
program reads a tile of codes and their scales once and writes the values in the output dtype.

Both kernels decode e4m3 bytes by arithmetic on their bits (sign, 4-bit exponent of bias 7, 3-bit mantissa;
subnormals, NaN at ``S.1111.111``), exactly as torch's float8 cast reads them, so no float8 type is needed in
the kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .quant import FP8_BLOCK, NVFP4_GROUP

# Rows and packed bytes (NVFP4) or values (FP8) a program handles.
BLOCK_ROWS = 8
NVFP4_BLOCK_BYTES = 128
FP8_BLOCK_COLS = 256


@triton.jit
def _e4m3(b):
    """float32 value of e4m3fn bytes ``b`` (int32 0-255)."""
    e = (b >> 3) & 15
    m = b & 7
    normal = (((b >> 7) << 31) | ((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    # m * 2^-9, signed by a product (a negation may compile to 0 - x, which loses the sign of zero)
    sub = m.to(tl.float32) * 0.001953125 * (1 - 2 * (b >> 7)).to(tl.float32)
    value = tl.where(e == 0, sub, normal)
    return tl.where((b & 127) == 127, float("nan"), value)


@triton.jit
def _e2m1(c):
    """float32 value of e2m1 codes ``c`` (int32 0-15)."""
    e = (c >> 1) & 3
    m = (c & 1).to(tl.float32)
    mag = tl.where(e == 0, m * 0.5, (m + 2.0) * ((1 << e).to(tl.float32) * 0.25))
    return mag * (1 - 2 * (c >> 3)).to(tl.float32)


@triton.jit
def _nvfp4_kernel(packed_ptr, scale_ptr, scale2_ptr, out_ptr, rows, nbytes,
                  BR: tl.constexpr, BB: tl.constexpr, GROUP: tl.constexpr):
    r = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    j = tl.program_id(1) * BB + tl.arange(0, BB)
    ok = (r < rows)[:, None] & (j < nbytes)[None, :]
    b = tl.load(packed_ptr + r[:, None] * nbytes + j[None, :], mask=ok, other=0).to(tl.int32)
    groups = nbytes * 2 // GROUP
    s = tl.load(scale_ptr + r[:, None] * groups + (j // (GROUP // 2))[None, :], mask=ok, other=0).to(tl.int32)
    s2 = tl.load(scale2_ptr + r, mask=r < rows, other=0.0)
    block = _e4m3(s) * s2[:, None]
    lo = _e2m1(b & 15) * block
    hi = _e2m1(b >> 4) * block
    values = tl.reshape(tl.join(lo, hi), (BR, 2 * BB))
    cols = tl.program_id(1) * (2 * BB) + tl.arange(0, 2 * BB)
    keep = (r < rows)[:, None] & (cols < nbytes * 2)[None, :]
    tl.store(out_ptr + r[:, None] * (nbytes * 2) + cols[None, :], values.to(out_ptr.dtype.element_ty), mask=keep)


@triton.jit
def _fp8_block_kernel(q_ptr, scale_ptr, block_rows_ptr, out_ptr, rows, per_expert, cols, scale_rows, scale_cols,
                      BR: tl.constexpr, BC: tl.constexpr, BLOCK: tl.constexpr):
    n = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    live = n < rows
    ok = live[:, None] & (c < cols)[None, :]
    expert, row = n // per_expert, n % per_expert
    block_row = tl.load(block_rows_ptr + row, mask=live, other=0).to(tl.int64)
    at = (expert * scale_rows + block_row) * scale_cols
    scale = tl.load(scale_ptr + at[:, None] + (c // BLOCK)[None, :], mask=ok, other=0.0).to(tl.float32)
    b = tl.load(q_ptr + n[:, None] * cols + c[None, :], mask=ok, other=0).to(tl.int32)
    tl.store(out_ptr + n[:, None] * cols + c[None, :], (_e4m3(b) * scale).to(out_ptr.dtype.element_ty), mask=ok)


def dequantize_nvfp4_triton(packed: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor,
                            dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """:func:`~tidal.kernels.quant.dequantize_nvfp4` in one launch: ``packed`` uint8 ``[..., R, C/2]``, ``scale``
    e4m3 ``[..., R, C/16]``, ``scale_2`` a scalar or one per row ``[..., R, 1]``."""
    *lead, nbytes = packed.shape
    out = torch.empty((*lead, 2 * nbytes), dtype=dtype, device=packed.device)
    rows = out.numel() // max(1, 2 * nbytes)
    if not rows or not nbytes:
        return out
    s2 = scale_2.to(torch.float32)
    s2 = (s2.expand(*lead, 1) if s2.dim() else s2.reshape(1).expand(rows)).reshape(rows).contiguous()
    grid = (triton.cdiv(rows, BLOCK_ROWS), triton.cdiv(nbytes, NVFP4_BLOCK_BYTES))
    _nvfp4_kernel[grid](packed.contiguous(), scale.contiguous().view(torch.uint8), s2, out, rows, nbytes,
                        BR=BLOCK_ROWS, BB=NVFP4_BLOCK_BYTES, GROUP=NVFP4_GROUP)
    return out


def dequantize_fp8_block_triton(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32,
                                block_rows: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`~tidal.kernels.quant.dequantize_fp8_block` in one launch: ``q`` float8_e4m3fn ``[..., R, C]``,
    ``scale`` ``[..., RB, CB]`` (fp32 or bf16), ``block_rows`` ``[R]`` (default ``r // 128``)."""
    *lead, per_expert, cols = q.shape
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    rows = out.numel() // max(1, cols)
    if not rows or not cols:
        return out
    if block_rows is None:
        block_rows = torch.arange(per_expert, device=q.device) // FP8_BLOCK
    grid = (triton.cdiv(rows, BLOCK_ROWS), triton.cdiv(cols, FP8_BLOCK_COLS))
    _fp8_block_kernel[grid](q.contiguous().view(torch.uint8), scale.contiguous(),
                            block_rows.to(q.device, torch.int32).contiguous(), out, rows, per_expert, cols,
                            scale.shape[-2], scale.shape[-1], BR=BLOCK_ROWS, BC=FP8_BLOCK_COLS, BLOCK=FP8_BLOCK)
    return out
