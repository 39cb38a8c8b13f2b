"""A decode graph's per-row tensors in one launch (imported for CUDA tensors, and on the CPU by the tests
under ``TRITON_INTERPRET=1``).

A decode step replayed from a CUDA graph derives everything its forward needs from five numbers a row
(token id, position, slot, fresh, rotary shift) and the slot tables on the device: ``DecodeGraphs._forward_batch``
spells it out in torch, about fifty small kernels of a microsecond or two each. Here one program a row
computes the same values:

* the token id (``-1`` reads the slot's ``last_ids`` entry), the fresh flag, ``position + 1``;
* the row's page table (the slot's row of ``slot_pages``) and the KV row its token is written to;
* the n-gram context before the token (the end-of-text id throughout for a fresh row), and the slot's
  context moved on by the token (the forward reads only the former);
* rotary cos and sin of the position plus the row's shift, rounded to the model's dtype (``Rotary.cos_sin``);
* for QSA: the KV rows of the block that ends at the token, its first position plus the shift (what its pooled
  key is turned by), and the KV row of every block's pooled key.

Padding rows share one slot; they are fresh with token 0, so whatever order their programs run in
they write the same values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .pdl_triton import pdl_enter


@triton.jit
def _decode_prep_kernel(inputs_ptr, stride_in, last_ids_ptr, slot_pages_ptr, stride_sp, max_pages, page_size,
                        ids_ptr, fresh_ptr, table_ptr, stride_t, kv_rows_ptr, kv_lens_ptr,
                        ctx_state_ptr, stride_cs, ctx_ptr, stride_c, width, eos,
                        inv_freq_ptr, cos_ptr, sin_ptr, stride_r, rot,
                        new_rows_ptr, stride_nr, new_pos_ptr, key_rows_ptr, stride_kr, blocks, ratio,
                        BLOCK_P: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_ROT: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    t = tl.program_id(0)
    token = tl.load(inputs_ptr + t)
    pos = tl.load(inputs_ptr + stride_in + t)
    slot = tl.load(inputs_ptr + 2 * stride_in + t)
    fresh = tl.load(inputs_ptr + 3 * stride_in + t) != 0
    shift = tl.load(inputs_ptr + 4 * stride_in + t)
    token = tl.where(token < 0, tl.load(last_ids_ptr + slot), token)
    tl.store(ids_ptr + t, token)
    tl.store(fresh_ptr + t, fresh)
    tl.store(kv_lens_ptr + t, (pos + 1).to(tl.int32))
    pages = slot_pages_ptr + slot * stride_sp
    tl.store(kv_rows_ptr + t, tl.load(pages + pos // page_size).to(tl.int64) * page_size + pos % page_size)
    for p0 in range(0, max_pages, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        tl.store(table_ptr + t * stride_t + p, tl.load(pages + p, mask=p < max_pages), mask=p < max_pages)
    if BLOCK_W > 0:
        w = tl.arange(0, BLOCK_W)
        wmask = w < width
        state = ctx_state_ptr + slot * stride_cs
        ctx = tl.where(fresh, eos, tl.load(state + w, mask=wmask, other=0))
        # The slot's context after this token: the last width - 1 ids of this one, then the token.
        after = tl.where(fresh, eos, tl.load(state + w + 1, mask=w + 1 < width, other=0))
        after = tl.where(w + 1 < width, after, token)
        tl.debug_barrier()  # every thread has read the slot's context before any overwrites it
        tl.store(ctx_ptr + t * stride_c + w, ctx, mask=wmask)
        tl.store(state + w, after, mask=wmask)
    if BLOCK_ROT > 0:
        r = tl.arange(0, BLOCK_ROT)
        rmask = r < rot
        freqs = (pos + shift).to(tl.float32) * tl.load(inv_freq_ptr + r % (rot // 2), mask=rmask, other=0.0)
        dt = cos_ptr.dtype.element_ty
        tl.store(cos_ptr + t * stride_r + r, tl.cos(freqs).to(dt), mask=rmask)
        tl.store(sin_ptr + t * stride_r + r, tl.sin(freqs).to(dt), mask=rmask)
    if BLOCK_R > 0:
        first = pos - (ratio - 1)
        i = tl.arange(0, BLOCK_R)
        bpos = tl.maximum(first + i, 0)
        imask = i < ratio
        page = tl.load(pages + bpos // page_size, mask=imask, other=0).to(tl.int64)
        tl.store(new_rows_ptr + t * stride_nr + i, page * page_size + bpos % page_size, mask=imask)
        tl.store(new_pos_ptr + t, tl.maximum(first, 0) + shift)
        for b0 in range(0, blocks, BLOCK_B):
            b = b0 + tl.arange(0, BLOCK_B)
            bmask = b < blocks
            last = (b + 1) * ratio - 1
            key_page = tl.load(pages + tl.minimum(last // page_size, max_pages - 1), mask=bmask, other=0).to(tl.int64)
            tl.store(key_rows_ptr + t * stride_kr + b, key_page * page_size + last % page_size, mask=bmask)


def decode_prep(inputs: torch.Tensor, last_ids: torch.Tensor, slot_pages: torch.Tensor, page_size: int,
                ngram_state: torch.Tensor, eos: int, inv_freq: torch.Tensor | None, dtype: torch.dtype,
                ratio: int, blocks: int) -> dict[str, torch.Tensor]:
    """The per-row tensors of a decode step of ``inputs [5, b]`` rows (token id, position, slot, fresh, rotary
    shift):
    ``ids``, ``fresh``, ``kv_lens`` (int32), ``page_table`` (int32 ``[b, max_pages]``), ``kv_rows``,
    ``ngram_context`` (``[b, width]``; the slots' contexts in ``ngram_state`` move on by the rows'
    tokens), ``cos``/``sin`` (``[b, rotary_dim]`` in ``dtype``; none without ``inv_freq``) and, with a
    QSA ``ratio``, ``new_rows [b, ratio]``, ``new_pos`` and ``key_rows [b, blocks]``."""
    b = inputs.shape[1]
    dev = inputs.device
    assert inputs.dtype == torch.long and inputs.stride(1) == 1 and slot_pages.dtype == torch.int32
    max_pages = slot_pages.shape[1]
    width = ngram_state.shape[1]
    rot = 0 if inv_freq is None else 2 * inv_freq.shape[0]
    long = dict(dtype=torch.long, device=dev)
    out = dict(ids=torch.empty(b, **long), fresh=torch.empty(b, dtype=torch.bool, device=dev),
               kv_lens=torch.empty(b, dtype=torch.int32, device=dev),
               page_table=torch.empty(b, max_pages, dtype=torch.int32, device=dev), kv_rows=torch.empty(b, **long),
               ngram_context=torch.empty(b, width, **long))
    cos = sin = new_rows = new_pos = key_rows = torch.empty(0, **long)
    if rot:
        cos, sin = torch.empty(b, rot, dtype=dtype, device=dev), torch.empty(b, rot, dtype=dtype, device=dev)
        out.update(cos=cos, sin=sin)
    if ratio:
        new_rows, new_pos = torch.empty(b, ratio, **long), torch.empty(b, **long)
        key_rows = torch.empty(b, blocks, **long)
        out.update(new_rows=new_rows, new_pos=new_pos, key_rows=key_rows)
    if b:
        pow2 = triton.next_power_of_2
        _decode_prep_kernel[(b,)](
            inputs, inputs.stride(0), last_ids, slot_pages, slot_pages.stride(0), max_pages, page_size,
            out["ids"], out["fresh"], out["page_table"], out["page_table"].stride(0), out["kv_rows"], out["kv_lens"],
            ngram_state, ngram_state.stride(0), out["ngram_context"], max(1, width), width, eos,
            inv_freq if rot else cos, cos, sin, max(1, rot), rot,
            new_rows, max(1, ratio), new_pos, key_rows, max(1, blocks), blocks, ratio,
            BLOCK_P=min(1024, pow2(max_pages)), BLOCK_W=pow2(width) if width else 0, BLOCK_ROT=pow2(rot) if rot else 0,
            BLOCK_R=pow2(ratio) if ratio else 0, BLOCK_B=min(1024, pow2(max(1, blocks))), num_warps=4,
            **pdl.launch_args(inputs))
    return out
