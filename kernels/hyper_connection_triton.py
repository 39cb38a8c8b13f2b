"""Triton kernels for the hyper-connection element-wise stages (``hyper_connection`` holds the reference).

The streams tensor ``H [T, hc * hidden]`` dominates the memory traffic (512 MB in bf16 at 32K tokens
for hc 4 x hidden 2048, ~0.15 ms a pass on an H200), so each kernel makes exactly one pass:

* ``_hc_residual_norm_kernel``: one program per (row, stream). It reads the stream's slice of
  ``H``, the row's ``block_out`` (shared by the ``hc`` neighbouring programs through L2) and one
  inject logit, and writes the new slice and its RMS-normalised copy: residual + sigmoid gate +
  grouped norm, which the torch reference spends ~8 passes on. The norm groups are the streams, so
  a stream slice holds all its group's statistics.
* ``_hc_block_input_kernel``: one program per (row, block of hidden features); it walks the ``hc``
  streams of ``normed`` and ``up_out`` and writes the gated mean, never materialising
  ``sigmoid(up_out)`` or the product.

The GEMMs in between stay cuBLAS, except for a decode step's few rows: there ``_hc_norm_down_kernel``
does the residual, the norm and the ``[down; inject]`` projection in one launch (each program streams
its weight rows and normalises the few rows itself, program 0 storing the new streams and their
normalised copy), and ``_hc_mix_tail_kernel`` the gate activation, the ``up`` projection and the gated
mean in one (one program per block of block-input features, reading their ``up`` rows of every stream
once); both launched with PDL (``kernels/pdl``), their weights loading before the wait. Every rounding of the
reference's torch ops (to the tensors' dtype) is copied so that bf16 agrees with it to about an ulp.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .common import MAX_K, MAX_ROWS, MAX_WIDTH
from .pdl_triton import pdl_launch_next, pdl_wait


def _rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t`` as ``[rows, width]`` with unit feature stride (a view when it can be one)."""
    t2 = t.reshape(-1, width)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _num_warps(block: int) -> int:
    return min(16, max(4, block // 256))


@triton.jit
def stream_slice(hidden, HC: tl.constexpr, BLOCK: tl.constexpr):
    """``(row, stream, cols, mask, feat)`` of a program over one (row, stream) slice of ``[T, HC * hidden]``:
    the slice's columns within the stream, their mask, and their features in the row."""
    pid = tl.program_id(0).to(tl.int64)
    s = pid % HC
    cols = tl.arange(0, BLOCK)
    return pid // HC, s, cols, cols < hidden, s * hidden + cols


@triton.jit
def _hc_residual_norm_kernel(h_ptr, b_ptr, l_ptr, w_ptr, new_ptr, normed_ptr, hidden,
                             stride_h, stride_b, stride_l, stride_new, stride_normed, eps,
                             HC: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_launch_next(PDL)
    row, s, cols, mask, feat = stream_slice(hidden, HC, BLOCK)
    w = tl.load(w_ptr + feat, mask=mask, other=0.0).to(tl.float32)
    pdl_wait(PDL)  # the norm weight is loading; the rest is the previous kernels' output
    dt = new_ptr.dtype.element_ty
    # inject = 2 * sigmoid(logit / hc), rounded after the division and the sigmoid like the reference.
    logit = tl.load(l_ptr + row * stride_l + s).to(tl.float32)
    inject = 2.0 * tl.sigmoid((logit / HC).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    b = tl.load(b_ptr + row * stride_b + cols, mask=mask, other=0.0).to(tl.float32)
    h = tl.load(h_ptr + row * stride_h + feat, mask=mask, other=0.0).to(tl.float32)
    new = (h + (b * inject).to(dt).to(tl.float32)).to(dt)
    tl.store(new_ptr + row * stride_new + feat, new, mask=mask)
    x = new.to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, axis=0) / hidden + eps)
    tl.store(normed_ptr + row * stride_normed + feat, (x * inv * (1.0 + w)).to(dt), mask=mask)


@triton.jit
def _hc_norm_down_kernel(h_ptr, b_ptr, l_ptr, nw_ptr, wd_ptr, new_ptr, normed_ptr, y_ptr, hidden, n_out,
                         stride_h, stride_b, stride_l, stride_wd, stride_y, eps,
                         ROWS: tl.constexpr, BLOCK_M: tl.constexpr, HC: tl.constexpr, HC_PAD: tl.constexpr,
                         BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, RESIDUAL: tl.constexpr, PDL: tl.constexpr):
    """``BLOCK_N`` outputs of the ``[down; inject]`` projection for every row, each program normalising the
    rows' streams itself (the injected residual first with ``RESIDUAL``); program 0 also stores the new
    streams and their normalised copy."""
    pdl_launch_next(PDL)
    # The row's HC_PAD * BLOCK_H features, stream-major: i = s * BLOCK_H + c is feature s * hidden + c.
    i = tl.arange(0, HC_PAD * BLOCK_H)
    s = i // BLOCK_H
    c = i % BLOCK_H
    feat = s * hidden + c
    fmask = (s < HC) & (c < hidden)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < n_out
    w = tl.load(wd_ptr + n.to(tl.int64)[:, None] * stride_wd + feat[None, :],
                mask=nmask[:, None] & fmask[None, :], other=0.0).to(tl.float32)
    one_w = 1.0 + tl.load(nw_ptr + feat, mask=fmask, other=0.0).to(tl.float32)
    pdl_wait(PDL)  # the weights are loading; the rest is the previous kernels' output
    first = tl.program_id(0) == 0
    dt = y_ptr.dtype.element_ty
    width = HC * hidden
    rows = tl.arange(0, BLOCK_M)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for m in tl.static_range(ROWS):
        x = tl.load(h_ptr + m * stride_h + feat, mask=fmask, other=0.0).to(tl.float32)
        if RESIDUAL:
            # inject = 2 * sigmoid(logit / hc), rounded after the division and the sigmoid like the reference.
            logit = tl.load(l_ptr + m * stride_l + s, mask=s < HC, other=0.0).to(tl.float32)
            inject = 2.0 * tl.sigmoid((logit / HC).to(dt).to(tl.float32)).to(dt).to(tl.float32)
            bo = tl.load(b_ptr + m * stride_b + c, mask=fmask, other=0.0).to(tl.float32)
            x = (x + (bo * inject).to(dt).to(tl.float32)).to(dt).to(tl.float32)
            tl.store(new_ptr + m * width + feat, x.to(dt), mask=fmask & first)
        sq = tl.sum(tl.reshape(x * x, [HC_PAD, BLOCK_H]), axis=1)
        inv = tl.reshape(tl.broadcast_to(tl.rsqrt(sq / hidden + eps)[:, None], [HC_PAD, BLOCK_H]), [HC_PAD * BLOCK_H])
        normed = (x * inv * one_w).to(dt)
        tl.store(normed_ptr + m * width + feat, normed, mask=fmask & first)
        acc = tl.where(rows[:, None] == m, tl.sum(w * normed.to(tl.float32)[None, :], axis=1)[None, :], acc)
    tl.store(y_ptr + rows[:, None] * stride_y + n[None, :], acc.to(dt), mask=(rows < ROWS)[:, None] & nmask[None, :])


# (block_n, num_warps) of hc_norm_down_triton. Alone at the bench shapes (hc 4 x 2048, 324 output rows;
# benchmarks/bench_decode_kernels.py --parts hc) 4 weight rows a program were faster at
# 1 / 2 / 4 rows (3.08 / 4.87 / 8.03 us, against 3.52 / 7.91 / 14.78 with 2), but inside the decode graph,
# its weights loading while the kernel before it runs, 2 rows gave the faster step: batch 1's graph 0.870 ms
# against 0.883 ms with 4.
NORM_DOWN_CONFIG = (2, 8)
# The same for streams wider than 2,048 features (flash-next's 2,560, padded to 4,096): 4 weight rows and 8
# warps took 4.79 us alone at one row (bench_decode_kernels.py --hc-hidden 2560), the fastest measured.
NORM_DOWN_CONFIG_WIDE = (4, 8)
# (block_h, num_warps) of hc_mix_tail_triton, for streams of at most 2,048 features and for wider ones (8
# features and 4 warps: 3.96 us alone at 2,560 features, one row).
MIX_TAIL_CONFIG, MIX_TAIL_CONFIG_WIDE = (1, 1), (8, 4)


def hc_norm_down_triton(streams: torch.Tensor, pending: tuple[torch.Tensor, torch.Tensor] | None, hc: int,
                        norm_weight: torch.Tensor, eps: float, weight: torch.Tensor, block_n: int | None = None,
                        num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(new_streams, normed, normed @ weight.T)`` for the few rows of a decode step, one launch: the injected
    residual ``pending = (block_out, inject_logits)`` (:func:`hc_residual_norm_triton`; ``None``: the streams as
    they are, returned themselves), the grouped RMS norm, and the ``[down; inject]`` projection ``weight
    [N, hc * hidden]``. Every program normalises the rows itself (they are a few KB, read from L2) rather than
    waiting for a norm kernel; a program reads ``block_n`` weight rows (``block_n`` and ``num_warps`` override
    :data:`NORM_DOWN_CONFIG`, or :data:`NORM_DOWN_CONFIG_WIDE` past 2,048 features a stream).
    """
    rows, width = streams.shape
    hidden = width // hc
    default = NORM_DOWN_CONFIG if hidden <= 2048 else NORM_DOWN_CONFIG_WIDE
    block_n, num_warps = block_n or default[0], num_warps or default[1]
    if hidden * hc != width or weight.shape[1] != width or norm_weight.numel() != width:
        raise ValueError(f"streams {tuple(streams.shape)}, norm weight {tuple(norm_weight.shape)} and weight "
                         f"{tuple(weight.shape)} do not fit hc={hc}")
    if rows > MAX_ROWS or hidden > MAX_WIDTH:
        raise ValueError(f"hc_norm_down_triton takes at most {MAX_ROWS} rows and {MAX_WIDTH} features a stream, "
                         f"got {rows} x {hidden}")
    h2 = _rows(streams, width)
    if pending is None:
        new, b2, l2 = streams, h2, h2
    else:
        b2, l2 = _rows(pending[0], hidden), _rows(pending[1], hc)
        if not b2.dtype == l2.dtype == streams.dtype:
            raise ValueError("streams, block_out and inject_logits must share a dtype")
        new = torch.empty(rows, width, dtype=streams.dtype, device=streams.device)
    normed = torch.empty(rows, width, dtype=streams.dtype, device=streams.device)
    n_out = weight.shape[0]
    y = torch.empty(rows, n_out, dtype=streams.dtype, device=streams.device)
    if rows == 0:
        return new, normed, y
    w2 = weight if weight.stride(1) == 1 else weight.contiguous()
    _hc_norm_down_kernel[(triton.cdiv(n_out, block_n),)](
        h2, b2, l2, norm_weight.contiguous(), w2, new, normed, y, hidden, n_out,
        h2.stride(0), b2.stride(0), l2.stride(0), w2.stride(0), y.stride(0), float(eps),
        ROWS=rows, BLOCK_M=triton.next_power_of_2(rows), HC=hc, HC_PAD=triton.next_power_of_2(hc),
        BLOCK_H=triton.next_power_of_2(hidden), BLOCK_N=block_n, RESIDUAL=pending is not None, num_warps=num_warps,
        **pdl.launch_args(streams))
    return new, normed, y


@triton.jit
def _hc_block_input_kernel(n_ptr, u_ptr, out_ptr, hidden, stride_n, stride_u, stride_o,
                           HC: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    dt = out_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(HC):
        n = tl.load(n_ptr + row * stride_n + s * hidden + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + row * stride_u + s * hidden + cols, mask=mask, other=0.0).to(tl.float32)
        gate = tl.sigmoid(u).to(dt).to(tl.float32)
        acc += (gate * n).to(dt).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (acc / HC).to(dt), mask=mask)


def hc_residual_norm_triton(streams: torch.Tensor, block_out: torch.Tensor, inject_logits: torch.Tensor, hc: int,
                            norm_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused :func:`~tidal.kernels.hyper_connection.hc_residual_norm_ref`; all three inputs share a dtype.

    ``inject_logits`` may be a column slice of a wider GEMM output (any row stride).
    """
    width = streams.shape[-1]
    hidden = width // hc
    if hidden * hc != width or block_out.shape[-1] != hidden or inject_logits.shape[-1] != hc:
        raise ValueError(f"streams {tuple(streams.shape)}, block_out {tuple(block_out.shape)} and "
                         f"inject_logits {tuple(inject_logits.shape)} do not fit hc={hc}")
    if not block_out.dtype == inject_logits.dtype == streams.dtype:
        raise ValueError("streams, block_out and inject_logits must share a dtype")
    if hidden > MAX_WIDTH:
        raise ValueError(f"hc_residual_norm_triton takes at most {MAX_WIDTH} features a stream, got {hidden}")
    new = torch.empty(streams.shape, dtype=streams.dtype, device=streams.device)
    normed = torch.empty_like(new)
    h2, b2, l2 = _rows(streams, width), _rows(block_out, hidden), _rows(inject_logits, hc)
    rows = h2.shape[0]
    if rows == 0:
        return new, normed
    block = triton.next_power_of_2(hidden)
    _hc_residual_norm_kernel[(rows * hc,)](
        h2, b2, l2, norm_weight.contiguous(), new, normed, hidden,
        h2.stride(0), b2.stride(0), l2.stride(0), width, width, float(eps),
        HC=hc, BLOCK=block, num_warps=_num_warps(block), **pdl.launch_args(streams))
    return new, normed


def hc_block_input_triton(normed: torch.Tensor, up_out: torch.Tensor, hc: int) -> torch.Tensor:
    """Fused :func:`~tidal.kernels.hyper_connection.hc_block_input_ref`; both inputs share a dtype."""
    width = normed.shape[-1]
    hidden = width // hc
    if hidden * hc != width or up_out.shape != normed.shape:
        raise ValueError(f"normed {tuple(normed.shape)} and up_out {tuple(up_out.shape)} do not fit hc={hc}")
    if up_out.dtype != normed.dtype:
        raise ValueError("normed and up_out must share a dtype")
    out = torch.empty((*normed.shape[:-1], hidden), dtype=normed.dtype, device=normed.device)
    n2, u2 = _rows(normed, width), _rows(up_out, width)
    rows = n2.shape[0]
    if rows == 0:
        return out
    block = min(1024, triton.next_power_of_2(hidden))
    _hc_block_input_kernel[(rows, triton.cdiv(hidden, block))](
        n2, u2, out, hidden, n2.stride(0), u2.stride(0), hidden,
        HC=hc, BLOCK=block, num_warps=_num_warps(block))
    return out


@triton.jit
def _hc_gate_act_kernel(x_ptr, out_ptr, rows, width, stride_x, stride_o, hc,
                        BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.arange(0, BLOCK_C)
    m = (r < rows)[:, None] & (c < width)[None, :]
    r64 = r.to(tl.int64)[:, None]
    dt = out_ptr.dtype.element_ty
    x = (tl.load(x_ptr + r64 * stride_x + c[None, :], mask=m, other=0.0).to(tl.float32) / hc).to(dt).to(tl.float32)
    tl.store(out_ptr + r64 * stride_o + c[None, :], (x / (1.0 + tl.exp(-x))).to(dt), mask=m)


def hc_gate_act_triton(down_out: torch.Tensor, hc: int) -> torch.Tensor:
    """:func:`~tidal.kernels.hyper_connection.hc_gate_act_ref` in one pass over ``[T, lowrank]`` (any row
    stride, unit column stride), with the reference's rounding after the division."""
    rows, width = down_out.shape
    x = down_out if down_out.stride(1) == 1 else down_out.contiguous()
    out = torch.empty(rows, width, dtype=x.dtype, device=x.device)
    if rows:
        block_c = triton.next_power_of_2(width)
        block_r = max(1, min(64, 4096 // block_c))
        _hc_gate_act_kernel[(triton.cdiv(rows, block_r),)](x, out, rows, width, x.stride(0), out.stride(0), float(hc),
                                                          BLOCK_R=block_r, BLOCK_C=block_c, num_warps=4)
    return out


@triton.jit
def _hc_mix_tail_kernel(d_ptr, w_ptr, n_ptr, out_ptr, hidden, lowrank, stride_d, stride_w, stride_n, stride_o,
                        ROWS: tl.constexpr, BLOCK_M: tl.constexpr, HC: tl.constexpr, HC_PAD: tl.constexpr,
                        BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, PDL: tl.constexpr):
    """``BLOCK_H`` block-input features of every row: the gate activation of the row's ``down`` output,
    the ``up`` projection's ``HC`` weight rows of those features (one per stream), and the gated mean."""
    pdl_launch_next(PDL)
    # The HC_PAD * BLOCK_H weight rows of this program's features, stream-major: i = s * BLOCK_H + j.
    i = tl.arange(0, HC_PAD * BLOCK_H)
    s = i // BLOCK_H
    h = tl.program_id(0) * BLOCK_H + i % BLOCK_H
    feat = s * hidden + h
    fmask = (s < HC) & (h < hidden)
    r = tl.arange(0, BLOCK_R)
    rmask = r < lowrank
    w = tl.load(w_ptr + feat.to(tl.int64)[:, None] * stride_w + r[None, :],
                mask=fmask[:, None] & rmask[None, :], other=0.0).to(tl.float32)
    pdl_wait(PDL)  # the weights are loading; the rest is the previous kernels' output
    hh = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    streams = tl.arange(0, HC_PAD)
    rows = tl.arange(0, BLOCK_M)
    dt = out_ptr.dtype.element_ty
    # One store at the end, for every row: a store between the rows would hold the next row's loads
    # behind it (the compiler must assume the output may alias the inputs).
    res = tl.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32)
    for m in tl.static_range(ROWS):
        # silu(down / hc), rounded after the division and the activation like the reference.
        a = (tl.load(d_ptr + m * stride_d + r, mask=rmask, other=0.0).to(tl.float32) / HC).to(dt).to(tl.float32)
        a = (a / (1.0 + tl.exp(-a))).to(dt).to(tl.float32)
        up = tl.sum(w * a[None, :], axis=1).to(dt).to(tl.float32)
        gate = tl.sigmoid(up).to(dt).to(tl.float32)
        n = tl.load(n_ptr + m * stride_n + feat, mask=fmask, other=0.0).to(tl.float32)
        prod = tl.reshape((gate * n).to(dt).to(tl.float32), [HC_PAD, BLOCK_H])
        # The streams' products summed in stream order, as the reference adds them.
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for st in tl.static_range(HC):
            acc += tl.sum(tl.where(streams[:, None] == st, prod, 0.0), axis=0)
        res = tl.where(rows[:, None] == m, (acc / HC)[None, :], res)
    tl.store(out_ptr + rows[:, None] * stride_o + hh[None, :], res.to(dt),
             mask=(rows < ROWS)[:, None] & (hh < hidden)[None, :])


def hc_mix_tail_triton(down_out: torch.Tensor, up_weight: torch.Tensor, normed: torch.Tensor, hc: int,
                       block_h: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """``hc_block_input(normed, F.linear(hc_gate_act(down_out, hc), up_weight), hc)`` in one launch, for the
    few rows of a decode step (at most :data:`tidal.kernels.common.MAX_ROWS`).

    ``down_out [M, lowrank]`` (any row stride, unit column stride: a column slice of the ``[down; inject]``
    GEMV's output), ``up_weight [hc * hidden, lowrank]``, ``normed [M, hc * hidden]``, one dtype. A
    program takes ``block_h`` features of the block input: it reads their ``hc`` rows of ``up_weight`` once,
    for all rows; the up projection's output never leaves registers. ``block_h`` and ``num_warps`` override
    :data:`MIX_TAIL_CONFIG`, or :data:`MIX_TAIL_CONFIG_WIDE` past 2,048 features a stream.
    """
    rows, width = normed.shape
    hidden = width // hc
    default = MIX_TAIL_CONFIG if hidden <= 2048 else MIX_TAIL_CONFIG_WIDE
    block_h, num_warps = block_h or default[0], num_warps or default[1]
    lowrank = down_out.shape[1]
    if hidden * hc != width or down_out.shape[0] != rows or up_weight.shape != (width, lowrank):
        raise ValueError(f"down_out {tuple(down_out.shape)}, up_weight {tuple(up_weight.shape)} and normed "
                         f"{tuple(normed.shape)} do not fit hc={hc}")
    if not down_out.dtype == up_weight.dtype == normed.dtype:
        raise ValueError("down_out, up_weight and normed must share a dtype")
    if rows > MAX_ROWS or lowrank > MAX_K:
        raise ValueError(f"hc_mix_tail_triton takes at most {MAX_ROWS} rows and a low rank of {MAX_K}, "
                         f"got {rows} x {lowrank}")
    out = torch.empty(rows, hidden, dtype=normed.dtype, device=normed.device)
    if rows == 0:
        return out
    d2, w2, n2 = _rows(down_out, lowrank), _rows(up_weight, lowrank), _rows(normed, width)
    _hc_mix_tail_kernel[(triton.cdiv(hidden, block_h),)](
        d2, w2, n2, out, hidden, lowrank, d2.stride(0), w2.stride(0), n2.stride(0), out.stride(0),
        ROWS=rows, BLOCK_M=triton.next_power_of_2(rows), HC=hc, HC_PAD=triton.next_power_of_2(hc), BLOCK_H=block_h,
        BLOCK_R=triton.next_power_of_2(max(lowrank, 1)), num_warps=num_warps,
        **pdl.launch_args(normed))
    return out
