"""Gated DeltaNet mixer with its conv window and recurrent state held in state slots."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...config import ModelConfig
from ...kernels import gdn as gdn_ops
from ...kernels.conv import causal_conv1d, conv_history
from ...kernels.norm import gated_rms_norm, l2_norm
from ..forward_batch import ForwardBatch, Segment
from .linear import Linear


class GatedDeltaNet(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        self.num_k_heads, self.num_v_heads = c.linear_num_key_heads, c.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = c.linear_key_head_dim, c.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = c.gdn_conv_dim
        self.kernel_size = c.linear_conv_kernel_dim
        self.eps = c.rms_norm_eps
        self.gate_act = c.output_gate_type
        self.in_proj_qkv = Linear(c.hidden_size, self.conv_dim)
        self.in_proj_z = Linear(c.hidden_size, self.value_dim)
        self.in_proj_b = Linear(c.hidden_size, self.num_v_heads)
        self.in_proj_a = Linear(c.hidden_size, self.num_v_heads)
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(self.conv_dim, 1, self.kernel_size), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads), requires_grad=False)
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.empty(self.head_v_dim), requires_grad=False)
        self.out_proj = Linear(self.value_dim, c.hidden_size)

    def _qkv_heads(self, conv_out: torch.Tensor):
        q, k, v = torch.split(conv_out, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        rows = conv_out.shape[:-1]
        q = q.reshape(*rows, self.num_k_heads, self.head_k_dim).float()
        k = k.reshape(*rows, self.num_k_heads, self.head_k_dim).float()
        v = v.reshape(*rows, self.num_v_heads, self.head_v_dim)
        q, k = l2_norm(q), l2_norm(k)
        group = self.num_v_heads // self.num_k_heads
        if group > 1:  # each q/k head serves `group` consecutive value heads
            q = q.repeat_interleave(group, dim=-2)
            k = k.repeat_interleave(group, dim=-2)
        return q, k, v

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        qkv = self.in_proj_qkv(x)
        z = self.in_proj_z(x)
        beta = self.in_proj_b(x).sigmoid()
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        core = torch.empty(x.shape[0], self.num_v_heads, self.head_v_dim, dtype=x.dtype, device=x.device)
        decodes = batch.decode_segments()
        if decodes:
            self._decode(qkv, beta, g, core, decodes, batch)
        for seg in batch.prefill_segments():
            self._prefill(qkv, beta, g, core, seg, batch)
        out = gated_rms_norm(core.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim),
                             self.norm.weight, self.eps, self.gate_act)
        return self.out_proj(out.reshape(x.shape[0], self.value_dim))

    def _prefill(self, qkv, beta, g, core, seg: Segment, batch: ForwardBatch) -> None:
        states = batch.states
        conv_slots, rec_slots = states.gdn_conv[self.layer_idx], states.gdn_state[self.layer_idx]
        weight = self.conv1d.weight[:, 0, :]
        rows = seg.rows
        x = qkv[rows]
        history = torch.zeros_like(conv_slots[seg.slot]) if seg.fresh else conv_slots[seg.slot].clone()
        state = None if seg.fresh else rec_slots[seg.slot].clone()
        q, k, v = self._qkv_heads(causal_conv1d(x, history, weight))
        # Split the recurrence at every internal export so each checkpoint is the exact state there.
        bounds = [0, *seg.split_points(), seg.length]
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            out, state = gdn_ops.chunk_gated_delta_rule(
                q[lo:hi], k[lo:hi], v[lo:hi], g[rows][lo:hi], beta[rows][lo:hi], state
            )
            core[seg.row0 + lo:seg.row0 + hi] = out
            for off, dst in seg.exports:
                if off == hi:
                    rec_slots[dst].copy_(state)
                    conv_slots[dst].copy_(conv_history(x, history, off))
        rec_slots[seg.slot].copy_(state)
        conv_slots[seg.slot].copy_(conv_history(x, history, seg.length))

    def _decode(self, qkv, beta, g, core, segs: list[Segment], batch: ForwardBatch) -> None:
        """One token for each of several requests, batched."""
        states = batch.states
        conv_slots, rec_slots = states.gdn_conv[self.layer_idx], states.gdn_state[self.layer_idx]
        slots = torch.tensor([s.slot for s in segs], device=qkv.device)
        rows = torch.tensor([s.row0 for s in segs], device=qkv.device)
        fresh = torch.tensor([s.fresh for s in segs], device=qkv.device)
        history = conv_slots[slots].masked_fill(fresh[:, None, None], 0)
        state = rec_slots[slots].masked_fill(fresh[:, None, None, None], 0)
        x = qkv[rows]
        weight = self.conv1d.weight[:, 0, :]
        window = torch.cat([history.to(x.dtype), x.unsqueeze(1)], dim=1).to(weight.dtype)  # [B, k, C]
        conv = F.silu((window * weight.t().unsqueeze(0)).sum(dim=1)).to(x.dtype)
        q, k, v = self._qkv_heads(conv)
        out, state = gdn_ops.recurrent_gated_delta_rule(q, k, v, g[rows], beta[rows], state)
        core[rows] = out
        new_history = window[:, 1:].to(conv_slots.dtype)
        rec_slots[slots] = state
        conv_slots[slots] = new_history
        for i, seg in enumerate(segs):
            for _, dst in seg.exports:
                rec_slots[dst].copy_(state[i])
                conv_slots[dst].copy_(new_history[i])
