"""Triton kernels of the varlen depthwise causal conv1d over state-slot windows (see ``conv``).

Imported only for CUDA tensors (and on the CPU by the tests, under ``TRITON_INTERPRET=1``).

Prefill (:func:`causal_conv1d_varlen`): a 2-D grid of programs, each owning a ``[BLOCK_T, BLOCK_C]``
tile of output rows x channels. A row finds its segment through ``row_segment`` (precomputed with
``torch.searchsorted`` on the device, or passed in by the caller), hence its local offset and slot.
Each of the ``k`` taps is one coalesced tile load, from ``x`` where the tap falls inside the segment
and from the slot's window where it falls before the segment's start (a masked pair of loads, so
every element is read from exactly one place). The taps of one tile overlap by all but
``dilation`` rows, so after the first they are served from L1/L2: DRAM traffic is about one read of
``x`` plus one write of the output, and accumulation is fp32. With ``l2_group`` the epilogue also
L2-normalises each group of channels (GDN's q and k heads), which lie whole in one tile.

Decode (:func:`causal_conv1d_update`): a program per (request, block of channels) walks the
``W + 1`` rows of window-plus-new-row once, accumulating the taps and writing each row back one
position earlier, which shifts the window in place. Every element of a slot's window is loaded
and stored by the same thread, in that order, so the in-place shift needs no barrier.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .common import L2_NORM_EPS, check_l2_group, l2_norm_groups, row_segments
from .pdl_triton import pdl_enter


@triton.jit
def _conv_varlen_kernel(
    x_ptr, states_ptr, w_ptr, out_ptr, cu_ptr, slots_ptr, fresh_ptr, seg_ptr,
    num_rows, channels,
    sx_t, sx_c, ss_n, ss_w, ss_c, sw_c, sw_k, so_t, so_c,
    K: tl.constexpr, D: tl.constexpr, SILU: tl.constexpr, L2_GROUP: tl.constexpr, L2_EPS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    rmask = rows < num_rows
    cmask = cols < channels
    seg = tl.load(seg_ptr + rows, mask=rmask, other=0)
    local = rows - tl.load(cu_ptr + seg, mask=rmask, other=0)
    slot = tl.load(slots_ptr + seg, mask=rmask, other=0).to(tl.int64)
    keep_old = rmask & (tl.load(fresh_ptr + seg, mask=rmask, other=1) == 0)
    rows64 = rows.to(tl.int64)
    cols64 = cols.to(tl.int64)
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(K):
        back = (K - 1 - j) * D  # how many rows before the output row this tap reads
        w = tl.load(w_ptr + cols64 * sw_c + j * sw_k, mask=cmask, other=0.0).to(tl.float32)
        in_seg = rmask & (local >= back)
        x_ptrs = x_ptr + (rows64 - back)[:, None] * sx_t + cols64[None, :] * sx_c
        tap = tl.load(x_ptrs, mask=in_seg[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        if back > 0:
            # Before the segment's start: row (W - back + local) of the slot's old window.
            old_row = ((K - 1) * D - back + local).to(tl.int64)
            s_ptrs = states_ptr + (slot * ss_n + old_row * ss_w)[:, None] + cols64[None, :] * ss_c
            old_mask = (keep_old & (local < back))[:, None] & cmask[None, :]
            tap += tl.load(s_ptrs, mask=old_mask, other=0.0).to(tl.float32)
        acc += tap * w[None, :]
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    out = acc.to(out_ptr.dtype.element_ty)
    if L2_GROUP > 0:
        # Whole groups per tile (BLOCK_C is a multiple of L2_GROUP, C too): normalise the rounded conv
        # output in fp32 as l2_norm does. Padding columns are zeros and form groups of their own.
        grouped = tl.reshape(out.to(tl.float32), [BLOCK_T, BLOCK_C // L2_GROUP, L2_GROUP])
        scale = tl.rsqrt(tl.sum(grouped * grouped, axis=2) + L2_EPS)
        out = tl.reshape(grouped * scale[:, :, None], [BLOCK_T, BLOCK_C]).to(out_ptr.dtype.element_ty)
    out_ptrs = out_ptr + rows64[:, None] * so_t + cols64[None, :] * so_c
    tl.store(out_ptrs, out, mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _conv_update_kernel(
    x_ptr, states_ptr, w_ptr, out_ptr, slots_ptr, fresh_ptr,
    channels,
    sx_b, sx_c, ss_n, ss_w, ss_c, sw_c, sw_k, so_b, so_c,
    K: tl.constexpr, D: tl.constexpr, W: tl.constexpr, SILU: tl.constexpr, BLOCK_C: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    b = tl.program_id(0)
    cols = (tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)).to(tl.int64)
    cmask = cols < channels
    slot = tl.load(slots_ptr + b).to(tl.int64)
    keep_old = cmask & (tl.load(fresh_ptr + b) == 0)
    base = states_ptr + slot * ss_n + cols * ss_c
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    # Row r of window-plus-new-row: old window rows 0..W-1, then x. Tap j reads row j * D.
    for r in tl.static_range(W + 1):
        if r == W:
            row = tl.load(x_ptr + b.to(tl.int64) * sx_b + cols * sx_c, mask=cmask, other=0.0)
            row = row.to(states_ptr.dtype.element_ty)
        else:
            row = tl.load(base + r * ss_w, mask=keep_old, other=0.0)
        if r % D == 0:
            w = tl.load(w_ptr + cols * sw_c + (r // D) * sw_k, mask=cmask, other=0.0).to(tl.float32)
            acc += row.to(tl.float32) * w
        if r >= 1:  # shift: row r becomes window row r - 1 (row r - 1 was loaded an iteration ago)
            tl.store(base + (r - 1) * ss_w, row, mask=cmask)
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    tl.store(out_ptr + b.to(tl.int64) * so_b + cols * so_c, acc.to(out_ptr.dtype.element_ty), mask=cmask)


def _as_bytes(flags: torch.Tensor) -> torch.Tensor:
    """A bool tensor viewed as uint8 (no copy), so kernels load plain bytes instead of ``i1``."""
    return flags.view(torch.uint8) if flags.dtype == torch.bool else flags


# (BLOCK_T, BLOCK_C, num_warps) of the prefill kernel. From tools/tune_conv.py on the H200 (a GDN layer's
# three calls at 32K): 603 us with 8 warps, 636 us with 4;
# wider tiles spill registers (up to 20x slower).
VARLEN_CONFIG: tuple[int, int, int] = (64, 128, 8)
# The largest l2_group (a power of two) the prefill kernel normalises in its epilogue.
MAX_FUSED_L2_GROUP = 256


def causal_conv1d_varlen(x: torch.Tensor, states: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor,
                         slots: torch.Tensor, fresh: torch.Tensor, dilation: int = 1, silu: bool = True,
                         max_seqlen: int = 0, row_segment: torch.Tensor | None = None,
                         config: tuple[int, int, int] | None = None, l2_group: int = 0) -> torch.Tensor:
    """Triton form of :func:`tidal.kernels.conv.causal_conv1d_varlen` (same arguments and result).

    Grid ``(cdiv(T, BLOCK_T), cdiv(C, BLOCK_C))``; ``max_seqlen`` is unused because programs cover
    rows of the flat batch, not segments. ``config`` overrides :data:`VARLEN_CONFIG`. An ``l2_group``
    that is a power of two up to :data:`MAX_FUSED_L2_GROUP` is normalised in the kernel's epilogue,
    with ``BLOCK_C`` at least ``l2_group`` (``BLOCK_T`` shrunk to keep the tile's size where it
    widens); any other is normalised by :func:`tidal.kernels.common.l2_norm_groups` after the kernel.
    """
    del max_seqlen
    num_rows, channels = x.shape
    kernel_size = weight.shape[1]
    assert states.shape[1] == (kernel_size - 1) * dilation and states.shape[2] == channels
    check_l2_group(channels, l2_group)
    fused = l2_group if l2_group <= MAX_FUSED_L2_GROUP and l2_group & (l2_group - 1) == 0 else 0
    out = torch.empty((num_rows, channels), dtype=x.dtype, device=x.device)
    if num_rows == 0 or channels == 0:
        return out
    if row_segment is None:
        row_segment = row_segments(cu_seqlens, num_rows)
    block_t, block_c, warps = config or VARLEN_CONFIG
    block_c = min(block_c, triton.next_power_of_2(channels))
    if fused > block_c:
        block_t, block_c = max(1, block_t * block_c // fused), fused
    grid = (triton.cdiv(num_rows, block_t), triton.cdiv(channels, block_c))
    _conv_varlen_kernel[grid](
        x, states, weight, out, cu_seqlens, slots, _as_bytes(fresh), row_segment,
        num_rows, channels,
        x.stride(0), x.stride(1), states.stride(0), states.stride(1), states.stride(2),
        weight.stride(0), weight.stride(1), out.stride(0), out.stride(1),
        K=kernel_size, D=dilation, SILU=silu, L2_GROUP=fused, L2_EPS=L2_NORM_EPS, BLOCK_T=block_t, BLOCK_C=block_c,
        num_warps=warps,
    )
    return l2_norm_groups(out, l2_group) if l2_group and not fused else out


def causal_conv1d_update(x: torch.Tensor, states: torch.Tensor, weight: torch.Tensor, slots: torch.Tensor,
                         fresh: torch.Tensor, dilation: int = 1, silu: bool = True) -> torch.Tensor:
    """Triton form of :func:`tidal.kernels.conv.causal_conv1d_update`: one launch, grid
    ``(B, cdiv(C, BLOCK_C))``; the windows of ``states[slots]`` shift in place (slots must be distinct).
    """
    batch, channels = x.shape
    kernel_size = weight.shape[1]
    width = (kernel_size - 1) * dilation
    assert states.shape[1] == width and states.shape[2] == channels
    out = torch.empty((batch, channels), dtype=x.dtype, device=x.device)
    if batch == 0 or channels == 0:
        return out
    block_c = min(256, triton.next_power_of_2(channels))
    grid = (batch, triton.cdiv(channels, block_c))
    _conv_update_kernel[grid](
        x, states, weight, out, slots, _as_bytes(fresh),
        channels,
        x.stride(0), x.stride(1), states.stride(0), states.stride(1), states.stride(2),
        weight.stride(0), weight.stride(1), out.stride(0), out.stride(1),
        K=kernel_size, D=dilation, W=width, SILU=silu, BLOCK_C=block_c, num_warps=4, **pdl.launch_args(x),
    )
    return out
