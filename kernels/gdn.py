"""Gated delta rule (Gated DeltaNet), torch reference.

State per value head is ``S ∈ R^{dk x dv}`` (fp32). For each token::

    S = exp(g) * S
    S = S + k ⊗ (beta * (v - S^T k))
    o = S^T q / sqrt(dk)

``chunk_gated_delta_rule`` computes the same recurrence in chunks of ``chunk_size`` tokens with the
WY/UT transform; ``recurrent_gated_delta_rule`` steps one token for a batch of sequences (decode).
Inputs arrive already l2-normalised and expanded to the value-head count.

``gdn_decode_ref`` is the decode step as the serving path runs it: raw q/k (normalised and expanded
inside), the recurrent state read from and written back to a slot pool. ``gdn_decode_triton`` holds
its fused kernel. ``gdn_gates`` forms a layer's log decay and update gate from its projections
(``gdn_gates_triton`` on the GPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .backend import use_triton
from .common import l2_norm


def gdn_gates_ref(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(g, beta)``: log decay ``-exp(A_log) * softplus(a + dt_bias)`` in fp32 and update gate
    ``sigmoid(b)`` in b's dtype, from the ``in_proj_a`` / ``in_proj_b`` outputs ``[T, Hv]``."""
    return -a_log.float().exp() * F.softplus(a.float() + dt_bias), b.sigmoid()


def gdn_gates(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`gdn_gates_ref`; one Triton launch on the GPU."""
    if use_triton(a, "gdn_gates"):
        from .gdn_gates_triton import gdn_gates as triton_gates

        return triton_gates(a, b, a_log, dt_bias)
    return gdn_gates_ref(a, b, a_log, dt_bias)


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, state: torch.Tensor | None,
                           chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence.

    Args:
        q, k: ``[L, H, dk]``; v: ``[L, H, dv]``; g (log decay, <= 0) and beta: ``[L, H]``.
        state: ``[H, dk, dv]`` fp32 or ``None`` for zeros.
    Returns ``(o [L, H, dv] in v's dtype, final state [H, dk, dv] fp32)``.
    """
    out_dtype = v.dtype
    length, heads, dk = k.shape
    dv = v.shape[-1]
    q, k, v = (x.transpose(0, 1).float() for x in (q, k, v))  # [H, L, d]
    g, beta = (x.transpose(0, 1).float() for x in (g, beta))  # [H, L]
    q = q * dk ** -0.5
    pad = (-length) % chunk_size
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (length + pad) // chunk_size
    q, k, v = (x.reshape(heads, n, chunk_size, -1) for x in (q, k, v))
    g, beta = (x.reshape(heads, n, chunk_size) for x in (g, beta))

    k_beta = k * beta.unsqueeze(-1)
    v_beta = v * beta.unsqueeze(-1)
    gc = g.cumsum(-1)  # log decay from chunk start through each row
    future = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    decay = (gc.unsqueeze(-1) - gc.unsqueeze(-2)).masked_fill(future, float("-inf")).exp()
    # (I + strictly_lower(diag(beta) K K^T ∘ decay)) is unit lower triangular; solving it folds
    # the chunk's sequential delta updates into matmuls.
    system = (k_beta @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * gc.exp().unsqueeze(-1), upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * gc.exp().unsqueeze(-1)
    k_to_end = k * (gc[..., -1:] - gc).exp().unsqueeze(-1)
    chunk_decay = gc[..., -1].exp()[..., None, None]

    s = torch.zeros(heads, dk, dv, dtype=torch.float32, device=q.device) if state is None else state.float()
    out = torch.empty_like(u)
    for i in range(n):
        v_new = u[:, i] - w[:, i] @ s
        out[:, i] = q_decayed[:, i] @ s + intra[:, i] @ v_new
        s = s * chunk_decay[:, i] + k_to_end[:, i].transpose(-1, -2) @ v_new
    out = out.reshape(heads, -1, dv)[:, :length].transpose(0, 1).contiguous().to(out_dtype)
    return out, s


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of ``B`` sequences.

    Args:
        q, k: ``[B, H, dk]``; v: ``[B, H, dv]``; g, beta: ``[B, H]``; state ``[B, H, dk, dv]`` fp32.
    Returns ``(o [B, H, dv], new state [B, H, dk, dv] fp32)``.
    """
    out_dtype = v.dtype
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    q = q * q.shape[-1] ** -0.5
    s = state.float() * g.exp()[..., None, None]
    memory = (s * k.unsqueeze(-1)).sum(-2)
    delta = (v - memory) * beta.unsqueeze(-1)
    s = s + k.unsqueeze(-1) * delta.unsqueeze(-2)
    out = (s * q.unsqueeze(-1)).sum(-2)
    return out.to(out_dtype), s


def gdn_decode_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state_pool: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
    """One decode token per request against the recurrent states of a slot pool, updated in place.

    The torch statement of what the fused decode kernel does, so that kernel has an oracle built
    from :func:`recurrent_gated_delta_rule` itself.

    Args:
        q, k: ``[B, Hk, dk]`` raw (this l2-normalises them in fp32, eps 1e-6, and scales q by
            ``dk^-0.5``); value head ``h`` reads key head ``h // (Hv // Hk)``.
        v: ``[B, Hv, dv]``; g: ``[B, Hv]`` fp32 log decay (<= 0); beta: ``[B, Hv]``.
        state_pool: ``[S, Hv, dk, dv]`` fp32; ``state_pool[slots[b]]`` is read (zeros where
            ``fresh[b]``) and overwritten with the new state. Slots must be distinct.
        slots: int ``[B]``; fresh: bool ``[B]``.
    Returns ``[B, Hv, dv]`` in ``v``'s dtype.
    """
    group = v.shape[1] // k.shape[1]
    q, k = l2_norm(q.float()), l2_norm(k.float())
    if group > 1:  # each q/k head serves `group` consecutive value heads
        q = q.repeat_interleave(group, dim=1)
        k = k.repeat_interleave(group, dim=1)
    slots = slots.long()
    state = state_pool.index_select(0, slots).masked_fill(fresh.view(-1, 1, 1, 1), 0)
    out, state = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    state_pool.index_copy_(0, slots, state.to(state_pool.dtype))
    return out
