"""Triton QSA block choice: score every visible key block and take the top-k, one program per query.

Imported only for CUDA tensors (and on the CPU by the tests, under ``TRITON_INTERPRET=1``).

``_select_kernel``, grid ``(T,)``: a program takes one query row, its index queries ``[Hi, d]`` and
its segment's pooled block keys (gathered through ``key_rows``, ``BLOCK_B`` blocks at a time), forms
``sum_h relu(q_h . k_b) / sqrt(d)`` with one ``tl.dot`` a tile (fp32 accumulation of exact bf16
products: the torch path's fp32 einsum up to summation order), writes the scores of its visible
blocks to a scratch row, reads them back and sorts them (a bitonic ``tl.sort`` of keys that order by
score, then by lower block, so equal scores give the same choice every run), and writes the first
``width`` blocks, ``-1`` past the visible count. This replaces the gather of the keys, their fp32 copy,
the einsum, ReLU, head sum, mask, ``torch.topk`` and the index writes of the torch path: one launch a
layer for the whole batch.

The scratch row is ``B_PAD`` wide (the block count's next power of two), and the sort holds it in
registers, so the kernel serves up to :data:`MAX_BLOCKS` blocks (128K tokens at ratio 64, the longest
context measured; one decode row there took 59 us against the torch path's 53, eight rows 55 against
70); longer contexts take the torch path. Long prompts launch in row chunks that bound the scratch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCKS = 2048

# Rows a launch scores at most: the fp32 scratch is ``rows x B_PAD`` (64 MB at most).
_SCRATCH_ELEMENTS = 1 << 24


@triton.jit
def _select_kernel(q_ptr, keys_ptr, key_rows_ptr, row_seg_ptr, pos_ptr, scores_ptr, sel_ptr,
                   n_blocks, n_heads, head_dim, ratio, width, scale,
                   sq_t, sq_h, sk_r, skr_n, ss_t, ssel_t,
                   H_PAD: tl.constexpr, D_PAD: tl.constexpr, BLOCK_B: tl.constexpr, B_PAD: tl.constexpr,
                   IEEE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    seg = tl.load(row_seg_ptr + row)
    visible = tl.minimum((tl.load(pos_ptr + row) + 1) // ratio, n_blocks)
    h = tl.arange(0, H_PAD)
    d = tl.arange(0, D_PAD)
    dmask = d < head_dim
    q = tl.load(q_ptr + row * sq_t + h[:, None] * sq_h + d[None, :],
                mask=(h < n_heads)[:, None] & dmask[None, :], other=0.0)
    for b0 in range(0, visible, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        bmask = b < visible
        krow = tl.load(key_rows_ptr + seg * skr_n + b, mask=bmask, other=0)
        k = tl.load(keys_ptr + krow[:, None] * sk_r + d[None, :], mask=bmask[:, None] & dmask[None, :], other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        score = tl.sum(tl.maximum(s, 0.0), 0) * scale
        tl.store(scores_ptr + row * ss_t + b, score, mask=bmask)
    tl.debug_barrier()  # the scores written above are read back below, by other threads of the program
    bb = tl.arange(0, B_PAD)
    visible_b = bb < visible
    score = tl.load(scores_ptr + row * ss_t + bb, mask=visible_b, other=0.0)
    # Sort keys: the score's bits made order-preserving as signed integers (negative floats flip their
    # magnitude bits), above the block's index inverted, so a descending sort puts higher scores first
    # and, among equal scores, lower blocks first. Invisible blocks sort last.
    bits = score.to(tl.int32, bitcast=True)
    bits = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    key = (bits.to(tl.int64) << 32) | (B_PAD - 1 - bb).to(tl.int64)
    key = tl.where(visible_b, key, -(1 << 62))
    key = tl.sort(key, 0, descending=True)
    block = (B_PAD - 1 - (key & 0xFFFFFFFF)).to(tl.int32)
    block = tl.where(bb < tl.minimum(visible, width), block, -1)
    tl.store(sel_ptr + row * ssel_t + bb, block, mask=bb < width)


def qsa_select(index_q: torch.Tensor, block_keys: torch.Tensor, key_rows: torch.Tensor, row_segment: torch.Tensor,
               positions: torch.Tensor, n_blocks: int, ratio: int, width: int) -> torch.Tensor:
    """``block_sel [T, width]`` int32: per query row, its top-``width`` visible complete blocks (``b <
    (position + 1) // ratio``) by ``sum_h relu(q_h . k_b) / sqrt(d)``, best first, ``-1`` past them (``width``
    may exceed ``n_blocks`` up to its next power of two: the rest is ``-1``).

    Args: index_q ``[T, Hi, d]``; block_keys ``[rows, d]`` (the pooled block keys' cache rows);
    key_rows ``[N, >= n_blocks]`` the row of each segment's block ``b``; row_segment, positions ``[T]``.
    ``n_blocks`` at most :data:`MAX_BLOCKS`.
    """
    tokens, heads, dim = index_q.shape
    b_pad = max(16, triton.next_power_of_2(n_blocks))
    assert 0 < n_blocks <= MAX_BLOCKS and 0 < width <= b_pad
    assert block_keys.stride(1) == 1 and index_q.stride(2) == 1
    sel = torch.empty(tokens, width, dtype=torch.int32, device=index_q.device)
    if tokens == 0:
        return sel
    chunk = max(1, min(tokens, _SCRATCH_ELEMENTS // b_pad))
    scores = torch.empty(chunk, b_pad, dtype=torch.float32, device=index_q.device)
    block_b = 64 if b_pad >= 64 else b_pad
    for lo in range(0, tokens, chunk):
        hi = min(tokens, lo + chunk)
        _select_kernel[(hi - lo,)](
            index_q[lo:hi], block_keys, key_rows, row_segment[lo:hi], positions[lo:hi], scores, sel[lo:hi],
            n_blocks, heads, dim, ratio, width, dim ** -0.5,
            index_q.stride(0), index_q.stride(1), block_keys.stride(0), key_rows.stride(0), scores.stride(0),
            sel.stride(0), H_PAD=max(16, triton.next_power_of_2(heads)), D_PAD=max(16, triton.next_power_of_2(dim)),
            BLOCK_B=block_b, B_PAD=b_pad, IEEE=index_q.dtype == torch.float32, num_warps=4)
    return sel
