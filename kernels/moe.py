"""Routed experts, torch reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax router: ``(weights [T, K] in logits' dtype, expert ids [T, K])``."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


def experts_forward(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, expert_weights) -> torch.Tensor:
    """``sum_k w_k * down_e(silu(gate_e(x)) * up_e(x))`` over each token's experts ``e = ids[:, k]``.

    ``expert_weights(e)`` returns ``(gate_up [2I, H], down [H, I])`` of expert ``e``; resident and
    streamed expert stores both answer it.
    """
    out = torch.zeros_like(x)
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=1).tolist()
    token_of = order // ids.shape[1]
    slot_of = order % ids.shape[1]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        tokens = token_of[start:start + count]
        slots = slot_of[start:start + count]
        start += count
        gate_up, down = expert_weights(expert)
        gate, up = F.linear(x[tokens], gate_up).chunk(2, dim=-1)
        h = F.linear(F.silu(gate) * up, down) * weights[tokens, slots, None]
        out.index_add_(0, tokens, h.to(out.dtype))
    return out
