"""Gated DeltaNet mixer with its conv window and recurrent state held in state slots."""

from __future__ import annotations

import torch
from torch import nn

from ...config.model import ModelConfig
from ...kernels.backend import use_triton
from ...kernels.conv import causal_conv1d_update, causal_conv1d_varlen, conv_windows
from ...kernels.gdn import gdn_gates
from ...kernels.gdn_varlen import gdn_decode, gdn_decode_step, gdn_prefill
from ...kernels.gemv import linear
from ...kernels.norm import gated_rms_norm
from ..distributed import split
from ..forward_batch import ForwardBatch
from .linear import Linear, StackedWeight


class GatedDeltaNet(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        # This rank's heads (all of them without tensor parallelism).
        self.num_k_heads = split(c.linear_num_key_heads, "linear_num_key_heads")[1]
        self.num_v_heads = split(c.linear_num_value_heads, "linear_num_value_heads")[1]
        self.head_k_dim, self.head_v_dim = c.linear_key_head_dim, c.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
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
        self._in_proj = StackedWeight(self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)

    def _split_heads(self, conv_out: torch.Tensor):
        """Raw q, k ``[rows, Hk, dk]`` and v ``[rows, Hv, dv]`` (the kernels l2-normalise q and k)."""
        q, k, v = torch.split(conv_out, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return (q.unflatten(-1, (self.num_k_heads, self.head_k_dim)),
                k.unflatten(-1, (self.num_k_heads, self.head_k_dim)),
                v.unflatten(-1, (self.num_v_heads, self.head_v_dim)))

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        if use_triton(x, "stacked"):  # the four input projections as one GEMM
            qkv, z, b, a = self._in_proj.split(linear(x, self._in_proj.get()))
        else:
            qkv, z, b, a = self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)
        conv_slots = batch.states.gdn_conv[self.layer_idx]
        rec_slots = batch.states.gdn_state[self.layer_idx]
        weight = self.conv1d.weight[:, 0, :]
        d, p = batch.decode, batch.prefill
        if batch.decode_only and d.num_rows:  # generated-token decodes only: the conv, then one step kernel
            conv = causal_conv1d_update(qkv, conv_slots, weight, d.slots, d.fresh)
            out = gdn_decode_step(conv, z, b, a, self.A_log, self.dt_bias, self.norm.weight, self.eps, self.gate_act,
                                  rec_slots, d.slots, d.fresh)
            return linear(out, self.out_proj.weight)
        g, beta = gdn_gates(a, b, self.A_log, self.dt_bias)
        parts = []  # the core output of the decode rows, then of the prefill rows (their order in x)
        if d.num_rows:
            conv = causal_conv1d_update(qkv[d.rows], conv_slots, weight, d.slots, d.fresh)
            q, k, v = self._split_heads(conv)
            parts.append(gdn_decode(q, k, v, g[d.rows], beta[d.rows], rec_slots, d.slots, d.fresh))
        if p.num_rows:
            parts.append(self._prefill(qkv[p.rows], g[p.rows], beta[p.rows], conv_slots, rec_slots, weight, batch))
        if len(parts) == 1:
            core = parts[0]
        else:
            core = torch.cat(parts) if parts else qkv.new_empty(0, self.num_v_heads, self.head_v_dim)
        # z is a column slice of the input projection's output: read in place, per head.
        out = gated_rms_norm(core, z.unflatten(-1, (self.num_v_heads, self.head_v_dim)), self.norm.weight, self.eps,
                             self.gate_act)
        # Under tensor parallelism a partial sum over this rank's heads: the decoder layer reduces it.
        return linear(out.reshape(x.shape[0], self.value_dim), self.out_proj.weight)

    def _prefill(self, x, g, beta, conv_slots, rec_slots, weight, batch: ForwardBatch) -> torch.Tensor:
        """Prefill rows' core output ``[rows, Hv, dv]``: conv over every segment at once, then the
        recurrence wave by wave (a batch without internal exports is one wave, whose output is used as it is).

        Waves split a segment's recurrence at its internal checkpoints (see ``forward_batch.Wave``):
        the state after each piece is exact, never recomputed.
        """
        p = batch.prefill
        # q, k and v convolved each into its own contiguous tensor (channels are independent), so the
        # chunked GDN kernel takes them as they are instead of copying three strided views. The q and k
        # convs also l2-normalise every head, so the chunked kernel does not.
        seg = batch.row_segment[p.rows] - p.seg0  # each prefill row's segment within the prefill group
        parts, lo = [], 0
        for width, l2_group in ((self.key_dim, self.head_k_dim), (self.key_dim, self.head_k_dim), (self.value_dim, 0)):
            cols = slice(lo, lo + width)
            parts.append(causal_conv1d_varlen(x[:, cols], conv_slots[:, :, cols], weight[cols], p.cu_seqlens, p.slots,
                                              p.fresh, max_seqlen=p.max_seqlen, row_segment=seg, l2_group=l2_group))
            lo += width
        # New conv windows (each segment's end, and internal checkpoints) read the old windows:
        # gather all of them before writing any.
        first = batch.decode.num_segments
        seg_index = torch.cat([torch.arange(p.num_segments, device=x.device), batch.export_seg - first])
        upto = torch.cat([p.lengths, batch.export_off])
        windows = conv_windows(x, conv_slots, p.cu_seqlens, p.slots, p.fresh, seg_index, upto)
        conv_slots[torch.cat([p.slots, batch.export_dst])] = windows
        q = parts[0].unflatten(-1, (self.num_k_heads, self.head_k_dim))
        k = parts[1].unflatten(-1, (self.num_k_heads, self.head_k_dim))
        v = parts[2].unflatten(-1, (self.num_v_heads, self.head_v_dim))
        state = rec_slots[p.slots].masked_fill(p.fresh[:, None, None, None], 0)
        core = None if batch.waves[0].rows is None else torch.empty_like(v)
        for wave in batch.waves:
            if wave.rows is None:
                core, final = gdn_prefill(q, k, v, g, beta, state, wave.cu_seqlens, wave.cu_host, wave.chunk_indices,
                                          qk_normalized=True)
                state = final
            else:
                r = wave.rows
                out, final = gdn_prefill(q[r], k[r], v[r], g[r], beta[r], state[wave.seg], wave.cu_seqlens,
                                         wave.cu_host, wave.chunk_indices, qk_normalized=True)
                core[r] = out
                state[wave.seg] = final
            if wave.export_dst.numel():
                rec_slots[wave.export_dst] = final[wave.export_piece]
        rec_slots[p.slots] = state
        return core
