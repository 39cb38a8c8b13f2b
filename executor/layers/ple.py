"""PLE: hashed n-gram per-layer embeddings injected into every hyper-connection stream."""

from __future__ import annotations

import torch
from torch import nn

from ...config.model import ModelConfig
from ...kernels.conv import causal_conv1d_update, causal_conv1d_varlen, conv_windows
from ...kernels.ngram import layer_multipliers, ngram_ids_varlen
from ...kernels.ple import ple_gate
from ..distributed import split, tp
from ..forward_batch import ForwardBatch
from ..offload.ple_table import PinnedTable
from .linear import Linear, RMSNorm


def hashing_constants(config: ModelConfig, ple_layer_index: int) -> dict[str, torch.Tensor]:
    """The n-gram hashing buffers of one PLE layer, derived from the config (CPU, int64)."""
    c = config
    sizes = c.ngram_vocab_sizes(ple_layer_index)
    return {
        "layer_multipliers": torch.tensor(
            layer_multipliers(c.vocab_size, c.ngram_size, ple_layer_index, c.seed), dtype=torch.long, device="cpu"),
        "ngram_heads_vocab_sizes": torch.tensor(sizes, dtype=torch.long, device="cpu"),
        "ngram_heads_offsets": torch.tensor([sum(sizes[:i]) for i in range(len(sizes))], dtype=torch.long,
                                            device="cpu"),
    }


class NGramEmbedding(nn.Module):
    """One PLE layer's hashed n-gram table.

    ``ngram_heads`` heads (``heads_per_ngram`` per order 2..ngram_size) each hash into their own
    prime-sized range of one table; a token's embedding is its heads' rows concatenated. With
    ``--ple-backend gpu`` the parameter is on the device and indexed directly; ``pinned`` and ``disk``
    set ``table`` (a :class:`~tidal.executor.offload.ple_table.PLETable`) that gathers the rows.
    """

    def __init__(self, config: ModelConfig, ple_layer_index: int):
        super().__init__()
        c = config
        self.eos = c.ple_eos_id
        self.heads_per_ngram = c.heads_per_ngram
        for name, value in hashing_constants(c, ple_layer_index).items():
            self.register_buffer(name, value)
        self.table = None
        self.dim_per_head = c.ple_embed_dim // c.ngram_heads
        self.ngram_embedding = nn.Module()
        self.ngram_embedding.weight = nn.Parameter(
            torch.empty(c.ngram_table_rows(ple_layer_index),
                        split(self.dim_per_head, "the PLE embedding dimension per head")[1]),
            requires_grad=False
        )
        # An FP8 table (a quantized checkpoint's) is kept in FP8 wherever it lives, with its one scale.
        self.fp8 = c.quantization is not None and c.quantization.ngram is not None
        if self.fp8:
            self.ngram_embedding.register_buffer("weight_scale", torch.ones((), dtype=torch.float32))

    def dequantize(self, rows: torch.Tensor) -> torch.Tensor:
        """Gathered rows as values: an FP8 table's rows times its scale (fp32), others as they are."""
        if not self.fp8:
            return rows
        return rows.float() * self.ngram_embedding.weight_scale

    def row_ids(self, batch: ForwardBatch) -> torch.Tensor:
        """The table rows of every token of ``batch``, ``[T, heads]`` (long, on the batch's device)."""
        return ngram_ids_varlen(batch.ngram_context, batch.input_ids, batch.row_segment, batch.all.cu_seqlens,
                                self.eos, self.layer_multipliers, self.ngram_heads_vocab_sizes,
                                self.ngram_heads_offsets, self.heads_per_ngram)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        rows = self.row_ids(batch)
        if self.table is None:  # --ple-backend gpu: the parameter itself, on the device
            emb = self.ngram_embedding.weight[rows]
        elif (batch.decode_only or batch.graph) and isinstance(self.table, PinnedTable):  # read in a graph-safe way
            emb = self.table.gather_on_device(rows)
        else:
            emb = self.table.gather(rows)
        emb = self.dequantize(emb)
        if emb.shape[-1] == self.dim_per_head:  # a disk table reads whole rows on every rank
            return emb.flatten(-2)
        # Under tensor parallelism each rank holds a slice of every row: gather the full rows.
        return tp().all_gather(emb, dim=-1).flatten(-2)


class PLELayer(nn.Module):
    """Adds ``gated + silu(dilated_conv(norm(gated)))`` to the streams, where ``gated`` is the
    n-gram value scaled per stream by ``sigmoid(signsqrt(<norm(key_s), norm(H_s)> / sqrt(hidden)))``.
    """

    def __init__(self, config: ModelConfig, layer_idx: int, ple_layer_index: int):
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        self.hc_count, self.hidden = c.hc_count, c.hidden_size
        width = c.hc_count * c.hidden_size
        self.dilation = c.ngram_size
        self.ple_embedding = NGramEmbedding(c, ple_layer_index)
        self.key_proj = Linear(c.ple_embed_dim, width)
        self.value_proj = Linear(c.ple_embed_dim, c.hidden_size)
        self.norm_key = RMSNorm(width, c.rms_norm_eps, group_size=c.hidden_size)
        self.norm_query = RMSNorm(width, c.rms_norm_eps, group_size=c.hidden_size)
        self.norm_conv = RMSNorm(width, c.rms_norm_eps, group_size=c.hidden_size)
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(width, 1, c.ple_conv_kernel_size), requires_grad=False)

    def forward(self, streams: torch.Tensor, batch: ForwardBatch, query: torch.Tensor | None = None) -> torch.Tensor:
        """The PLE output ``[T, hc * hidden]`` to add to ``streams``; ``query`` is ``norm_query(streams)``
        when the caller computed it already (with the residual add that produced ``streams``)."""
        ahead = batch.ple_rows.get(self.layer_idx)
        emb = (self.ple_embedding.dequantize(ahead()) if ahead is not None else self.ple_embedding(batch))
        emb = emb.to(streams.dtype)
        if query is None:
            query = self.norm_query(streams)
        gated, normed = ple_gate(self.key_proj(emb), query, self.value_proj(emb), self.norm_key.weight,
                                 self.norm_conv.weight, self.hc_count, self.norm_conv.eps)
        windows = batch.states.ple_conv[self.layer_idx]
        a = batch.all
        weight = self.conv1d.weight[:, 0, :]
        if batch.prefill.num_rows == 0 and batch.export_seg.numel() == 0:
            # One row per segment and no checkpoint: the decode step's conv, which shifts each window in
            # place (one launch for what the prefill form does in a conv, a gather and a store).
            return gated + causal_conv1d_update(normed, windows, weight, a.slots, a.fresh, dilation=self.dilation)
        conv = causal_conv1d_varlen(normed, windows, weight, a.cu_seqlens, a.slots, a.fresh,
                                    dilation=self.dilation, max_seqlen=a.max_seqlen, row_segment=batch.row_segment)
        seg_index = torch.cat([torch.arange(a.num_segments, device=normed.device), batch.export_seg])
        upto = torch.cat([a.lengths, batch.export_off])
        new_windows = conv_windows(normed, windows, a.cu_seqlens, a.slots, a.fresh, seg_index, upto)
        windows[torch.cat([a.slots, batch.export_dst])] = new_windows
        return gated + conv
