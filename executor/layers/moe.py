"""Sparse MoE: softmax top-k router, routed experts and a sigmoid-gated shared expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...config.model import ModelConfig
from ...kernels.backend import use_triton
from ...kernels.gemv import linear
from ...kernels.moe import add_shared, gemv_applies, route
from ...kernels.quant import Nvfp4
from ..distributed import split
from ..quant import PARTS, QuantTensor, empty_experts, read_packed, routed_experts, stacked_block_rows
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
    ``down_proj[e]`` is ``[H, I]``; in a quantized checkpoint's format (``fmt``: ``nvfp4`` or ``fp8``) they are
    :class:`~tidal.executor.quant.QuantTensor` stacks whose parts are this module's buffers
    (``gate_up_proj_data``, ``gate_up_proj_scale``, ...), dequantized only inside the expert computation.

    ``--moe-strategy resident``: the tensors are on the device and used directly. ``offload``: they
    are this layer's host bank, and ``store`` (an :class:`~tidal.executor.offload.experts.ExpertStore`
    shared by all layers) brings the routed experts to the device.
    """

    def __init__(self, num_experts: int, hidden: int, intermediate: int, layer_idx: int, fmt: str | None = None):
        super().__init__()
        self.num_experts, self.layer_idx, self.fmt = num_experts, layer_idx, fmt
        self.hidden, self.intermediate = hidden, intermediate
        self.store = None
        if fmt is None:
            self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden), requires_grad=False)
            self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate), requires_grad=False)
            return
        for proj, (parts, cols) in self.layout().items():
            q = empty_experts(fmt, num_experts, parts, cols, "meta")
            for part, tensor in zip(PARTS, (q.data, q.scale, q.scale_2), strict=True):
                if tensor is not None:
                    self.register_buffer(f"{proj}_{part}", tensor)
            if q.block_rows is not None:
                self.register_buffer(f"{proj}_block_rows", stacked_block_rows(parts))

    def layout(self) -> dict[str, tuple[list[int], int]]:
        """Per fused tensor: the rows of each checkpoint tensor stacked into it, and its columns."""
        return {"gate_up_proj": ([self.intermediate, self.intermediate], self.hidden),
                "down_proj": ([self.hidden], self.intermediate)}

    def storage(self) -> list[str]:
        """The buffers that hold quantized weights (allocated when the model is built, like parameters)."""
        return [n for n, _ in self.named_buffers(recurse=False) if not n.endswith("_block_rows")]

    def weight(self, proj: str) -> torch.Tensor | QuantTensor:
        """``gate_up_proj`` or ``down_proj``: the parameter, or the :class:`QuantTensor` over the buffers."""
        if self.fmt is None:
            return getattr(self, proj)
        parts = [getattr(self, f"{proj}_{part}", None) for part in PARTS]
        block_rows = getattr(self, f"{proj}_block_rows", None)
        return QuantTensor(self.fmt, parts[0], parts[1], parts[2], block_rows, self.layout()[proj][1])

    @property
    def gate_up(self) -> torch.Tensor | QuantTensor:
        return self.weight("gate_up_proj")

    @property
    def down(self) -> torch.Tensor | QuantTensor:
        return self.weight("down_proj")

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The routed experts' weighted sum, plus ``shared`` (see :func:`~tidal.kernels.moe.add_shared`)."""
        if self.store is not None:
            return add_shared(self.store.forward(self.layer_idx, x, ids, weights), shared)
        gate_up, down = self.gate_up, self.down
        if self.fmt is not None and not read_packed(x, gate_up) and ids.numel() < self.num_experts:
            # Dequantized per use, and fewer (token, expert) pairs than experts (decode): dequantize only the
            # routed experts, one copy per pair, numbered 0..n-1 (shapes alone decide: no host sync, graph-safe).
            flat = ids.reshape(-1)
            gate_up, down = gate_up.index_select(0, flat), down.index_select(0, flat)
            ids = torch.arange(flat.numel(), device=ids.device, dtype=ids.dtype).view_as(ids)
        return routed_experts(x, ids, weights, gate_up, down, shared)

    def gemv_weights(self) -> tuple[torch.Tensor, torch.Tensor] | tuple[Nvfp4, Nvfp4] | None:
        """``(gate_up, down)`` as the decode GEMV kernels read them (dense, or NVFP4 stacks); None where they
        cannot (offloaded experts, block FP8)."""
        if self.store is not None or self.fmt == "fp8":
            return None
        if self.fmt is None:
            return self.gate_up_proj, self.down_proj
        return self.gate_up.nvfp4(), self.down.nvfp4()


class SparseMoE(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        c = config
        self.top_k, self.renormalize = c.num_experts_per_tok, c.norm_topk_prob
        self.gate = Linear(c.hidden_size, c.num_experts)
        # Under tensor parallelism each rank holds a slice of every expert's intermediate dimension,
        # and the output is a partial sum that the decoder layer reduces.
        self.experts = RoutedExperts(c.num_experts, c.hidden_size,
                                     split(c.moe_intermediate_size, "moe_intermediate_size")[1], layer_idx,
                                     c.quantization.experts if c.quantization is not None else None)
        self.shared_expert = SharedExpert(
            c.hidden_size, split(c.shared_expert_intermediate_size, "shared_expert_intermediate_size")[1])
        self.shared_expert_gate = Linear(c.hidden_size, 1)

    def forward(self, x: torch.Tensor, decode: bool = False) -> torch.Tensor:
        """``decode``: every row decodes a generated token (small such batches take the GEMV kernels)."""
        weights, ids = route(linear(x, self.gate.weight), self.top_k, self.renormalize)
        experts, shared = self.experts, self.shared_expert
        routed = experts.gemv_weights() if decode else None
        if routed is not None and gemv_applies(x, routed[0]):
            # Small decode batches: routed and shared experts, gate and sum in three GEMV-shaped launches.
            from ...kernels.moe_decode_triton import moe_gemv

            inter = shared.gate_proj.weight.shape[0]
            return moe_gemv(x, ids, weights, *routed,
                            (shared.gate_up()[:2 * inter], shared.down_proj.weight, self.shared_expert_gate.weight))
        gate = torch.sigmoid(self.shared_expert_gate(x))
        return self.experts(x, ids, weights, shared=(self.shared_expert(x), gate))
