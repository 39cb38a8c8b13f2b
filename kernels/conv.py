"""Depthwise causal conv1d with carried history (GDN and PLE short convs).

Two families live here:

* ``causal_conv1d`` / ``conv_history``: one sequence against one explicit history tensor. They are the
  simplest statement of the operation and the oracle the batched forms are tested against.
* ``causal_conv1d_varlen`` / ``conv_windows`` / ``causal_conv1d_update``: a flat batch of segments, each
  continuing from a conv window held in a state pool ``states [S, W, C]`` (``W = (k - 1) * dilation``) at
  its slot, or from zeros when the segment is fresh. The ``*_ref`` functions are the vectorised torch
  references (the CPU serving path, no Python loop over segments); the undecorated names dispatch to the
  Triton kernels of ``conv_triton`` for CUDA tensors. None of them synchronises with the host.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .backend import use_triton
from .common import check_l2_group, l2_norm_groups


def causal_conv1d(x: torch.Tensor, history: torch.Tensor, weight: torch.Tensor, dilation: int = 1,
                  silu: bool = True) -> torch.Tensor:
    """Depthwise causal convolution of one sequence that continues from ``history``.

    Args:
        x: ``[L, C]`` new rows.
        history: ``[W, C]`` the ``W = (k - 1) * dilation`` rows before ``x`` (zeros at a sequence start).
        weight: ``[C, k]`` per-channel taps.
    Returns ``[L, C]`` in ``x``'s dtype; the arithmetic runs in ``weight``'s dtype.
    """
    length = x.shape[0]
    full = torch.cat([history.to(x.dtype), x], dim=0).to(weight.dtype)
    out = F.conv1d(full.t().unsqueeze(0), weight.unsqueeze(1), dilation=dilation, groups=weight.shape[0])
    out = out[0, :, -length:].t()
    if silu:
        out = F.silu(out)
    return out.to(x.dtype)


def conv_history(x: torch.Tensor, history: torch.Tensor, upto: int) -> torch.Tensor:
    """The ``W`` rows immediately before local offset ``upto`` of ``x`` (``0 <= upto <= L``).

    This is what a state checkpoint at an internal offset stores: no recomputation, only the
    rows the next forward's convolution will read.
    """
    width = history.shape[0]
    if width == 0:
        return history.clone()
    full = torch.cat([history.to(x.dtype), x[:upto]], dim=0)
    return full[full.shape[0] - width:].clone()


# --------------------------------------------------------------------------------------------------
# Flat batch of segments over a state pool
# --------------------------------------------------------------------------------------------------


def _slot_windows(states: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
    """``[N, W, C]`` the old window of every segment's slot, zeros for fresh segments (states' dtype)."""
    windows = states.index_select(0, slots)
    return windows.masked_fill(fresh.view(-1, 1, 1), 0)


def _taps(rows: torch.Tensor, weight: torch.Tensor, dilation: int, length: int) -> torch.Tensor:
    """fp32 depthwise conv over dim -2 of channels-last ``rows``: output ``i`` reads rows
    ``i, i + dilation, ..., i + (k - 1) * dilation``.

    One multiply and then one ``addcmul_`` per tap on contiguous row slices: no transposes of the
    ``[rows, C]`` layout (which ``F.conv1d`` would need twice) and, in fp32, the same rounding as
    ``F.conv1d``'s depthwise kernel (a zero-initialised fused multiply-add chain over the taps), so
    results stay bit-identical to :func:`causal_conv1d`.
    """
    w = weight.float().t()  # [k, C]
    out = rows[..., 0:length, :] * w[0]
    for j in range(1, w.shape[0]):
        lo = j * dilation
        out.addcmul_(rows[..., lo:lo + length, :], w[j])
    return out


def causal_conv1d_varlen_ref(x: torch.Tensor, states: torch.Tensor, weight: torch.Tensor,
                             cu_seqlens: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor,
                             dilation: int = 1, silu: bool = True, max_seqlen: int = 0,
                             row_segment: torch.Tensor | None = None, l2_group: int = 0) -> torch.Tensor:
    """Torch reference of :func:`causal_conv1d_varlen`: one conv over all rows, then the first ``W``
    rows of every segment recomputed from its window.

    The flat batch behind ``W`` zero rows is convolved as if it were one sequence: every row whose
    taps stay inside its own segment (local offset ``>= W``) is then already right. Only the first
    ``W`` rows of each segment read across its start; they are recomputed in one small batched conv
    over ``[N, 2W, C]`` (the slot's window, then the segment's first ``W`` rows) and written over
    the bulk result. Rows past a short segment's end are routed to a spare output row that is cut
    off, so no index depends on host-side lengths. The big tensors see only contiguous passes (no
    gathers over ``T``), and the tap order is the same everywhere, so the result is bit-identical
    to :func:`causal_conv1d` per segment in fp32. ``row_segment`` and ``max_seqlen`` are not needed.
    """
    del max_seqlen, row_segment
    num_rows, channels = x.shape
    check_l2_group(channels, l2_group)
    width = states.shape[1]
    if num_rows == 0:
        return x.new_empty(0, channels)
    flat = torch.empty(width + num_rows + 1, channels, dtype=torch.float32, device=x.device)
    flat[:width].zero_()
    flat[width:width + num_rows].copy_(x)
    flat[-1].zero_()
    out = _taps(flat, weight, dilation, num_rows + 1)  # row num_rows is the spare
    if width:
        offsets = torch.arange(width, device=x.device)
        starts = cu_seqlens[:-1].long().unsqueeze(1)
        first = starts + offsets  # [N, W] rows whose taps reach before their segment's start
        head = torch.cat([_slot_windows(states, slots, fresh).float(),
                          x[first.clamp(max=num_rows - 1)].float()], dim=1)  # [N, 2W, C]
        fixed = _taps(head, weight, dilation, width)  # [N, W, C]
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long().unsqueeze(1)
        dst = torch.where(offsets < lengths, first, num_rows)
        out.index_copy_(0, dst.flatten(), fixed.reshape(-1, channels))
    out = out[:num_rows]
    if silu:
        out = F.silu(out, inplace=True)
    out = out.to(x.dtype)
    return l2_norm_groups(out, l2_group) if l2_group else out


def causal_conv1d_varlen(x: torch.Tensor, states: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor,
                         slots: torch.Tensor, fresh: torch.Tensor, dilation: int = 1, silu: bool = True,
                         max_seqlen: int = 0, row_segment: torch.Tensor | None = None,
                         l2_group: int = 0) -> torch.Tensor:
    """Depthwise causal conv of a flat batch of segments, each continuing from its slot's window.

    Args:
        x: ``[T, C]`` rows of ``N`` segments; segment ``i`` is rows ``cu_seqlens[i]:cu_seqlens[i + 1]``.
        states: ``[S, W, C]`` window pool, ``W = (k - 1) * dilation``; read only (the caller writes the
            new windows, from :func:`conv_windows`, after this has read the old ones).
        weight: ``[C, k]`` per-channel taps.
        cu_seqlens: int32 ``[N + 1]`` on ``x``'s device.
        slots: int ``[N]`` slot of each segment; fresh: bool ``[N]``, True where the window is zeros.
        max_seqlen: accepted for interface parity with varlen kernels that grid over segments; unused
            here (both implementations grid over rows).
        row_segment: optional segment index of every row (int32 or int64 ``[T]``, as
            :func:`~tidal.kernels.common.row_segments` computes it), to share one across the layers of a forward;
            the Triton kernel needs it (and runs ``row_segments`` itself without it), the reference does not.
        l2_group: when > 0 (a divisor of ``C``), each consecutive ``l2_group`` output channels of a row are then
            L2-normalised as :func:`~tidal.kernels.common.l2_norm_groups` does (GDN's q and k heads).
    Returns ``silu(conv)`` (or the bare conv) ``[T, C]`` in ``x``'s dtype; arithmetic in fp32.
    """
    if use_triton(x, "conv"):
        from . import conv_triton

        return conv_triton.causal_conv1d_varlen(x, states, weight, cu_seqlens, slots, fresh, dilation, silu,
                                                max_seqlen, row_segment, l2_group=l2_group)
    return causal_conv1d_varlen_ref(x, states, weight, cu_seqlens, slots, fresh, dilation, silu, max_seqlen,
                                    row_segment, l2_group)


def conv_windows(x: torch.Tensor, states: torch.Tensor, cu_seqlens: torch.Tensor, slots: torch.Tensor,
                 fresh: torch.Tensor, seg_index: torch.Tensor, upto: torch.Tensor) -> torch.Tensor:
    """``[M, W, C]`` the conv window before local offset ``upto[m]`` of segment ``seg_index[m]``.

    Equal to ``conv_history(x_seg, history_seg, upto)`` for each request: window row ``j`` is the
    segment's local row ``upto - W + j`` when that is ``>= 0``, else the old window's row
    ``upto + j`` (zeros when the segment is fresh). It is pure gathering, so one implementation
    serves CPU and GPU (a handful of small device ops, no host synchronisation). Returned in ``x``'s
    dtype; the caller stores it (``states[dst] = windows``) after the conv has read the old windows.
    """
    width = states.shape[1]
    num = seg_index.shape[0]
    device = x.device
    if width == 0 or num == 0:
        return x.new_zeros(num, width, x.shape[1])
    seg = seg_index.long()
    offsets = torch.arange(width, device=device)
    local = upto.long().unsqueeze(1) - width + offsets  # [M, W] local row each window row comes from
    from_x = local >= 0
    old_rows = (local + width).clamp(max=width - 1)
    old = states[slots.long().index_select(0, seg).unsqueeze(1), old_rows]  # [M, W, C]
    old = old.masked_fill(fresh.index_select(0, seg).view(-1, 1, 1), 0).to(x.dtype)
    if x.shape[0] == 0:
        return old
    x_rows = (cu_seqlens.long().index_select(0, seg).unsqueeze(1) + local).clamp(0, x.shape[0] - 1)
    return torch.where(from_x.unsqueeze(-1), x[x_rows], old)


def causal_conv1d_update_ref(x: torch.Tensor, states: torch.Tensor, weight: torch.Tensor, slots: torch.Tensor,
                             fresh: torch.Tensor, dilation: int = 1, silu: bool = True) -> torch.Tensor:
    """Torch reference of :func:`causal_conv1d_update`: the prefill reference's taps over ``[B, W + 1, C]``,
    so a decode step is bit-identical in fp32 to a one-row segment of :func:`causal_conv1d_varlen_ref`.
    """
    window = _slot_windows(states, slots, fresh)
    full = torch.cat([window.to(x.dtype), x.unsqueeze(1)], dim=1)  # [B, W + 1, C]
    out = _taps(full.float(), weight, dilation, 1)[:, 0]
    if silu:
        out = F.silu(out)
    states.index_copy_(0, slots.long(), full[:, 1:].to(states.dtype))
    return out.to(x.dtype)


def causal_conv1d_update(x: torch.Tensor, states: torch.Tensor, weight: torch.Tensor, slots: torch.Tensor,
                         fresh: torch.Tensor, dilation: int = 1, silu: bool = True) -> torch.Tensor:
    """One new row per request (decode): conv output ``[B, C]`` and the slot windows shifted in place.

    Args:
        x: ``[B, C]`` one row per request; states ``[S, W, C]``; weight ``[C, k]``.
        slots: int ``[B]`` distinct slots; fresh: bool ``[B]`` (window read as zeros).
    Afterwards ``states[slots[b]]`` holds the last ``W`` inputs including ``x[b]``; other slots are
    untouched. Output in ``x``'s dtype, arithmetic in fp32.
    """
    if use_triton(x, "conv"):
        from . import conv_triton

        return conv_triton.causal_conv1d_update(x, states, weight, slots, fresh, dilation, silu)
    return causal_conv1d_update_ref(x, states, weight, slots, fresh, dilation, silu)
