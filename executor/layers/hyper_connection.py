"""Hyper-connections: ``hc_count`` residual streams mixed into one block input and re-injected."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...kernels.backend import next_pow2, use_triton
from ...kernels.common import MAX_K
from ...kernels.hyper_connection import MIX_GEMV_ROWS, hc_block_input, hc_gate_act, hc_residual_norm
from ..distributed import split, tp
from .linear import Linear, RMSNorm, StackedWeight


class GatedResidual(nn.Module):
    """Reads ``H [T, hc * hidden]``; returns the block input ``[T, hidden]`` and injection weights.

    The block input is the mean over streams of the grouped-normalised streams, each scaled by a
    low-rank sigmoid gate. Injection weights ``2 * sigmoid(.)`` (one per stream) scale the block
    output added back to every stream. The final mixer has no injection (``use_combine=False``).

    ``forward`` + ``residual`` is the plain form. The fused form splits at the norm instead, so that
    the residual add of one block and the norm of the next hyper-connection are one pass over ``H``
    (one Triton kernel on the GPU; for a decode step's few rows, one with the ``[down; inject]``
    projection as well)::

        H, x, inj = layers[0].hc_attn.residual_mix(H, None)    # only the very first one: no residual
        out = mixer(x)
        H, x, inj = hc_mlp.residual_mix(H, (out, inj))         # hc_mlp's own norm weight
        out = moe(x)
        H, x, inj = next_layer.hc_attn.residual_mix(H, (out, inj))
        ...                                                    # after the last layer:
        H = GatedResidual.residual(H, out, 2 * sigmoid(inj / hc))   # or the final mixer's residual_mix

    ``inj`` here are the raw inject logits; ``residual_mix`` applies ``2 * sigmoid(inj / hc)``.
    """

    def __init__(self, hc_count: int, hidden: int, lowrank: int, eps: float, use_combine: bool = True):
        super().__init__()
        self.hc_count, self.hidden, self.lowrank = hc_count, hidden, lowrank
        width = hc_count * hidden
        self.hc_norm = RMSNorm(width, eps, group_size=hidden)
        # Under tensor parallelism each rank holds the columns of its input slice (a partial mix).
        self._cols = split(width, "hc_count * hidden_size")
        self.input_mix_weight_down = Linear(self._cols[1], lowrank)
        self._full_down: torch.Tensor | None = None
        self.input_mix_weight_up = Linear(lowrank, width)
        self.block_inject_weight = Linear(width, hc_count) if use_combine else None
        # [down; inject] weight for one GEMM over `normed` on the GPU.
        self._down_inject = StackedWeight(self.input_mix_weight_down, self.block_inject_weight) if use_combine else None

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        block_input, logits = self.mix(self.norm(streams))
        if logits is None:
            return block_input, None
        return block_input, 2 * torch.sigmoid(logits / self.hc_count)

    def norm(self, streams: torch.Tensor) -> torch.Tensor:
        """This hyper-connection's grouped RMS norm of ``streams`` (groups of ``hidden``)."""
        return self.hc_norm(streams)

    def mix(self, normed: torch.Tensor, owned_rows: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(block_input [T, hidden], inject_logits [T, hc] or None)`` from already-normalised streams.

        On the GPU the down and inject projections are one GEMM (``normed`` is the biggest operand,
        read once) and the logits come back as a column slice of its output.
        """
        hc = self.hc_count
        group = tp()
        if group.size > 1 and owned_rows:
            # Row sharding: the ranks hold different rows, so each mixes its own with the whole
            # down-mix weight (gathered from the ranks' input slices at start-up).
            down = F.linear(normed, self.full_down_weight())
            logits = None if self.block_inject_weight is None else self.block_inject_weight(normed)
        elif group.size > 1:
            start, count = self._cols
            down = group.all_reduce(self.input_mix_weight_down(normed.narrow(-1, start, count).contiguous()))
            logits = None if self.block_inject_weight is None else self.block_inject_weight(normed)
        elif self.block_inject_weight is not None and use_triton(normed, "hc"):
            down, logits = self._down_inject.split(F.linear(normed, self._down_inject.get()))
        else:
            down = self.input_mix_weight_down(normed)
            logits = None if self.block_inject_weight is None else self.block_inject_weight(normed)
        up = self.input_mix_weight_up(hc_gate_act(down, hc))
        return hc_block_input(normed, up, hc), logits

    def residual_mix(self, streams: torch.Tensor, pending: tuple[torch.Tensor, torch.Tensor] | None,
                     owned_rows: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(streams, block_input, inject_logits)``: the previous block's ``pending = (block_out,
        inject_logits)`` added to the streams (``None``: the streams as they are), then this module's norm and
        :meth:`mix`. A decode step's few rows (at most ``MIX_GEMV_ROWS``) on the GPU take two weight-streaming
        launches: the residual, the norm and the ``[down; inject]`` projection in one, whose programs each
        normalise the rows themselves; then the gate, the ``up`` projection and the gated mean in one (a row's
        streams, padded to powers of two, up to ``kernels.common.MAX_K`` features)."""
        dtype = streams.dtype
        if (tp().size == 1 and use_triton(streams, "hc") and streams.dim() == 2 and streams.shape[0] <= MIX_GEMV_ROWS
                and dtype == self.input_mix_weight_up.weight.dtype and self.lowrank <= MAX_K
                and next_pow2(self.hc_count) * next_pow2(self.hidden) <= MAX_K
                and (pending is None or pending[0].dtype == pending[1].dtype == dtype)):
            from ...kernels.hyper_connection_triton import hc_mix_tail_triton, hc_norm_down_triton

            stacked = self._down_inject is not None
            streams, normed, y = hc_norm_down_triton(
                streams, pending, self.hc_count, self.hc_norm.weight, self.hc_norm.eps,
                self._down_inject.get() if stacked else self.input_mix_weight_down.weight)
            block_input = hc_mix_tail_triton(y[:, :self.lowrank], self.input_mix_weight_up.weight, normed,
                                             self.hc_count)
            return streams, block_input, y[:, self.lowrank:self.lowrank + self.hc_count] if stacked else None
        if pending is None:
            normed = self.norm(streams)
        else:
            streams, normed = self.add_and_norm(streams, *pending)
        return (streams, *self.mix(normed, owned_rows))

    def full_down_weight(self) -> torch.Tensor:
        """The whole ``input_mix_weight_down`` from the TP ranks' input slices (gathered once)."""
        if self._full_down is None:
            self._full_down = tp().all_gather(self.input_mix_weight_down.weight, dim=1)
        return self._full_down

    def add_and_norm(self, streams: torch.Tensor, block_out: torch.Tensor,
                     inject_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(new_streams, normed)``: the previous block's injected residual, then this module's norm."""
        return hc_residual_norm(streams, block_out, inject_logits, self.hc_count, self.hc_norm.weight,
                                self.hc_norm.eps)

    @staticmethod
    def residual(streams: torch.Tensor, block_out: torch.Tensor, inject: torch.Tensor) -> torch.Tensor:
        """``H + inject ⊗ block_out``."""
        return streams + (block_out.unsqueeze(-2) * inject.unsqueeze(-1)).flatten(-2)
