"""Paged attention (dense causal or QSA-selected) for packed prefill and decode rows, Triton.

Same contract as :func:`tidal.kernels.attention.paged_attention_ref`, which is the oracle. Two kernels:

* ``_tile_kernel``: causal prefill, flash-attention style. One program per (query head, tile of
  ``BLOCK_M`` rows, segment); it walks key tiles through the page table with an online softmax, masks
  only the tiles that cross the diagonal and stops at the tile's last query position. QSA prompt rows
  at positions below :data:`QSA_TILE_BELOW` run here too: the key tiles are read dense and each row's
  unselected keys are masked out of its scores with a per-row block mask.
* ``_row_kernel``: one program per (query row, kv head, key split) with the kv head's query heads as the
  M dimension of the dots (padded to 16). It handles the other QSA rows (walking the selected blocks,
  then the tail) and dense decodes (1-row segments, walking all keys). Long decodes are split
  over several programs whose partial results ``_combine_kernel`` merges (flash-decoding), since
  a few decodes alone would occupy only a handful of SMs.

The output gate of the gated attention (``out * sigmoid(gate)``) is applied where each kernel stores.
Nothing here reads a device value on the host: the grids come from shapes, ``max_seqlen_q`` and
whether ``block_sel`` is given; programs whose rows belong to the other kernel exit at once.
Softmax statistics are fp32 in base 2 (``exp2`` with ``scale * log2(e)`` folded into the scores).
"""

from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
# Running max starts finite so that a tile whose keys are all masked gives exp2(-inf - m) = 0, not NaN.
_NEG_BIG = tl.constexpr(-1.0e30)

# Padded head dim -> (BLOCK_M, BLOCK_N, num_warps, num_stages) of the prefill tile kernel for 16-bit
# inputs. D=256 from a sweep on the H200 (tools/tune_attention.py, 32K causal): 128x64,
# 8 warps, 2 stages ran at 442 TFLOP/s, twice the 64x64 tile.
_TILE_CONFIGS_16BIT: dict[int, tuple[int, int, int, int]] = {
    16: (128, 64, 4, 3),
    32: (128, 64, 4, 3),
    64: (128, 64, 4, 3),
    128: (128, 64, 8, 2),
    256: (128, 64, 8, 2),
}
# fp32 (tests, exact ``ieee`` dots on CUDA cores): operands twice as wide, so smaller tiles and no pipelining.
_TILE_CONFIGS_32BIT: dict[int, tuple[int, int, int, int]] = {
    16: (32, 32, 4, 1),
    32: (32, 32, 4, 1),
    64: (32, 32, 4, 1),
    128: (16, 32, 8, 1),
    256: (16, 32, 8, 1),
}
# Padded head dim -> (BLOCK_N, num_warps, num_stages) of the row kernel (M is the head group, >= 16).
# D=256 from the same sweep (QSA prefill rows, top-32 blocks of 64): 32 keys, 4 warps, 2 stages.
_ROW_CONFIGS_16BIT: dict[int, tuple[int, int, int]] = {
    16: (64, 4, 3), 32: (64, 4, 3), 64: (64, 4, 3), 128: (64, 4, 3), 256: (32, 4, 2),
}
_ROW_CONFIGS_32BIT: dict[int, tuple[int, int, int]] = {
    16: (64, 4, 1), 32: (64, 4, 1), 64: (64, 4, 1), 128: (32, 8, 1), 256: (32, 8, 1),
}
_MAX_SPLITS = 32
# QSA prompt rows at positions below this run in the tile kernel: dense key tiles with the unselected keys
# masked out, at tensor-core rate (a dense 32K causal layer, D=256: 19.9 ms, 442 TFLOP/s); the rows past it
# in the row kernel, whose gathers of the selected blocks cost the same at any position (32K rows, top-32
# blocks of 64: 25.5 ms). A row's dense cost grows with its position and reaches its gather cost near 22K
# keys (tools/tune_attention.py).
QSA_TILE_BELOW = 20480
# At most this many blocks below the split (the block mask is one byte per block and row): with small QSA
# blocks the split comes earlier (the mask of a 32K-row batch stays under 64 MiB).
_QSA_TILE_MAX_BLOCKS = 2048


