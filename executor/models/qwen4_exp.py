"""Qwen4-Exp text model, layer by layer as transformers' ``modeling_qwen4_exp`` defines it.

Rows are a flat batch of segments (any mix of prefill chunks and single-token decodes of different
requests); per-request state lives in the pools the :class:`ForwardBatch` carries, never here.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ...config.model import LINEAR, ModelConfig
from ...kernels.hyper_connection import hc_residual_norm
from ..distributed import tp
from ..forward_batch import ForwardBatch
from ..layers.attention import GatedAttention
from ..layers.gdn import GatedDeltaNet
from ..layers.hyper_connection import GatedResidual
from ..layers.linear import Linear
from ..layers.moe import SparseMoE
from ..layers.ple import PLELayer
from ..layers.rotary import Rotary
from .vision import VisionConfig, VisionTower


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, rotary: Rotary):
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        self.is_linear = c.layer_types[layer_idx] == LINEAR
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(c, layer_idx)
        else:
            self.self_attn = GatedAttention(c, layer_idx, rotary)
        self.ple = PLELayer(c, layer_idx, c.ple_layers.index(layer_idx)) if layer_idx in c.ple_layers else None
        self.attn_hyper_connection = GatedResidual(c.hc_count, c.hidden_size, c.hc_lowrank, c.rms_norm_eps)
        self.mlp_hyper_connection = GatedResidual(c.hc_count, c.hidden_size, c.hc_lowrank, c.rms_norm_eps)
        self.mlp = SparseMoE(c, layer_idx)

    def forward(self, streams: torch.Tensor, pending, batch: ForwardBatch, own: slice | None = None):
        """One layer over the streams ``H``.

        The residual add of a block and the norm of the next hyper-connection are one pass over
        ``H`` (``GatedResidual.residual_mix``), so a layer receives the previous block's output
        still ``pending`` (``(block_out, inject_logits)``, or ``None`` before the first layer) and
        hands its own MoE output on the same way. PLE reads the streams themselves, so a PLE layer
        applies the pending residual first and normalises after adding its embedding.

        Under tensor parallelism the mixer and the MoE return partial sums over this rank's heads
        and intermediate slice, reduced here at the layer. With ``own`` (hyper-connection row
        sharding) ``streams`` and ``pending`` hold only this rank's rows ``own`` of the batch: the
        hyper-connection work runs on them, block inputs are all-gathered, block outputs
        reduce-scattered back, and PLE (its conv crosses rows) sees the gathered streams.
        """
        streams, block_in, inject = self.before_moe(streams, pending, batch, own)
        return streams, self.moe(block_in, inject, batch, own)

    def before_moe(self, streams: torch.Tensor, pending, batch: ForwardBatch, own: slice | None = None):
        """The layer up to its MoE block: ``(streams, block_in, inject)``, the streams with the mixer's
        residual added and the MoE block's input and inject logits (see :meth:`moe`)."""
        hc_attn, hc_mlp = self.attn_hyper_connection, self.mlp_hyper_connection
        group = tp()
        if self.ple is not None or pending is None:
            query = None
            if pending is not None and own is None:
                # The pending residual and PLE's query norm of its result: one pass (as add_and_norm).
                streams, query = hc_residual_norm(streams, pending[0], pending[1], hc_attn.hc_count,
                                                  self.ple.norm_query.weight, self.ple.norm_query.eps)
            elif pending is not None:  # row sharding: PLE normalises the gathered streams itself
                inject = 2 * torch.sigmoid(pending[1] / hc_attn.hc_count)
                streams = GatedResidual.residual(streams, pending[0], inject)
            if self.ple is not None:
                if own is None:
                    streams = streams + self.ple(streams, batch, query)
                else:
                    streams = streams + self.ple(group.all_gather(streams), batch)[own]
            pending = None
        streams, block_in, inject = hc_attn.residual_mix(streams, pending, owned_rows=own is not None)
        mixer = self.linear_attn if self.is_linear else self.self_attn
        pending = (self._block(mixer, block_in, batch, own), inject)
        return hc_mlp.residual_mix(streams, pending, owned_rows=own is not None)

    def moe(self, block_in: torch.Tensor, inject: torch.Tensor, batch: ForwardBatch, own: slice | None = None):
        """The layer's MoE block on ``block_in``: its output still ``pending`` with ``inject``."""
        # Only a forward of generated-token decodes may take the MoE's decode kernels: every prompt row
        # takes the same path whatever the chunking, so a prompt computes alike cold, chunked or cached.
        return self._block(lambda x, _: self.mlp(x, batch.decode_only), block_in, batch, own), inject

    @staticmethod
    def _block(block, block_in: torch.Tensor, batch: ForwardBatch, own: slice | None) -> torch.Tensor:
        group = tp()
        if own is None:
            return group.all_reduce(block(block_in, batch))
        return group.reduce_scatter(block(group.all_gather(block_in), batch))


