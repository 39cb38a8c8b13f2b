"""Gated attention (sigmoid output gate, q/k norms, partial rotary, GQA) with the QSA indexer."""

from __future__ import annotations

import torch
from torch import nn

from ...config import ModelConfig
from ...kernels.attention import causal_mask, masked_attention, pool_blocks, qsa_token_mask
from ..forward_batch import ForwardBatch, Segment
from .linear import Linear, RMSNorm
from .rotary import Rotary

# Queries processed per attention tile on the reference path; bounds the [tile, kv_len] masks.
QUERY_TILE = 1024


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

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(index queries [T, Hi, d] normalised and rotated, raw index keys [T, d])``."""
        qk = self.index_qk_proj(x)
        q, raw_k = qk.split([self.n_heads * self.head_dim, self.head_dim], dim=-1)
        q = Rotary.apply(self.q_layernorm(q.reshape(-1, self.n_heads, self.head_dim)), cos, sin)
        return q, raw_k

    def block_keys(self, raw_keys: torch.Tensor, rotary: Rotary) -> torch.Tensor:
        """Normalised block keys rotated at each block's first position."""
        pooled = self.k_layernorm(pool_blocks(raw_keys, self.ratio))
        starts = torch.arange(pooled.shape[0], device=raw_keys.device) * self.ratio
        cos, sin = rotary.cos_sin(starts, pooled.dtype)
        return Rotary.apply(pooled, cos, sin)


class GatedAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, rotary: Rotary):
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.scale = self.head_dim ** -0.5
        self.rotary = rotary
        self.q_proj = Linear(c.hidden_size, self.num_heads * self.head_dim * 2, bias=c.attention_bias)
        self.k_proj = Linear(c.hidden_size, self.num_kv_heads * self.head_dim, bias=c.attention_bias)
        self.v_proj = Linear(c.hidden_size, self.num_kv_heads * self.head_dim, bias=c.attention_bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, c.hidden_size, bias=c.attention_bias)
        self.q_norm = RMSNorm(self.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, c.rms_norm_eps)
        self.indexer = QSAIndexer(c) if c.has_qsa else None

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        tokens = x.shape[0]
        cos, sin = self.rotary.cos_sin(batch.positions, x.dtype)
        q, gate = self.q_proj(x).view(tokens, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        gate = gate.reshape(tokens, -1)
        q = Rotary.apply(self.q_norm(q), cos, sin)
        k = Rotary.apply(self.k_norm(self.k_proj(x).view(tokens, self.num_kv_heads, self.head_dim)), cos, sin)
        v = self.v_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        index_q = raw_index_k = None
        if self.indexer is not None:
            index_q, raw_index_k = self.indexer.project(x, cos, sin)
        out = torch.empty_like(q)
        for seg in batch.segments:
            self._segment(seg, batch, q, k, v, index_q, raw_index_k, out)
        out = out.reshape(tokens, -1) * torch.sigmoid(gate)
        return self.o_proj(out)

    def _segment(self, seg: Segment, batch: ForwardBatch, q, k, v, index_q, raw_index_k, out) -> None:
        kv = batch.kv
        rows = seg.rows
        new_rows = kv.rows(seg.page_table, seg.start, seg.end)
        kv.write(self.layer_idx, new_rows, k[rows], v[rows], None if raw_index_k is None else raw_index_k[rows])
        keys, values, index_keys = kv.read(self.layer_idx, kv.rows(seg.page_table, 0, seg.end))
        block_keys = None
        if self.indexer is not None:
            block_keys = self.indexer.block_keys(index_keys, self.rotary)
        positions = batch.positions[rows]
        for lo in range(0, seg.length, QUERY_TILE):
            hi = min(lo + QUERY_TILE, seg.length)
            q_pos = positions[lo:hi]
            kv_len = int(q_pos[-1]) + 1
            if self.indexer is None:
                mask = causal_mask(q_pos, kv_len)
            else:
                visible = block_keys[: kv_len // self.indexer.ratio]
                mask = qsa_token_mask(index_q[rows][lo:hi], visible, q_pos, kv_len,
                                      self.indexer.ratio, self.indexer.block_topk)
            out[seg.row0 + lo:seg.row0 + hi] = masked_attention(
                q[rows][lo:hi], keys[:kv_len], values[:kv_len], mask, self.scale
            )
