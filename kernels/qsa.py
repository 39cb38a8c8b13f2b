"""QSA block choice: the top-k complete key blocks each query may see, from its block scores.

Only the visible blocks of a query (``b < (p + 1) // ratio``) compete. Scores are sums of ReLUs,
so exact ties (at zero) happen, and which tied block ``topk`` returns is an implementation detail
of ``torch.topk``: the reference ranks each query's visible blocks exactly as transformers does (a
top-k over just those ``n`` scores), grouping queries by ``n``, which needs the distinct counts on
the host. On the GPU the masked top-k over all blocks gives the same choice except among tied
scores, with no host sync; it serves contexts beyond what ``qsa_triton`` (scores and top-k in one
kernel, ties to the lower block) takes.
"""

from __future__ import annotations

import torch

from .backend import use_triton


def pick_blocks_ref(scores: torch.Tensor, visible: torch.Tensor, width: int) -> torch.Tensor:
    """``[..., width]`` int32 block indices (``-1`` past a query's visible count).

    Args: scores ``[..., B]`` fp32; visible ``[...]`` visible complete blocks per query.
    """
    flat = scores.reshape(-1, scores.shape[-1])
    counts = visible.reshape(-1)
    out = torch.full((flat.shape[0], width), -1, dtype=torch.int32, device=scores.device)
    for n in torch.unique(counts).tolist():
        if n <= 0:
            continue
        rows = (counts == n).nonzero().flatten()
        k = min(width, n)
        out[rows, :k] = flat[rows, :n].topk(k, dim=-1).indices.to(torch.int32)
    return out.reshape(*scores.shape[:-1], width)


def pick_blocks(scores: torch.Tensor, visible: torch.Tensor, width: int) -> torch.Tensor:
    """:func:`pick_blocks_ref`'s choice (up to ties) as one masked top-k."""
    if not use_triton(scores, "qsa"):
        return pick_blocks_ref(scores, visible, width)
    blocks = torch.arange(scores.shape[-1], device=scores.device)
    masked = scores.masked_fill(blocks >= visible[..., None], float("-inf"))
    top, idx = masked.topk(width, dim=-1)
    return torch.where(top == float("-inf"), -1, idx).to(torch.int32)