class Qwen4ExpModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        c = config
        self.config = c
        # Built without nn.Embedding's random init: its normal_ on the meta device imports torch._dynamo
        # (seconds), and every weight is loaded or filled afterwards anyway.
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, _freeze=True,
                                         _weight=torch.empty(c.vocab_size, c.hidden_size))
        self.rotary = Rotary(c.rotary_dim, c.rope_theta, c.mrope_section)
        self.layers = nn.ModuleList([DecoderLayer(c, i, self.rotary) for i in range(c.num_hidden_layers)])
        self.hyper_connection_mixer = GatedResidual(c.hc_count, c.hidden_size, c.hc_lowrank, c.rms_norm_eps,
                                                    use_combine=False)

    def embed(self, batch: ForwardBatch) -> torch.Tensor:
        """The embeddings (vision features at the rows of vision tokens) repeated into the ``hc_count``
        streams ``[T, hc * hidden]``."""
        emb = self.embed_tokens(batch.input_ids)
        if batch.vision_rows is not None and batch.vision_embeds is not None:
            emb = emb.index_copy(0, batch.vision_rows, batch.vision_embeds.to(emb.dtype))
        return torch.cat([emb] * self.config.hc_count, dim=-1)  # a contiguous copy kernel (repeat's is strided)

    def forward(self, batch: ForwardBatch,
                hc_shard: bool = False) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """The ``hc_count`` residual streams ``[T, hc * hidden]`` before the last layer's MoE residual,
        and that residual still pending (``(moe_out, inject_logits)``): only the rows that need
        logits pay for it (:meth:`Qwen4ExpForCausalLM.logits`).

        ``hc_shard``: this rank owns rows ``[rank * T / TP, (rank + 1) * T / TP)`` for the
        hyper-connection work (the scheduler only asks when ``T`` divides); the final rows are
        gathered back in token order.
        """
        streams = self.embed(batch)
        if self.config.attention_layers and batch.rope is None:  # a decode graph's prologue sets it
            positions = batch.rope_positions if batch.rope_positions is not None else batch.positions
            batch = dataclasses.replace(batch, rope=self.rotary.cos_sin(positions, streams.dtype))
        pending = None
        own = None
        group = tp()
        if hc_shard and group.size > 1:
            per = streams.shape[0] // group.size
            own = slice(group.rank * per, (group.rank + 1) * per)
            streams = streams[own]
        for layer in self.layers:
            streams, pending = layer(streams, pending, batch, own)
        if own is not None:
            streams = group.all_gather(streams)
            pending = (group.all_gather(pending[0]), group.all_gather(pending[1]))
        return streams, pending


class Qwen4ExpForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = Qwen4ExpModel(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size)
        self.visual = VisionTower(VisionConfig(config.vision_config)) if config.vision_config is not None else None

    def forward(self, batch: ForwardBatch,
                hc_shard: bool = False) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        return self.model(batch, hc_shard)

    def logits(self, streams: torch.Tensor, pending: tuple[torch.Tensor, torch.Tensor],
               rows: torch.Tensor | None, into: torch.Tensor | None = None) -> torch.Tensor:
        """Finish ``rows`` (every row for ``None``): the last residual and the final mixer's norm in one pass,
        then the fold of their streams and the projection to the vocabulary, written into ``into`` when given
        (the projection's own output: no copy)."""
        out, inject_logits = pending
        if rows is not None:
            streams, out, inject_logits = streams[rows], out[rows], inject_logits[rows]
        _, hidden, _ = self.model.hyper_connection_mixer.residual_mix(streams, (out, inject_logits))
        if into is None:
            return self.lm_head(hidden)
        return torch.mm(hidden, self.lm_head.weight.t(), out=into)
