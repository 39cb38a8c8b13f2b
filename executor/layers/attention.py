"""Gated attention (sigmoid output gate, q/k norms, partial rotary, GQA) with the QSA indexer."""

from __future__ import annotations

import torch
from torch import nn

from ...config.model import ModelConfig
from ...kernels.attention import paged_attention
from ...kernels.backend import next_pow2, use_triton
from ...kernels.gemv import linear
from ...kernels.qsa import pick_blocks
from ..distributed import split
from ..distributed.shard import kv_heads
from ..forward_batch import ForwardBatch
from .linear import Linear, RMSNorm, StackedWeight
from .rotary import Rotary

# The Triton block choice (``kernels/qsa_triton.py``) holds a query's block scores in registers for its
# top-k: up to this many blocks (its MAX_BLOCKS, kept here so the CPU path never imports triton).
QSA_TRITON_MAX_BLOCKS = 2048


class QSAIndexer(nn.Module):
    """Per-token index keys and queries; selects complete key blocks per query."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        c = config
        self.n_heads, self.head_dim = c.indexer_n_heads, c.indexer_head_dim
        self.ratio, self.block_topk = c.indexer_compress_ratio, c.qsa_block_topk
        self.index_qk_proj = Linear(c.hidden_size, (self.n_heads + 1) * self.head_dim)
        self.q_layernorm = RMSNorm(self.head_dim, c.rms_norm_eps)
        self.k_layernorm = RMSNorm(self.head_dim, c.rms_norm_eps)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                qk: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(index queries [T, Hi, d] normalised and rotated, raw index keys [T, d])``; ``qk`` is
        ``index_qk_proj(x)`` when the caller computed it already."""
        if qk is None:
            qk = self.index_qk_proj(x)
        q, raw_k = qk.split([self.n_heads * self.head_dim, self.head_dim], dim=-1)
        q = Rotary.norm_apply(self.q_layernorm, q.reshape(-1, self.n_heads, self.head_dim), cos, sin)
        return q, raw_k

    def write_block_keys(self, layer: int, batch: ForwardBatch, rotary: Rotary) -> None:
        """Pool, normalise and rotate every block this forward completed; store each at the KV row of
        its last token (raw keys of earlier tokens of the block come from the cache)."""
        qsa, kv = batch.qsa, batch.kv
        if not qsa.new_pos.numel():
            return
        if use_triton(qsa.new_rows, "norm_rotary") and self.k_layernorm.group_size is None:
            from ...kernels.attention_rows_triton import qsa_block_keys

            device = qsa.new_rows.device
            qsa_block_keys(kv.flat(kv.index_k, layer), qsa.new_rows,
                           qsa.new_pos3 if qsa.new_pos3 is not None else qsa.new_pos, self.k_layernorm.weight,
                           self.k_layernorm.eps, rotary.inv_freq(device), kv.flat(kv.index_block_k, layer),
                           rotary.axis(device))
            return
        raw = kv.flat(kv.index_k, layer)[qsa.new_rows]  # [Mb, ratio, d]
        pooled = raw.float().mean(dim=1).to(raw.dtype)
        cos, sin = rotary.cos_sin(qsa.new_pos3 if qsa.new_pos3 is not None else qsa.new_pos, pooled.dtype)
        kv.flat(kv.index_block_k, layer)[qsa.new_rows[:, -1]] = Rotary.norm_apply(
            self.k_layernorm, pooled[:, None], cos, sin)[:, 0]

    def select(self, layer: int, index_q: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """``block_sel [T, K']``: per query row, its top-``block_topk`` visible complete blocks by
        ``sum_h relu(q_h . k_block) / sqrt(d)``, ``-1`` for empty entries (fewer visible blocks). ``K'`` is
        ``block_topk``, or below it the blocks of the batch's longest context rounded up to a power of two:
        attention compiles a variant per width, and empty entries cost it nothing."""
        qsa = batch.qsa
        width = max(1, min(self.block_topk, next_pow2(qsa.max_blocks)))
        if qsa.max_blocks and use_triton(index_q, "qsa_select") and qsa.max_blocks <= QSA_TRITON_MAX_BLOCKS:
            from ...kernels.qsa_triton import qsa_select

            return qsa_select(index_q, batch.kv.flat(batch.kv.index_block_k, layer), qsa.key_rows,
                              batch.row_segment, batch.positions, qsa.max_blocks, self.ratio, width)
        # One spare row at the end takes the writes of padding queries (no data-dependent shapes).
        sel = torch.full((index_q.shape[0] + 1, width), -1, dtype=torch.int32, device=index_q.device)
        if qsa.max_blocks:
            keys = batch.kv.flat(batch.kv.index_block_k, layer)[qsa.key_rows]  # [N, B, d]
            for group in (batch.decode, batch.prefill):
                if group.num_rows:
                    self._select_group(index_q, keys[group.seg0:group.seg0 + group.num_segments].float(), group,
                                       batch.positions, sel, min(width, qsa.max_blocks))
        return sel[:-1]

    def _select_group(self, index_q, seg_keys, group, positions, sel, width) -> None:
        # Queries of the group's segments padded to [n, L] so each segment scores its own blocks.
        length = group.max_seqlen
        local = torch.arange(length, device=index_q.device)
        rows = group.row0 + group.cu_seqlens[:-1, None].long() + local[None, :]
        dest = torch.where(local[None, :] < group.lengths[:, None], rows, sel.shape[0] - 1)
        rows = rows.clamp(max=group.row0 + group.num_rows - 1)
        pos = positions[rows]  # [n, L]
        # Bound the [n, tile, heads, B] score tensor to ~2^26 elements.
        tile = max(1, min(length, (1 << 26) // max(1, group.num_segments * self.n_heads * seg_keys.shape[1])))
        scale = self.head_dim ** -0.5
        for lo in range(0, length, tile):
            hi = min(length, lo + tile)
            q = index_q[rows[:, lo:hi]].float()  # [n, t, Hi, d]
            scores = torch.einsum("nthd,nbd->nthb", q, seg_keys).relu_().sum(dim=2) * scale
            sel[dest[:, lo:hi], :width] = pick_blocks(scores, (pos[:, lo:hi] + 1) // self.ratio, width)


class GatedAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, rotary: Rotary):
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        # This rank's query and KV heads (all of them without tensor parallelism).
        self.num_heads = split(c.num_attention_heads, "num_attention_heads")[1]
        self.num_kv_heads = kv_heads(c)[1]
        self.head_dim = c.head_dim
        self.scale = self.head_dim ** -0.5
        self.rotary = rotary
        self.q_proj = Linear(c.hidden_size, self.num_heads * self.head_dim * 2, bias=c.attention_bias)
        self.k_proj = Linear(c.hidden_size, self.num_kv_heads * self.head_dim, bias=c.attention_bias)
        self.v_proj = Linear(c.hidden_size, self.num_kv_heads * self.head_dim, bias=c.attention_bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, c.hidden_size, bias=c.attention_bias)
        self.q_norm = RMSNorm(self.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, c.rms_norm_eps)
        self.indexer = QSAIndexer(c) if c.has_qsa else None
        self._in_proj = StackedWeight(self.q_proj, self.k_proj, self.v_proj,
                                      *([self.indexer.index_qk_proj] if self.indexer else []))

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        tokens = x.shape[0]
        kv, layer = batch.kv, self.layer_idx
        if batch.rope is not None:
            cos, sin = batch.rope
        else:
            cos, sin = self.rotary.cos_sin(
                batch.rope_positions if batch.rope_positions is not None else batch.positions, x.dtype)
        index_qk = None
        if use_triton(x, "stacked") and self.q_proj.bias is None:  # q (with its gate), k, v and the index q/k: one GEMM
            q_gate, k, v, *rest = self._in_proj.split(linear(x, self._in_proj.get()))
            index_qk = rest[0] if rest else None
        else:
            q_gate, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, gate = q_gate.view(tokens, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        rows = batch.kv_write_rows
        if self._rows_kernel(x, index_qk):  # norms, rotary and the cache writes in one launch
            q, index_q = self._rows_triton(q, k, v, index_qk, cos, sin, batch)
        else:
            q = Rotary.norm_apply(self.q_norm, q, cos, sin)
            kv.flat(kv.k, layer)[rows] = Rotary.norm_apply(self.k_norm, k, cos, sin)
            kv.flat(kv.v, layer)[rows] = v
            if self.indexer is not None:
                index_q, raw_index_k = self.indexer.project(x, cos, sin, index_qk)
                kv.flat(kv.index_k, layer)[rows] = raw_index_k
        block_sel = None
        if self.indexer is not None:
            self.indexer.write_block_keys(layer, batch, self.rotary)
            block_sel = self.indexer.select(layer, index_q, batch)
        a = batch.all
        out = paged_attention(q, kv.k[layer], kv.v[layer], a.page_table, a.cu_seqlens, a.kv_lens, self.scale,
                              block_sel=block_sel, qsa_ratio=self.indexer.ratio if self.indexer else 0,
                              gate=gate, max_seqlen_q=a.max_seqlen)
        # The output gate is applied inside the attention, read where the projection wrote it (a strided view).
        # Under tensor parallelism the result is a partial sum over this rank's heads.
        return linear(out.reshape(tokens, -1), self.o_proj.weight, self.o_proj.bias)

    def _rows_kernel(self, x: torch.Tensor, index_qk: torch.Tensor | None) -> bool:
        """Whether ``kernels/attention_rows_triton`` takes the per-token work: on the GPU, with ungrouped norms
        and the index projection computed in the stacked GEMM."""
        norms = [self.q_norm, self.k_norm] + ([self.indexer.q_layernorm] if self.indexer else [])
        return (use_triton(x, "norm_rotary") and all(n.group_size is None for n in norms)
                and (self.indexer is None or index_qk is not None))

    def _rows_triton(self, q, k, v, index_qk, cos, sin, batch: ForwardBatch):
        from ...kernels.attention_rows_triton import attention_rows

        kv, layer = batch.kv, self.layer_idx
        index = None
        if self.indexer is not None:
            ix = self.indexer
            iq, ik = index_qk.split([ix.n_heads * ix.head_dim, ix.head_dim], dim=-1)
            index = (iq.view(q.shape[0], ix.n_heads, ix.head_dim), ik, (ix.q_layernorm.weight, ix.q_layernorm.eps),
                     kv.flat(kv.index_k, layer))
        return attention_rows(q, k, v, ((self.q_norm.weight, self.q_norm.eps), (self.k_norm.weight, self.k_norm.eps)),
                              cos, sin, batch.kv_write_rows, kv.flat(kv.k, layer), kv.flat(kv.v, layer), index)
