"""Hyper-connection element-wise stages, torch reference (the CPU path) and dispatchers.

With streams ``H [T, hc * hidden]`` and ``normed = rms_norm(H, w, eps, group_size=hidden)`` a
``GatedResidual`` runs two GEMMs (``down | inject`` on ``normed``, then ``up``) around two
element-wise stages, which are the ones here (on a GPU, the residual and mix of at most
:data:`MIX_GEMV_ROWS` rows run as two launches instead: the residual, norm and ``down | inject`` GEMV
in one, ``hyper_connection_triton.hc_norm_down_triton``, then the gate, ``up`` and block input in one,
``hyper_connection_triton.hc_mix_tail_triton``):

* :func:`hc_gate_act`: ``silu(down_out / hc)``, the low-rank activation between the two GEMMs;
* :func:`hc_block_input`: ``mean_s(sigmoid(up_out_s) * normed_s)`` -> the block input ``[T, hidden]``;
* :func:`hc_residual_norm`: ``H + 2 * sigmoid(inject_logits_s / hc) * block_out`` for every stream
  ``s``, then the grouped RMS norm of the result (the next ``GatedResidual``'s norm), so that the
  big streams tensor is read once and written once per block on the GPU.

Roundings follow the original module op by op (each torch op rounds to the input dtype); the
Triton kernels in ``hyper_connection_triton`` reproduce them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .backend import use_triton
from .common import MAX_WIDTH
from .norm import rms_norm_ref

# Rows up to which a CUDA ``GatedResidual.residual_mix`` runs as two weight-streaming Triton launches
# (``hc_norm_down_triton``, then ``hc_mix_tail_triton``) instead of the residual-norm kernel and two
# cuBLAS GEMMs around the gate and block-input kernels; measured (with a plain GEMV for the first
# launch) with ``benchmarks/bench_decode_kernels.py --parts hc``.
MIX_GEMV_ROWS = 4


def hc_gate_act_ref(down_out: torch.Tensor, hc: int) -> torch.Tensor:
    """``silu(down_out / hc)``, each op rounding to the input dtype."""
    return F.silu(down_out / hc)


def hc_gate_act(down_out: torch.Tensor, hc: int) -> torch.Tensor:
    """:func:`hc_gate_act_ref`, by one Triton pass for CUDA tensors."""
    if use_triton(down_out, "hc"):
        from .hyper_connection_triton import hc_gate_act_triton

        return hc_gate_act_triton(down_out, hc)
    return hc_gate_act_ref(down_out, hc)


def hc_block_input_ref(normed: torch.Tensor, up_out: torch.Tensor, hc: int) -> torch.Tensor:
    """``[T, hc * hidden]`` x2 -> ``[T, hidden]``: the sigmoid-gated mean over the ``hc`` streams."""
    mix = torch.sigmoid(up_out).unflatten(-1, (hc, -1))
    return (mix * normed.unflatten(-1, (hc, -1))).mean(dim=-2)


def hc_residual_norm_ref(streams: torch.Tensor, block_out: torch.Tensor, inject_logits: torch.Tensor, hc: int,
                         norm_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(new_streams, normed)``: the injected residual and its RMS norm over groups of ``hidden``.

    ``streams [T, hc * hidden]``, ``block_out [T, hidden]``, ``inject_logits [T, hc]`` (the raw
    inject GEMM output: ``inject = 2 * sigmoid(inject_logits / hc)``), ``norm_weight [hc * hidden]``.
    """
    inject = 2 * torch.sigmoid(inject_logits / hc)
    new_streams = streams + (block_out.unsqueeze(-2) * inject.unsqueeze(-1)).flatten(-2)
    return new_streams, rms_norm_ref(new_streams, norm_weight, eps, group_size=new_streams.shape[-1] // hc)


def hc_block_input(normed: torch.Tensor, up_out: torch.Tensor, hc: int) -> torch.Tensor:
    """:func:`hc_block_input_ref`, by one fused Triton pass for CUDA tensors of one dtype."""
    if use_triton(normed, "hc") and up_out.dtype == normed.dtype:
        from .hyper_connection_triton import hc_block_input_triton

        return hc_block_input_triton(normed, up_out, hc)
    return hc_block_input_ref(normed, up_out, hc)


def hc_residual_norm(streams: torch.Tensor, block_out: torch.Tensor, inject_logits: torch.Tensor, hc: int,
                     norm_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`hc_residual_norm_ref`, by one fused Triton pass for CUDA tensors of one dtype and stream slices of
    at most :data:`~tidal.kernels.common.MAX_WIDTH` features."""
    if (use_triton(streams, "hc") and block_out.dtype == streams.dtype and inject_logits.dtype == streams.dtype
            and streams.shape[-1] // hc <= MAX_WIDTH):
        from .hyper_connection_triton import hc_residual_norm_triton

        return hc_residual_norm_triton(streams, block_out, inject_logits, hc, norm_weight, eps)
    return hc_residual_norm_ref(streams, block_out, inject_logits, hc, norm_weight, eps)
