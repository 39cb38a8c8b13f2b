"""Gated attention with QSA block selection, torch reference.

QSA (the query-sparse attention indexer) lets each query attend only to the ``budget / ratio``
highest-scoring complete blocks of ``ratio`` keys plus the incomplete tail block it sits in. A
block's index key is the mean of its raw index keys, normalised and rotated at the block's first
position; a block's score is ``sum_h relu(q_h · k_block) / sqrt(d)``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def pool_blocks(raw_keys: torch.Tensor, ratio: int) -> torch.Tensor:
    """Mean of each complete block of ``ratio`` raw index keys: ``[S, d] -> [S // ratio, d]``."""
    blocks = raw_keys.shape[0] // ratio
    pooled = raw_keys[: blocks * ratio].reshape(blocks, ratio, raw_keys.shape[-1]).float().mean(dim=1)
    return pooled.to(raw_keys.dtype)


def qsa_token_mask(index_q: torch.Tensor, block_keys: torch.Tensor, q_pos: torch.Tensor, kv_len: int,
                   ratio: int, block_topk: int) -> torch.Tensor:
    """Which keys each query may attend to.

    Args:
        index_q: ``[L, Hi, d]`` normalised, rotated index queries.
        block_keys: ``[B, d]`` normalised, rotated block keys of the complete blocks in ``[0, kv_len)``.
        q_pos: ``[L]`` absolute query positions (``< kv_len``).
    Returns a bool ``[L, kv_len]`` mask (already causal).
    """
    length = index_q.shape[0]
    device = index_q.device
    n_complete = torch.div(q_pos + 1, ratio, rounding_mode="floor")  # complete blocks visible per query
    num_blocks = block_keys.shape[0]
    block_sel = torch.zeros(length, num_blocks, dtype=torch.bool, device=device)
    if num_blocks:
        scores = torch.einsum("lhd,bd->lhb", index_q.float(), block_keys.float())
        scores = scores.relu().sum(dim=1) / math.sqrt(index_q.shape[-1])
        # Queries with the same number of visible blocks select together; top-k runs over exactly
        # the visible blocks, as a per-query selection would.
        for n in torch.unique(n_complete).tolist():
            if n == 0:
                continue
            rows = (n_complete == n).nonzero().flatten()
            if n <= block_topk:
                block_sel[rows, :n] = True
            else:
                picked = scores[rows, :n].topk(block_topk, dim=-1).indices
                block_sel[rows.unsqueeze(1), picked] = True
    mask = torch.zeros(length, kv_len, dtype=torch.bool, device=device)
    covered = num_blocks * ratio
    mask[:, :covered] = block_sel.repeat_interleave(ratio, dim=1)
    keys = torch.arange(kv_len, device=device)
    tail = (keys.unsqueeze(0) >= (n_complete * ratio).unsqueeze(1)) & (keys.unsqueeze(0) <= q_pos.unsqueeze(1))
    return mask | tail


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
