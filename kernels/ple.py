"""PLE's per-stream gate of the n-gram value, torch reference and dispatcher.

A PLE layer scales its n-gram value ``v [T, hidden]`` per stream ``s`` by
``sigmoid(signsqrt(<norm_key(k)_s, q_s> / sqrt(hidden)))``, where ``k`` is the key projection
``[T, hc * hidden]`` and ``q`` the query-normalised streams, and normalises the result for its
dilated conv. ``ple_gate_triton`` does it all in one pass per (row, stream) on the GPU.
"""

from __future__ import annotations

import math

import torch

from .backend import use_triton
from .common import MAX_WIDTH
from .norm import rms_norm_ref


def ple_gate_ref(key_raw: torch.Tensor, query: torch.Tensor, value: torch.Tensor, key_weight: torch.Tensor,
                 conv_weight: torch.Tensor, hc: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gated, normed)``, both ``[T, hc * hidden]``: the gated value of every stream and its conv norm.

    ``key_raw``: the key projection ``[T, hc * hidden]``; ``query``: ``norm_query(streams)`` ``[T, hc * hidden]``;
    ``value`` ``[T, hidden]``; ``key_weight`` / ``conv_weight``: the ``[hc * hidden]`` weights of the key
    and conv norms (grouped by stream, scale ``1 + weight``); ``eps``: both norms' epsilon (the config's
    ``rms_norm_eps``).
    """
    hidden = value.shape[-1]
    key = rms_norm_ref(key_raw, key_weight, eps, group_size=hidden).unflatten(-1, (hc, hidden))
    gate = (key * query.unflatten(-1, (hc, hidden))).sum(dim=-1, keepdim=True) / math.sqrt(hidden)
    gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
    gated = (torch.sigmoid(gate) * value.unsqueeze(-2)).flatten(-2)
    return gated, rms_norm_ref(gated, conv_weight, eps, group_size=hidden)


def ple_gate(key_raw: torch.Tensor, query: torch.Tensor, value: torch.Tensor, key_weight: torch.Tensor,
             conv_weight: torch.Tensor, hc: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`ple_gate_ref`, by one Triton pass for CUDA tensors of one dtype with unit feature strides and
    stream slices of at most :data:`~tidal.kernels.common.MAX_WIDTH` features."""
    if (use_triton(value, "ple") and key_raw.dtype == query.dtype == value.dtype and value.shape[-1] <= MAX_WIDTH
            and all(t.stride(-1) == 1 for t in (key_raw, query, value))):
        from .ple_triton import ple_gate_triton

        return ple_gate_triton(key_raw, query, value, key_weight, conv_weight, hc, eps)
    return ple_gate_ref(key_raw, query, value, key_weight, conv_weight, hc, eps)


__all__ = ["ple_gate", "ple_gate_ref"]


def gather_rows(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``table[ids]`` on ``ids``' device: for CUDA ids one Triton launch that reads the rows where ``table`` is,
    device or pinned host memory (``ple_triton.gather_rows_triton``, no host sync); else ``index_select``."""
    if use_triton(ids, "ple_gather"):
        from .ple_triton import gather_rows_triton

        return gather_rows_triton(table, ids)
    flat = ids.reshape(-1).to(table.device)
    return table.index_select(0, flat).view(*ids.shape, table.shape[1]).to(ids.device)