@triton.jit
def _attend(q, k_ptr, v_ptr, pt_row_ptr, keys, load_ok, allow, kv_off, m_i, l_i, acc, qk_scale,
            stride_kp, stride_kr, stride_vp, stride_vr, offs_d, d_ok,
            PAGE: tl.constexpr, MASKED: tl.constexpr, EVEN_D: tl.constexpr, DOT_PREC: tl.constexpr,
            ALLOW: tl.constexpr = False):
    """One key tile of the online softmax; keys are read through the page table row ``pt_row_ptr``.

    Without ``MASKED`` every key is valid and allowed (tiles below the diagonal), so the loads carry no
    key mask, and no mask at all when the head dim is a power of two; ``ALLOW`` then still applies
    ``allow`` to the scores (QSA tiles below the diagonal: every key valid, only the selected ones allowed).
    """
    if MASKED:
        page = tl.load(pt_row_ptr + keys // PAGE, mask=load_ok, other=0).to(tl.int64)
    else:
        page = tl.load(pt_row_ptr + keys // PAGE).to(tl.int64)
    in_page = (keys % PAGE).to(tl.int64)
    k_ptrs = k_ptr + (page * stride_kp + in_page * stride_kr + kv_off)[:, None] + offs_d[None, :]
    v_ptrs = v_ptr + (page * stride_vp + in_page * stride_vr + kv_off)[:, None] + offs_d[None, :]
    if MASKED:
        k = tl.load(k_ptrs, mask=load_ok[:, None] & d_ok[None, :], other=0.0)
        v = tl.load(v_ptrs, mask=load_ok[:, None] & d_ok[None, :], other=0.0)
    elif EVEN_D:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    else:
        k = tl.load(k_ptrs, mask=d_ok[None, :], other=0.0)
        v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
    if MASKED or ALLOW:
        s = tl.where(allow, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return m_new, l_i, acc


@triton.jit
def _gated(out, g_ptrs, mask, dtype, HAS_GATE: tl.constexpr):
    """``out`` (fp32) in ``dtype``, times ``sigmoid(gate)`` when ``HAS_GATE``, rounded as torch rounds
    ``out.to(dtype) * torch.sigmoid(gate)``: the output, the sigmoid and the product each in ``dtype``."""
    o = out.to(dtype)
    if HAS_GATE:
        g = tl.sigmoid(tl.load(g_ptrs, mask=mask, other=0.0).to(tl.float32)).to(dtype)
        o = (o.to(tl.float32) * g.to(tl.float32)).to(dtype)
    return o


# The batch-shaped integers (segments, key splits, the tile kernel's bound) are not specialized on (== 1, divisible
# by 16): a batch's row count and context would otherwise pick among variants the warm-up cannot all meet.
@triton.jit(do_not_specialize=["tile_below"])
def _tile_kernel(q_ptr, k_ptr, v_ptr, o_ptr, g_ptr, pt_ptr, cu_ptr, kvlen_ptr, bm_ptr, qk_scale, tile_below,
                 stride_qt, stride_qh, stride_ot, stride_oh, stride_gt, stride_gh, stride_kp, stride_kr, stride_kh,
                 stride_vp, stride_vr, stride_vh, stride_pt, stride_bm,
                 GROUP: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr, HAS_GATE: tl.constexpr,
                 SELECTED: tl.constexpr, RATIO: tl.constexpr):
    """Causal attention of one tile of a multi-row segment for one query head.

    With ``SELECTED`` (QSA) only the tile's rows at positions below ``tile_below`` are computed and stored
    (the row kernel takes the rest). A row sees the keys of its selected complete blocks, read from the
    block mask ``bm`` (``[blocks + 1, T]`` bytes, one row per block), plus its tail block up to itself:
    every key tile is read dense and the unselected keys are masked out of the scores.
    """
    head = tl.program_id(0)
    tile = tl.num_programs(1) - 1 - tl.program_id(1)  # longest (last) tiles start first
    seg = tl.program_id(2)
    row0 = tl.load(cu_ptr + seg)
    seg_len = tl.load(cu_ptr + seg + 1) - row0
    start = tile * BLOCK_M
    if (seg_len <= 1) | (start >= seg_len):  # decodes belong to the row kernel
        return
    kv_len = tl.load(kvlen_ptr + seg)
    offs_m = start + tl.arange(0, BLOCK_M)
    row_ok = offs_m < seg_len
    q_pos = kv_len - seg_len + offs_m
    first_pos = kv_len - seg_len + start
    end_key = tl.minimum(first_pos + BLOCK_M, kv_len)  # one past the tile's last query position
    if SELECTED:
        if first_pos >= tile_below:
            return
        row_ok = row_ok & (q_pos < tile_below)
        end_key = tl.minimum(end_key, tile_below)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    rows = (row0 + offs_m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    kv_off = (head // GROUP) * stride_kh
    pt_row_ptr = pt_ptr + seg.to(tl.int64) * stride_pt
    m_i = tl.full([BLOCK_M], _NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    if SELECTED:
        # Key tiles before the first row's tail block hold complete blocks of every row: the block mask
        # alone decides. Past it, a key is allowed when selected and before the row's own tail, or in
        # the tail up to the row. Rows the tile does not compute read the mask's first row; they are not stored.
        tail0 = ((q_pos + 1) // RATIO) * RATIO
        bm_rows = tl.where(row_ok, rows, 0)
        full_end = ((first_pos + 1) // RATIO) * RATIO // BLOCK_N * BLOCK_N
        for key0 in range(0, full_end, BLOCK_N):
            keys = key0 + offs_n
            if RATIO % BLOCK_N == 0:  # the tile lies in one block: one contiguous byte per row
                allow = (tl.load(bm_ptr + (key0 // RATIO) * stride_bm + bm_rows) != 0)[:, None]
            else:
                allow = tl.load(bm_ptr + (keys // RATIO)[None, :] * stride_bm + bm_rows[:, None]) != 0
            m_i, l_i, acc = _attend(q, k_ptr, v_ptr, pt_row_ptr, keys, None, allow, kv_off, m_i, l_i, acc,
                                    qk_scale, stride_kp, stride_kr, stride_vp, stride_vr, offs_d, d_ok,
                                    PAGE, False, HEAD_DIM == BLOCK_D, DOT_PREC, True)
        for key0 in range(full_end, end_key, BLOCK_N):
            keys = key0 + offs_n
            blk = tl.minimum(keys, end_key - 1) // RATIO
            marked = tl.load(bm_ptr + blk[None, :] * stride_bm + bm_rows[:, None]) != 0
            allow = (marked & (keys[None, :] < tail0[:, None])) | \
                ((keys[None, :] >= tail0[:, None]) & (keys[None, :] <= q_pos[:, None]))
            m_i, l_i, acc = _attend(q, k_ptr, v_ptr, pt_row_ptr, keys, keys < kv_len, allow, kv_off, m_i, l_i,
                                    acc, qk_scale, stride_kp, stride_kr, stride_vp, stride_vr, offs_d, d_ok,
                                    PAGE, True, HEAD_DIM == BLOCK_D, DOT_PREC)
    else:
        # Key tiles entirely at or before the first query position need no causal mask.
        full_end = ((first_pos + 1) // BLOCK_N) * BLOCK_N
        for key0 in range(0, full_end, BLOCK_N):
            keys = key0 + offs_n
            m_i, l_i, acc = _attend(q, k_ptr, v_ptr, pt_row_ptr, keys, None, None, kv_off, m_i, l_i, acc,
                                    qk_scale, stride_kp, stride_kr, stride_vp, stride_vr, offs_d, d_ok,
                                    PAGE, False, HEAD_DIM == BLOCK_D, DOT_PREC)
        for key0 in range(full_end, end_key, BLOCK_N):
            keys = key0 + offs_n
            allow = keys[None, :] <= q_pos[:, None]
            m_i, l_i, acc = _attend(q, k_ptr, v_ptr, pt_row_ptr, keys, keys < kv_len, allow, kv_off, m_i, l_i,
                                    acc, qk_scale, stride_kp, stride_kr, stride_vp, stride_vr, offs_d, d_ok,
                                    PAGE, True, HEAD_DIM == BLOCK_D, DOT_PREC)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    mask = row_ok[:, None] & d_ok[None, :]
    out = _gated(out, g_ptr + rows[:, None] * stride_gt + head * stride_gh + offs_d[None, :], mask,
                 o_ptr.dtype.element_ty, HAS_GATE)
    tl.store(o_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :], out, mask=mask)


@triton.jit
def _find_row(cu_ptr, slot, num_segs, search_iters, SELECTED: tl.constexpr):
    """``(segment, row, segment length, row index in segment, live)`` of a row-kernel slot.

    With ``SELECTED`` a slot is a row and its segment is found by binary search over ``cu_seqlens``
    (invariant ``cu[lo] <= row < cu[hi]``); otherwise a slot is a segment, live only if it is a decode.
    """
    if SELECTED:
        lo = num_segs * 0
        hi = num_segs + 0
        for _ in range(search_iters):
            mid = (lo + hi) // 2
            right = tl.load(cu_ptr + mid) <= slot
            lo = tl.where(right, mid, lo)
            hi = tl.where(right, hi, mid)
        seg = lo
        row0 = tl.load(cu_ptr + seg)
        seg_len = tl.load(cu_ptr + seg + 1) - row0
        return seg, slot, seg_len, slot - row0, seg_len > 0
    else:
        row0 = tl.load(cu_ptr + slot)
        seg_len = tl.load(cu_ptr + slot + 1) - row0
        return slot, row0, seg_len, seg_len - 1, seg_len == 1


@triton.jit(do_not_specialize=["num_segs", "search_iters", "num_splits", "tile_below"])
def _row_kernel(q_ptr, k_ptr, v_ptr, o_ptr, g_ptr, part_o_ptr, part_lse_ptr, pt_ptr, cu_ptr, kvlen_ptr, sel_ptr,
                qk_scale, num_segs, search_iters, num_splits, tile_below,
                stride_qt, stride_qh, stride_ot, stride_oh, stride_gt, stride_gh, stride_kp, stride_kr, stride_kh,
                stride_vp, stride_vr, stride_vh, stride_pt, stride_sel,
                GROUP: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, SELECTED: tl.constexpr,
                RATIO: tl.constexpr, TOPK: tl.constexpr, SPLIT: tl.constexpr, BLOCK_H: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr, HAS_GATE: tl.constexpr):
    """One query row x one kv head (all its query heads) x one split of the row's key list.

    With ``SELECTED`` prompt rows (segments of more than one row) at positions below ``tile_below`` are
    left to the tile kernel.

    The key list is virtual: with ``SELECTED`` entry ``v < TOPK*RATIO`` is key ``v % RATIO`` of the row's
    ``v // RATIO``-th selected block and the next ``RATIO`` entries are the tail block; otherwise entry
    ``v`` is key ``v``. Entries outside the allowed set are masked, so every tile has the same shape.
    """
    slot = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seg, row, seg_len, j, live = _find_row(cu_ptr, slot, num_segs, search_iters, SELECTED)
    if not live:
        return
    kv_len = tl.load(kvlen_ptr + seg)
    pos = kv_len - seg_len + j
    if SELECTED:
        if (seg_len > 1) & (pos < tile_below):  # a prompt row the tile kernel computed
            return
    offs_h = tl.arange(0, BLOCK_H)
    h_ok = offs_h < GROUP
    heads = kv_head * GROUP + offs_h
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    row64 = row.to(tl.int64)
    q = tl.load(q_ptr + row64 * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=h_ok[:, None] & d_ok[None, :], other=0.0)
    kv_off = kv_head * stride_kh
    pt_row_ptr = pt_ptr + seg.to(tl.int64) * stride_pt
    if SELECTED:
        n_virtual = pos * 0 + (TOPK * RATIO + RATIO)
    else:
        n_virtual = pos + 1
    n_tiles = tl.cdiv(n_virtual, BLOCK_N)
    per_split = tl.cdiv(n_tiles, num_splits)
    t_begin = split * per_split
    t_end = tl.minimum(t_begin + per_split, n_tiles)
    n_complete = (pos + 1) // RATIO
    m_i = tl.full([BLOCK_H], _NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for t in range(t_begin, t_end):
        v_idx = t * BLOCK_N + offs_n
        if SELECTED:
            in_sel = v_idx < TOPK * RATIO
            blk = tl.load(sel_ptr + row64 * stride_sel + v_idx // RATIO, mask=in_sel, other=-1)
            tail_key = n_complete * RATIO + v_idx - TOPK * RATIO
            keys = tl.where(in_sel, blk * RATIO + v_idx % RATIO, tail_key)
            ok = tl.where(in_sel, (blk >= 0) & (blk < n_complete), tail_key <= pos)
        else:
            keys = v_idx
            ok = v_idx <= pos
        m_i, l_i, acc = _attend(q, k_ptr, v_ptr, pt_row_ptr, keys, ok, ok[None, :], kv_off, m_i, l_i, acc,
                                qk_scale, stride_kp, stride_kr, stride_vp, stride_vr, offs_d, d_ok,
                                PAGE, True, HEAD_DIM == BLOCK_D, DOT_PREC)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_mask = h_ok[:, None] & d_ok[None, :]
    if not SPLIT:
        out = _gated(out, g_ptr + row64 * stride_gt + heads[:, None] * stride_gh + offs_d[None, :], out_mask,
                     o_ptr.dtype.element_ty, HAS_GATE)
        tl.store(o_ptr + row64 * stride_ot + heads[:, None] * stride_oh + offs_d[None, :], out, mask=out_mask)
    else:
        num_heads = tl.num_programs(1) * GROUP
        part = (slot.to(tl.int64) * num_heads + heads) * num_splits + split  # [BLOCK_H]
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=h_ok)
        tl.store(part_o_ptr + part[:, None] * BLOCK_D + offs_d[None, :], out, mask=out_mask)


@triton.jit(do_not_specialize=["num_segs", "search_iters", "num_splits", "tile_below"])
def _combine_kernel(o_ptr, g_ptr, part_o_ptr, part_lse_ptr, cu_ptr, kvlen_ptr, num_segs, search_iters, num_splits,
                    tile_below, stride_ot, stride_oh, stride_gt, stride_gh, SELECTED: tl.constexpr,
                    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, HAS_GATE: tl.constexpr):
    """Merge the split results of one (slot, query head) by their log-sum-exp weights (the rows the row
    kernel computed: not the prompt rows it left to the tile kernel)."""
    slot = tl.program_id(0)
    head = tl.program_id(1)
    seg, row, seg_len, j, live = _find_row(cu_ptr, slot, num_segs, search_iters, SELECTED)
    if not live:
        return
    if SELECTED:
        if (seg_len > 1) & (tl.load(kvlen_ptr + seg) - seg_len + j < tile_below):
            return
    offs_s = tl.arange(0, BLOCK_S)
    s_ok = offs_s < num_splits
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    part = (slot.to(tl.int64) * tl.num_programs(1) + head) * num_splits + offs_s
    lse = tl.load(part_lse_ptr + part, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    o = tl.load(part_o_ptr + part[:, None] * BLOCK_D + offs_d[None, :], mask=s_ok[:, None] & d_ok[None, :],
                other=0.0)
    total = tl.sum(w, 0)
    out = tl.sum(o * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    row64 = row.to(tl.int64)
    out = _gated(out, g_ptr + row64 * stride_gt + head * stride_gh + offs_d, d_ok, o_ptr.dtype.element_ty, HAS_GATE)
    tl.store(o_ptr + row64 * stride_ot + head * stride_oh + offs_d, out, mask=d_ok)


@cache
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 16  # interpreter runs: a small stand-in so that splitting is still exercised


def _pick_splits(programs: int, max_tiles: int, device: torch.device) -> int:
    """Key splits per row-kernel program: enough to give every SM ~2 programs, never more than key tiles."""
    return max(1, min(triton.cdiv(2 * _sm_count(device), max(programs, 1)), max_tiles, _MAX_SPLITS))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, kv_lens: torch.Tensor, scale: float, *,
                    block_sel: torch.Tensor | None = None, qsa_ratio: int = 0, gate: torch.Tensor | None = None,
                    max_seqlen_q: int, num_splits: int | None = None,
                    qsa_tile_below: int = QSA_TILE_BELOW) -> torch.Tensor:
    """Triton version of :func:`tidal.kernels.attention.paged_attention_ref` (see it for the arguments).

    ``max_seqlen_q`` (host int, the longest segment) sizes the prefill grid without a device sync.
    ``num_splits`` overrides the key-split count of the row kernel (a tuning/testing knob; default:
    chosen from the SM count for decode batches, none when the batch holds prompt rows). Multi-row
    segments go to the tile kernel and 1-row segments to the row kernel; with ``block_sel`` only the
    prompt rows at positions below ``qsa_tile_below`` (see :data:`QSA_TILE_BELOW`; at most
    ``qsa_ratio`` times :data:`_QSA_TILE_MAX_BLOCKS`) take the tile kernel, the others the row kernel.
    Which kernel computes a row depends only on its position and segment length, so a prompt row gives
    the same bits however its prompt is chunked.
    """
    tokens, num_heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_cache.shape
    assert num_heads % kv_heads == 0, "query heads must be a multiple of kv heads"
    assert v_cache.shape == k_cache.shape, "k_cache and v_cache must have the same shape"
    # The kernels address V with K's head offset (one ``kv_off``): the layouts must match.
    assert v_cache.stride() == k_cache.stride(), "k_cache and v_cache must have the same strides"
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "head dim must be contiguous"
    assert page_table.stride(-1) == 1 and cu_seqlens_q.is_contiguous() and kv_lens.is_contiguous()
    if gate is not None:
        assert gate.shape == q.shape and gate.dtype == q.dtype and gate.stride(-1) == 1, "gate must be like q"
    out = torch.empty_like(q)
    g, stride_gt, stride_gh = (gate, gate.stride(0), gate.stride(1)) if gate is not None else (out, 0, 0)
    num_segs = cu_seqlens_q.numel() - 1
    if tokens == 0 or num_segs == 0:
        return out
    group = num_heads // kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))
    assert block_d <= 256, "head_dim above 256 is not supported"
    wide = q.element_size() >= 4
    dot_prec = "ieee" if q.dtype == torch.float32 else "tf32"
    qk_scale = float(scale) * _LOG2E
    common = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
              v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), page_table.stride(0))

    selected = block_sel is not None
    if selected:
        assert qsa_ratio > 0, "block_sel needs qsa_ratio > 0"
        assert block_sel.shape[0] == tokens and block_sel.stride(-1) == 1
    tile_below = min(qsa_tile_below, _QSA_TILE_MAX_BLOCKS * qsa_ratio) if selected and max_seqlen_q > 1 else 0
    if max_seqlen_q > 1 and (not selected or tile_below > 0):
        block_m, block_n, warps, stages = (_TILE_CONFIGS_32BIT if wide else _TILE_CONFIGS_16BIT)[block_d]
        bm, stride_bm = kv_lens, 0
        if selected:
            # Block mask [blocks + 1, T]: byte (b, t) is set when row t selected complete block b. Entries
            # that are empty or name blocks past tile_below land in the spare last block row, which covers
            # keys at or past tile_below only, where the tile kernel never looks.
            blocks = triton.cdiv(tile_below, qsa_ratio)
            sel = block_sel.long()
            sel = torch.where((sel >= 0) & (sel < blocks), sel, blocks)
            bm = torch.zeros(blocks + 1, tokens, dtype=torch.uint8, device=q.device)
            bm.scatter_(0, sel.t(), 1)
            stride_bm = bm.stride(0)
        grid = (num_heads, triton.cdiv(max_seqlen_q, block_m), num_segs)
        _tile_kernel[grid](
            q, k_cache, v_cache, out, g, page_table, cu_seqlens_q, kv_lens, bm, qk_scale, tile_below,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), stride_gt, stride_gh, *common, stride_bm,
            GROUP=group, PAGE=page_size, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
            DOT_PREC=dot_prec, HAS_GATE=gate is not None, SELECTED=selected, RATIO=max(qsa_ratio, 1),
            num_warps=warps, num_stages=stages,
        )
        if not selected and tokens == num_segs * max_seqlen_q:  # only multi-row segments: no decodes
            return out

    block_n, warps, stages = (_ROW_CONFIGS_32BIT if wide else _ROW_CONFIGS_16BIT)[block_d]
    if selected:
        topk = block_sel.shape[1]
        slots, ratio, sel, stride_sel = tokens, qsa_ratio, block_sel, block_sel.stride(0)
        max_tiles = triton.cdiv((topk + 1) * ratio, block_n)
    else:
        topk, ratio, sel, stride_sel = 0, 1, kv_lens, 0
        slots = num_segs
        max_tiles = _MAX_SPLITS  # decode context length is a device value; empty splits exit early
    if num_splits is not None:
        splits = num_splits
    elif selected and max_seqlen_q > 1:
        # Prompt rows run unsplit: a split's merge sums in another order, so a row would give other bits
        # in a short chunk (chunked prefill, the rest after a prefix-cache hit) than in the whole prompt.
        splits = 1
    else:
        splits = _pick_splits(slots * kv_heads, max_tiles, q.device)
    search_iters = num_segs.bit_length()  # >= ceil(log2(num_segs)) halvings of [0, num_segs)
    if splits > 1:
        part_o = torch.empty(slots * num_heads * splits * block_d, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(slots * num_heads * splits, dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out  # unused
    _row_kernel[(slots, kv_heads, splits)](
        q, k_cache, v_cache, out, g, part_o, part_lse, page_table, cu_seqlens_q, kv_lens, sel,
        qk_scale, num_segs, search_iters, splits, tile_below,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), stride_gt, stride_gh, *common, stride_sel,
        GROUP=group, PAGE=page_size, HEAD_DIM=head_dim, SELECTED=selected, RATIO=ratio, TOPK=topk,
        SPLIT=splits > 1, BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n, BLOCK_D=block_d,
        DOT_PREC=dot_prec, HAS_GATE=gate is not None, num_warps=warps, num_stages=stages,
    )
    if splits > 1:
        _combine_kernel[(slots, num_heads)](
            out, g, part_o, part_lse, cu_seqlens_q, kv_lens, num_segs, search_iters, splits, tile_below,
            out.stride(0), out.stride(1), stride_gt, stride_gh, SELECTED=selected, HEAD_DIM=head_dim,
            BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=block_d, HAS_GATE=gate is not None, num_warps=4,
        )
    return out


__all__ = ["paged_attention"]
