"""Sparse MoE: softmax top-k router, routed experts and a sigmoid-gated shared expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...config.model import ModelConfig
from ...kernels.backend import use_triton
from ...kernels.gemv import linear
from ...kernels.moe import add_shared, fused_experts, gemv_applies, route
from ..distributed import split
from .linear import Linear, StackedWeight


class SharedExpert(nn.Module):
    """``down(silu(gate(x)) * up(x))``. On a GPU gate and up are one GEMM over a ``[gate; up]`` weight
    (a :class:`StackedWeight`) and the SiLU-gate is one pass (the routed experts' kernel)."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate)
        self.up_proj = Linear(hidden, intermediate)
        self.down_proj = Linear(intermediate, hidden)
        self._gate_up = StackedWeight(self.gate_proj, self.up_proj)

    def gate_up(self) -> torch.Tensor:
        """The ``[gate; up]`` weight ``[2 * I (+ padding rows), H]``."""
        return self._gate_up.get()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_triton(x, "shared_expert"):
            from ...kernels.moe_triton import silu_mul

            inter = self.gate_proj.weight.shape[0]
            return self.down_proj(silu_mul(F.linear(x, self.gate_up()[:2 * inter])))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class RoutedExperts(nn.Module):
    """A layer's experts as fused 3-D tensors: ``gate_up_proj[e]`` is ``[2 * I, H]`` (gate rows first),
    ``down_proj[e]`` is ``[H, I]``.

    ``--moe-strategy resident``: the tensors are on the device and used directly. ``offload``: they
    are this layer's host bank, and ``store`` (an :class:`~tidal.executor.offload.experts.ExpertStore`
    shared by all layers) brings the routed experts to the device.
    """

    def __init__(self, num_experts: int, hidden: int, intermediate: int, layer_idx: int):
        super().__init__()
        self.num_experts, self.layer_idx = num_experts, layer_idx
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate), requires_grad=False)
        self.store = None

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The routed experts' weighted sum, plus ``shared`` (see :func:`~tidal.kernels.moe.add_shared`)."""
        if self.store is not None:
            return add_shared(self.store.forward(self.layer_idx, x, ids, weights), shared)
        return fused_experts(x, ids, weights, self.gate_up_proj, self.down_proj, shared)


class SparseMoE(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        c = config
        self.top_k, self.renormalize = c.num_experts_per_tok, c.norm_topk_prob
        self.gate = Linear(c.hidden_size, c.num_experts)
        # Under tensor parallelism each rank holds a slice of every expert's intermediate dimension,
        # and the output is a partial sum that the decoder layer reduces.
        self.experts = RoutedExperts(c.num_experts, c.hidden_size,
                                     split(c.moe_intermediate_size, "moe_intermediate_size")[1], layer_idx)
        self.shared_expert = SharedExpert(
            c.hidden_size, split(c.shared_expert_intermediate_size, "shared_expert_intermediate_size")[1])
        self.shared_expert_gate = Linear(c.hidden_size, 1)

    def forward(self, x: torch.Tensor, decode: bool = False) -> torch.Tensor:
        """``decode``: every row decodes a generated token (small such batches take the GEMV kernels)."""
        weights, ids = route(linear(x, self.gate.weight), self.top_k, self.renormalize)
        experts, shared = self.experts, self.shared_expert
        if decode and experts.store is None and gemv_applies(x, experts.gate_up_proj):
            # Small decode batches: routed and shared experts, gate and sum in three GEMV-shaped launches.
            from ...kernels.moe_decode_triton import moe_gemv

            inter = shared.gate_proj.weight.shape[0]
            return moe_gemv(x, ids, weights, experts.gate_up_proj, experts.down_proj,
                            (shared.gate_up()[:2 * inter], shared.down_proj.weight, self.shared_expert_gate.weight))
        gate = torch.sigmoid(self.shared_expert_gate(x))
        return self.experts(x, ids, weights, shared=(self.shared_expert(x), gate))
