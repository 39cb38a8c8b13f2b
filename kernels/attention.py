"""Paged attention of packed segments, dense causal or QSA-selected: the torch reference.

QSA (the query-sparse attention indexer) lets each query attend only to its selected complete
blocks of ``ratio`` keys plus the incomplete tail block it sits in; the layer scores and picks the
blocks (``kernels/qsa.py``), and the attention takes them as ``block_sel``. The Triton kernel
(``attention_triton``) computes the same on a GPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .backend import use_triton


def causal_mask(q_pos: torch.Tensor, kv_len: int) -> torch.Tensor:
    keys = torch.arange(kv_len, device=q_pos.device)
    return keys.unsqueeze(0) <= q_pos.unsqueeze(1)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """``softmax(q k^T * scale + mask) v`` with GQA.

    Args: q ``[L, H, d]``, k/v ``[S, Hkv, d]``, mask bool ``[L, S]``. Returns ``[L, H, d]``.
    """
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
        attn_mask=mask.unsqueeze(0).unsqueeze(0), scale=scale,
    )
    return out[0].transpose(0, 1)


# Query rows per masked_attention call in paged_attention_ref; bounds the [tile, kv_len] masks and scores.
_REF_QUERY_TILE = 512


def selected_block_mask(block_sel: torch.Tensor, q_pos: torch.Tensor, kv_len: int, ratio: int) -> torch.Tensor:
    """Bool ``[L, kv_len]`` mask of the keys QSA lets each query see, built from explicit block choices.

    ``block_sel`` ``[L, K]`` holds indices of complete blocks of ``ratio`` keys (``-1`` = empty entry);
    each query also sees its incomplete tail block ``[((p+1)//ratio)*ratio, p]``. Entries naming a block
    that is not complete at the query (``b >= (p+1)//ratio``) are ignored, as the kernel ignores them.
    """
    length = block_sel.shape[0]
    device = block_sel.device
    n_complete = torch.div(q_pos + 1, ratio, rounding_mode="floor")
    num_blocks = kv_len // ratio
    sel = block_sel.long()
    valid = (sel >= 0) & (sel < n_complete.unsqueeze(1))
    hit = torch.zeros(length, num_blocks + 1, dtype=torch.bool, device=device)
    hit.scatter_(1, torch.where(valid, sel, num_blocks), True)  # invalid entries land in the spare column
    mask = torch.zeros(length, kv_len, dtype=torch.bool, device=device)
    mask[:, : num_blocks * ratio] = hit[:, :num_blocks].repeat_interleave(ratio, dim=1)
    keys = torch.arange(kv_len, device=device)
    tail = (keys.unsqueeze(0) >= (n_complete * ratio).unsqueeze(1)) & (keys.unsqueeze(0) <= q_pos.unsqueeze(1))
    return mask | tail


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                        cu_seqlens_q: torch.Tensor, kv_lens: torch.Tensor, scale: float, *,
                        block_sel: torch.Tensor | None = None, qsa_ratio: int = 0,
                        gate: torch.Tensor | None = None) -> torch.Tensor:
    """Causal (or QSA-selected) attention of packed query segments over a paged KV cache.

    The CPU path and the oracle of ``attention_triton.paged_attention`` (same arguments, minus the
    launch hint ``max_seqlen_q``). It loops over segments on the host, so it syncs; the kernel does not.

    Args:
        q: ``[T, H, D]``; segment ``i`` owns rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]``.
        k_cache, v_cache: ``[num_pages, page_size, Hkv, D]``; position ``p`` of segment ``i`` lives in page
            ``page_table[i, p // page_size]``, row ``p % page_size``.
        page_table: int ``[N, max_pages]``.
        cu_seqlens_q: int ``[N + 1]``.
        kv_lens: int ``[N]``: keys of segment ``i``; its row ``j`` sits at ``kv_lens[i] - L_i + j``.
        scale: multiplies ``q · k``.
        block_sel: optional int ``[T, K]`` selected complete blocks per row (``-1`` = empty); with it each
            row sees only its selected blocks of ``qsa_ratio`` keys plus its tail (see ``selected_block_mask``).
        gate: optional ``[T, H, D]`` output gate (any strides, unit stride in D): the result is multiplied by
            ``sigmoid(gate)`` in q's dtype, the gated attention's output gate.
    Returns ``[T, H, D]`` in q's dtype, computed in fp32.
    """
    if block_sel is not None and qsa_ratio <= 0:
        raise ValueError("block_sel needs qsa_ratio > 0")
    out = torch.empty_like(q)
    page_size, kv_heads, head_dim = k_cache.shape[1:]
    k_flat = k_cache.reshape(-1, kv_heads, head_dim)
    v_flat = v_cache.reshape(-1, kv_heads, v_cache.shape[-1])
    bounds = cu_seqlens_q.tolist()
    lens = kv_lens.tolist()
    for i, kv_len in enumerate(lens):
        row0, row1 = bounds[i], bounds[i + 1]
        length = row1 - row0
        if length == 0:
            continue
        pos = torch.arange(kv_len, device=q.device)
        slots = page_table[i, pos // page_size].long() * page_size + pos % page_size
        keys, values = k_flat[slots].float(), v_flat[slots].float()
        q_pos = pos[kv_len - length:]
        for lo in range(0, length, _REF_QUERY_TILE):
            hi = min(lo + _REF_QUERY_TILE, length)
            visible = kv_len - length + hi  # keys up to the tile's last query position
            if block_sel is None:
                mask = causal_mask(q_pos[lo:hi], visible)
            else:
                mask = selected_block_mask(block_sel[row0 + lo:row0 + hi], q_pos[lo:hi], visible, qsa_ratio)
            out[row0 + lo:row0 + hi] = masked_attention(
                q[row0 + lo:row0 + hi].float(), keys[:visible], values[:visible], mask, scale
            ).to(q.dtype)
    return out if gate is None else out * torch.sigmoid(gate)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, kv_lens: torch.Tensor, scale: float, *,
                    block_sel: torch.Tensor | None = None, qsa_ratio: int = 0, gate: torch.Tensor | None = None,
                    max_seqlen_q: int) -> torch.Tensor:
    """The Triton kernel on a GPU (``attention_triton.paged_attention``), else :func:`paged_attention_ref`."""
    if use_triton(q, "attention"):
        from .attention_triton import paged_attention as triton_attention

        return triton_attention(q, k_cache, v_cache, page_table, cu_seqlens_q, kv_lens, scale, block_sel=block_sel,
                                qsa_ratio=qsa_ratio, gate=gate, max_seqlen_q=max_seqlen_q)
    return paged_attention_ref(q, k_cache, v_cache, page_table, cu_seqlens_q, kv_lens, scale, block_sel=block_sel,
                               qsa_ratio=qsa_ratio, gate=gate)
