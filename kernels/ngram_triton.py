"""Triton kernel of the hashed n-gram ids of a flat batch (see ``ngram.ngram_ids_varlen``).

Imported only for CUDA tensors (and on the CPU by the tests, under ``TRITON_INTERPRET=1``). One program
per ``BLOCK_R`` rows: each row walks back at most ``W = ngram_size - 1`` ids, from its own segment's
tokens or, before the segment's start, from the segment's context row, stopping at an EOS (an id whose
n-gram would cross an EOS is replaced by the EOS, as :func:`ngram.shift_within_segment` does), and writes
every head's table row: ``(xor of id_p * m_p over the order's ids) mod size + offset``. One launch in
place of the reference's few dozen element-wise passes. Integer arithmetic only, so the result equals
the reference exactly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _ngram_ids_kernel(ctx_ptr, tok_ptr, seg_ptr, cu_ptr, mult_ptr, size_ptr, off_ptr, out_ptr,
                      num_rows, eos, stride_c, stride_o,
                      NGRAM: tl.constexpr, HEADS_PER_NGRAM: tl.constexpr, BLOCK_R: tl.constexpr,
                      BLOCK_H: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = rows < num_rows
    seg = tl.load(seg_ptr + rows, mask=ok, other=0).to(tl.int64)
    local = rows - tl.load(cu_ptr + seg, mask=ok, other=0)
    heads = tl.arange(0, BLOCK_H)
    h_ok = heads < HEADS_PER_NGRAM
    mixed = tl.load(tok_ptr + rows, mask=ok, other=0).to(tl.int64) * tl.load(mult_ptr).to(tl.int64)
    valid = ok  # no EOS among the ids walked back so far
    for p in tl.static_range(1, NGRAM):
        from_tokens = local >= p
        ctx_col = NGRAM - 1 + local - p  # the context row holds the W ids before the segment's start
        prev = tl.where(
            from_tokens,
            tl.load(tok_ptr + rows - p, mask=ok & from_tokens, other=0).to(tl.int64),
            tl.load(ctx_ptr + seg * stride_c + ctx_col, mask=ok & (ctx_col >= 0) & ~from_tokens, other=0).to(tl.int64),
        )
        shifted = tl.where(valid, prev, eos)
        valid = valid & (prev != eos)
        mixed = mixed ^ (shifted * tl.load(mult_ptr + p).to(tl.int64))
        # n-gram order p + 1 (ids 0..p) is complete: its heads' rows.
        cols = (p - 1) * HEADS_PER_NGRAM + heads
        sizes = tl.load(size_ptr + cols, mask=h_ok, other=1).to(tl.int64)
        offsets = tl.load(off_ptr + cols, mask=h_ok, other=0).to(tl.int64)
        ids = mixed[:, None] % sizes[None, :] + offsets[None, :]
        tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_o + cols[None, :], ids,
                 mask=ok[:, None] & h_ok[None, :])


def ngram_ids_varlen(context: torch.Tensor, tokens: torch.Tensor, row_segment: torch.Tensor,
                     cu_seqlens: torch.Tensor, eos: int, multipliers: torch.Tensor, head_vocab_sizes: torch.Tensor,
                     head_offsets: torch.Tensor, heads_per_ngram: int) -> torch.Tensor:
    """Triton form of :func:`tidal.kernels.ngram.ngram_ids_varlen_ref` (same arguments and result)."""
    ngram_size = multipliers.shape[0]
    total = tokens.shape[0]
    out = torch.empty(total, (ngram_size - 1) * heads_per_ngram, dtype=torch.long, device=tokens.device)
    if total == 0 or out.shape[1] == 0:
        return out
    context = context.contiguous()
    block_r = 64
    _ngram_ids_kernel[(triton.cdiv(total, block_r),)](
        context, tokens.contiguous(), row_segment.contiguous(), cu_seqlens.contiguous(), multipliers.contiguous(),
        head_vocab_sizes.contiguous(), head_offsets.contiguous(), out, total, eos, context.stride(0), out.stride(0),
        NGRAM=ngram_size, HEADS_PER_NGRAM=heads_per_ngram, BLOCK_R=block_r,
        BLOCK_H=max(2, triton.next_power_of_2(heads_per_ngram)), num_warps=4,
    )
    return out
