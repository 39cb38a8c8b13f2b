"""Triton RMSNorm kernels: the same numbers as ``norm.rms_norm_ref`` / ``norm.gated_rms_norm_ref``.

Each program normalises a tile of ``BLOCK_R`` rows (groups, for the grouped norm) of one ``BLOCK_N``
block each: narrow rows (a 128-wide head) share a program so it still moves a few KB, wide rows
(hc 4 x hidden 2048 = 8192) take one program per group. Statistics are fp32 and the output is in
x's dtype; intermediate roundings of the references are reproduced so bf16 results match them to
the last bit but for the odd ``rsqrt``/``sigmoid`` ulp.

Imported only when a CUDA tensor asks (``backend.use_triton``) or by the interpreter tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .common import MAX_WIDTH
from .pdl_triton import pdl_enter


def _tile(width: int, rows: int) -> tuple[int, int, int]:
    """``(BLOCK_R, BLOCK_N, num_warps)``: about 4K elements a program, more warps for wide rows."""
    block_n = triton.next_power_of_2(width)
    block_r = max(1, min(64, 4096 // block_n, triton.next_power_of_2(max(rows, 1))))
    num_warps = min(16, max(4, block_r * block_n // 1024))
    return block_r, block_n, num_warps


def _rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t`` as ``[rows, width]`` with unit feature stride (a view when it can be one)."""
    t2 = t.reshape(-1, width)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, n_rows, groups, group, stride_x, stride_o, eps,
                     BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    # "Rows" here are groups: group-row r is features [(r % groups) * group, +group) of row r // groups.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_N)
    row = rows // groups
    feat = ((rows % groups) * group)[:, None] + cols[None, :]
    mask = (rows < n_rows)[:, None] & (cols < group)[None, :]
    x = tl.load(x_ptr + row[:, None] * stride_x + feat, mask=mask, other=0.0).to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, axis=1) / group + eps)
    w = tl.load(w_ptr + feat, mask=mask, other=0.0).to(tl.float32)
    y = x * inv[:, None] * (1.0 + w)
    tl.store(out_ptr + row[:, None] * stride_o + feat, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gated_rms_norm_kernel(x_ptr, g_ptr, w_ptr, out_ptr, n_rows, heads, width, sx_t, sx_h, sg_t, sg_h, stride_o,
                           eps, SILU: tl.constexpr, ROUND_MID: tl.constexpr, BLOCK_R: tl.constexpr,
                           BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    # Row r is head r % heads of token r // heads, addressed through each input's own strides.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    t, h_idx = rows // heads, rows % heads
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < width
    mask = (rows < n_rows)[:, None] & cmask[None, :]
    dt = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + (t * sx_t + h_idx * sx_h)[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + (t * sg_t + h_idx * sg_h)[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    out = gated_norm_rows(x, g, w, width, eps, dt, SILU, ROUND_MID)
    tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], out.to(dt), mask=mask)


@triton.jit
def gated_norm_rows(x, g, w, width, eps, dt: tl.constexpr, SILU: tl.constexpr, ROUND_MID: tl.constexpr):
    """``weight * x / rms(x) * act(g)`` of each row of fp32 ``[R, N]`` tiles (masked columns zero in ``x``),
    in fp32 with the reference's roundings to ``dt`` on the way; the caller rounds the result."""
    inv = tl.rsqrt(tl.sum(x * x, axis=1) / width + eps)
    h = (x * inv[:, None]).to(dt).to(tl.float32)  # the reference rounds h to x's dtype here
    h = h * w[None, :]
    if ROUND_MID:  # weight and x share a sub-fp32 dtype: the reference's product is rounded too
        h = h.to(dt).to(tl.float32)
    if SILU:
        a = g * tl.sigmoid(g)
    else:
        a = tl.sigmoid(g)
    return h * a


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int | None = None) -> torch.Tensor:
    """:func:`~tidal.kernels.norm.rms_norm_ref` in one pass: ``x / rms(x) * (1 + weight)`` per group."""
    width = x.shape[-1]
    group = width if group_size is None else group_size
    if group <= 0 or width % group:
        raise ValueError(f"group_size {group_size} does not divide the width {width}")
    if group > MAX_WIDTH:
        raise ValueError(f"rms_norm_triton takes groups of at most {MAX_WIDTH} features, got {group}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    x2 = _rows(x, width)
    n = x2.shape[0] * (width // group)
    if n == 0:
        return out
    block_r, block_n, num_warps = _tile(group, n)
    _rms_norm_kernel[(triton.cdiv(n, block_r),)](
        x2, weight.contiguous(), out, n, width // group, group, x2.stride(0), width, float(eps),
        BLOCK_R=block_r, BLOCK_N=block_n, num_warps=num_warps, **pdl.launch_args(x2))
    return out


def _heads(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[tokens, heads, width]`` with unit feature stride (a view when it can be one; a 2-D
    ``t`` is one head a token)."""
    t3 = t.reshape(-1, t.shape[-2] if t.dim() > 2 else 1, t.shape[-1])
    return t3 if t3.stride(-1) == 1 else t3.contiguous()


def gated_rms_norm_triton(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                          activation: str = "silu") -> torch.Tensor:
    """:func:`~tidal.kernels.norm.gated_rms_norm_ref` in one pass: ``weight * x / rms(x) * act(gate)``.

    ``x`` and ``gate`` may be strided views (e.g. ``[T, heads, d]`` column slices of a wider GEMM
    output): each is read through its own token and head strides. The output is contiguous.
    """
    width = x.shape[-1]
    if width > MAX_WIDTH or gate.shape != x.shape:
        raise ValueError(f"gated_rms_norm_triton takes rows of at most {MAX_WIDTH} features and a gate of x's "
                         f"shape, got {tuple(x.shape)} and {tuple(gate.shape)}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    x3, g3 = _heads(x), _heads(gate)
    n = x3.shape[0] * x3.shape[1]
    if n == 0:
        return out
    round_mid = x.dtype != torch.float32 and torch.promote_types(weight.dtype, x.dtype) == x.dtype
    block_r, block_n, num_warps = _tile(width, n)
    _gated_rms_norm_kernel[(triton.cdiv(n, block_r),)](
        x3, g3, weight.contiguous(), out, n, x3.shape[1], width, x3.stride(0), x3.stride(1), g3.stride(0),
        g3.stride(1), width, float(eps), SILU=activation == "silu", ROUND_MID=round_mid, BLOCK_R=block_r,
        BLOCK_N=block_n, num_warps=num_warps, **pdl.launch_args(x3))
    return out


@triton.jit
def norm_rotary(x, xp, w, wp, c, s, d, dim, rot, eps, dt: tl.constexpr):
    """Heads ``x [H, D]`` (fp32) RMS-normalised with weight ``w [D]`` (scale ``1 + w``), then rotated over the
    first ``rot`` features by ``c, s [D]``; ``xp``, ``wp`` are ``x`` and ``w`` at each feature's rotate_half
    partner. The references' roundings to ``dt``: the norm's output, then each product and the sum. fp32
    values (exact in ``dt``) for the caller to store."""
    half = rot // 2
    inv = tl.rsqrt(tl.sum(x * x, axis=1) / dim + eps)[:, None]
    y = (x * inv * (1.0 + w[None, :])).to(dt).to(tl.float32)
    yp = (xp * inv * (1.0 + wp[None, :])).to(dt).to(tl.float32)
    yp = tl.where((d < half)[None, :], -yp, yp)
    rotated = ((y * c[None, :]).to(dt).to(tl.float32) + (yp * s[None, :]).to(dt).to(tl.float32))
    return tl.where((d < rot)[None, :], rotated, y)


@triton.jit
def norm_rotary_heads(x_ptr, sx_h, w_ptr, cos_ptr, sin_ptr, heads, dim, rot, eps, dt: tl.constexpr,
                      BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """:func:`norm_rotary` of the ``heads`` heads of one token at ``x_ptr`` (head stride ``sx_h``, unit feature
    stride), with that token's ``cos``/``sin`` rows: ``[BLOCK_H, BLOCK_D]``."""
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    dmask = d < dim
    mask = (h < heads)[:, None] & dmask[None, :]
    half = rot // 2
    # Rotated features pair j with j +- half (rotate_half); the rest pass through.
    in_rot = d < rot
    partner = tl.where(d < half, d + half, d - half)
    base = x_ptr + h[:, None] * sx_h
    x = tl.load(base + d[None, :], mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(base + partner[None, :], mask=mask & in_rot[None, :], other=0.0).to(tl.float32)
    w = tl.load(w_ptr + d, mask=dmask, other=0.0).to(tl.float32)
    wp = tl.load(w_ptr + partner, mask=dmask & in_rot, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + d, mask=in_rot, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + d, mask=in_rot, other=0.0).to(tl.float32)
    return norm_rotary(x, xp, w, wp, c, s, d, dim, rot, eps, dt)


@triton.jit
def _rms_norm_rotary_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, n_rows, heads, dim, rot, eps,
                            sx_t, sx_h, sc_t, so_t, so_h,
                            BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    dt = out_ptr.dtype.element_ty
    out = norm_rotary_heads(x_ptr + t * sx_t, sx_h, w_ptr, cos_ptr + t * sc_t, sin_ptr + t * sc_t, heads, dim, rot,
                            eps, dt, BLOCK_H, BLOCK_D)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h < heads)[:, None] & (d < dim)[None, :]
    tl.store(out_ptr + t * so_t + h[:, None] * so_h + d[None, :], out.to(dt), mask=mask)


def rms_norm_rotary_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                           sin: torch.Tensor) -> torch.Tensor:
    """``Rotary.apply(rms_norm_ref(x, weight, eps), cos, sin)`` in one pass: a per-head RMS norm of
    ``x [T, heads, d]`` (unit stride along d), then rotary over its first ``cos.shape[-1]`` features
    with per-row ``cos, sin [T, rotary_dim]``. Contiguous output in x's dtype."""
    tokens, heads, dim = x.shape
    rot = cos.shape[-1]
    assert x.stride(2) == 1 and rot % 2 == 0 and rot <= dim and cos.stride(1) == 1 and sin.stride() == cos.stride()
    out = torch.empty(tokens, heads, dim, dtype=x.dtype, device=x.device)
    if tokens:
        block_h, block_d = triton.next_power_of_2(heads), triton.next_power_of_2(dim)
        _rms_norm_rotary_kernel[(tokens,)](
            x, weight.contiguous(), cos, sin, out, tokens, heads, dim, rot, float(eps),
            x.stride(0), x.stride(1), cos.stride(0), out.stride(0), out.stride(1),
            BLOCK_H=block_h, BLOCK_D=block_d, num_warps=min(16, max(1, block_h * block_d // 512)),
            **pdl.launch_args(x))
    return out
