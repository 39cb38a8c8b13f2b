"""Routed experts: the softmax top-k router and the expert computation.

``fused_experts`` sorts the (token, expert) assignments by expert and runs gate_up and down as two
grouped GEMMs over the jagged per-expert row ranges (torch's grouped GEMM: one launch each, no
loop over experts, no host sync; it runs on the CPU too). ``fused_experts_ref`` is the per-expert
loop it is checked against. On CUDA, ``route`` is one Triton launch, and small decode forwards run
the routed and shared experts as the GEMV kernels of ``moe_decode_triton`` (:func:`gemv_applies`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .backend import use_triton
from .quant import Nvfp4

_torch_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
# Groups one call of torch's grouped GEMM takes (an expert cache holds more slots than that): on CUDA it
# refuses 1,024 and more ("Can't process more than 1024 groups", torch 2.11 on an H200; 1,023 runs).
MAX_GROUPS = 1023


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """torch's grouped GEMM of rows ``a`` (grouped by the cumulative ``offs``) against ``b [G, K, N]``, for any
    number of groups. Beyond :data:`MAX_GROUPS` it runs once per range of groups: each range's rows (consecutive)
    are shifted to start at row 0 and its offsets with them, the results shifted back. Fixed shapes throughout, no
    host sync and no copy of ``b``."""
    groups = b.shape[0]
    if groups <= MAX_GROUPS:
        return _torch_grouped_mm(a, b, offs=offs)
    out = torch.zeros((a.shape[0], b.shape[-1]), dtype=a.dtype, device=a.device)
    rows = torch.arange(a.shape[0], device=a.device)
    last = a.shape[0] - 1
    for g0 in range(0, groups, MAX_GROUPS):
        g1 = min(groups, g0 + MAX_GROUPS)
        start = offs[g0 - 1] if g0 else offs.new_zeros(())
        shifted = _torch_grouped_mm(a.index_select(0, (rows + start).clamp(max=last)), b[g0:g1],
                                    offs=(offs[g0:g1] - start).to(offs.dtype))
        mine = (rows >= start) & (rows < offs[g1 - 1])
        out = torch.where(mine[:, None], shifted.index_select(0, (rows - start).clamp(min=0)), out)
    return out


# On CUDA, bf16 batches of at most this many (token, expert) assignments take the Triton kernel. Measured
# on the H200 at the bench shapes (benchmarks/bench_forward.py --kernels): at 8 tokens the Triton kernel took
# 0.95 ms against 0.21 ms for torch's grouped GEMMs, at 32K 7.1 against 4.6 ms, so bf16 always takes the
# grouped GEMM until the Triton kernel's decode tiles are tuned; Triton serves fp32 and fp16.
TRITON_MAX_ASSIGNMENTS = 0

# On CUDA, forwards of generated-token decodes only (``ForwardBatch.decode_only``) of at most this many
# tokens run the routed and shared experts as the GEMV kernels of ``moe_decode_triton`` (each
# assignment streams its expert's weights once, sums in fp32 and rounds once); larger forwards, and every
# forward with a prompt row, take the grouped GEMM. So a prompt's rows compute alike however it is
# chunked or cached; a decode row's rounding depends on whether its forward was decode-only. Measured on
# the H200 at the bench shapes (benchmarks/bench_decode_kernels.py --parts moe): the
# GEMV kernels take 39 / 138 / 443 / 803 us at 1 / 8 / 32 / 64 tokens against 129 / 289 / 648 / 866 us
# for the grouped path (router and shared expert included).
GEMV_MAX_TOKENS = 64
# NVFP4 experts take the GEMVs for decode batches of at most this many tokens, and the grouped GEMMs at their
# decode tiles (``moe_nvfp4_triton.DECODE_CONFIG``) above: those read each distinct expert once where the GEMVs
# stream an expert for each of its tokens, and decode codes for the tensor cores. Measured on an H100 at
# flash-next's shapes (tools/tune_moe.py --decode-tokens), the whole routed experts grouped against the fastest GEMV
# tiles: 16 tokens 210 us against 242, 8 tokens 126 against 127 (a tie), 4 tokens 90 against 67.
NVFP4_GEMV_MAX_TOKENS = 8


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax router: ``(weights [T, K] in logits' dtype, expert ids [T, K])``. On CUDA one Triton
    launch (``moe_decode_triton.route_triton``; among exactly tied probabilities it takes the lower
    expert id, where ``torch.topk`` leaves the choice open)."""
    if use_triton(router_logits, "route"):
        from .moe_decode_triton import route_triton

        return route_triton(router_logits, top_k, renormalize)
    return route_ref(router_logits, top_k, renormalize)


def route_ref(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`route` in torch: softmax in fp32, ``torch.topk``, renormalised."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


def fused_experts_ref(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                      down: torch.Tensor) -> torch.Tensor:
    """``sum_k w_k * down_e(silu(gate_e(x)) * up_e(x))`` over each token's experts ``e = ids[:, k]``,
    one expert at a time.

    Args: x ``[T, H]``; ids, weights ``[T, K]``; gate_up ``[E, 2I, H]`` (gate rows first); down ``[E, H, I]``.
    """
    out = torch.zeros_like(x)
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=1).tolist()
    token_of = order // ids.shape[1]
    slot_of = order % ids.shape[1]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        tokens = token_of[start:start + count]
        slots = slot_of[start:start + count]
        start += count
        gate, up = F.linear(x[tokens], gate_up[expert]).chunk(2, dim=-1)
        h = F.linear(F.silu(gate) * up, down[expert]) * weights[tokens, slots, None]
        out.index_add_(0, tokens, h.to(out.dtype))
    return out


def grouped_mm_supported(x: torch.Tensor) -> bool:
    """torch's grouped GEMM takes bf16 on CUDA, and any float dtype on the CPU."""
    if _torch_grouped_mm is None:
        return False
    return x.dtype == torch.bfloat16 or not x.is_cuda


def add_shared(routed: torch.Tensor, shared: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """``routed + gate * shared_out`` for ``shared = (shared_out [T, H], gate [T, 1])`` (the shared
    expert's output and its sigmoid gate), or ``routed`` without one."""
    if shared is None:
        return routed
    shared_out, gate = shared
    return routed + gate * shared_out


def fused_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                  down: torch.Tensor, shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Same result as :func:`fused_experts_ref`, plus ``shared`` as :func:`add_shared` adds it, as two
    grouped GEMMs over expert-sorted rows.

    Each token's K expert outputs are summed in fp32 in a fixed order (no atomics), so the result is
    deterministic. On CUDA the Triton kernel (``moe_triton``) runs instead where the grouped GEMM
    cannot (fp32, fp16), and for batches of at most :data:`TRITON_MAX_ASSIGNMENTS` assignments. On the
    CUDA grouped path gate_up is :func:`moe_triton.sorted_gate_up` (rows read through the sort order, SiLU
    gate applied, no gathered copy), and the shared expert is added inside the combine pass, with the
    same bits as the separate ops.
    """
    if (use_triton(x, "moe") and x.dtype == gate_up.dtype == down.dtype
            and (not grouped_mm_supported(x) or ids.numel() <= TRITON_MAX_ASSIGNMENTS)):
        from .moe_triton import fused_experts_triton

        return add_shared(fused_experts_triton(x, ids, weights, gate_up, down), shared)
    if not grouped_mm_supported(x):
        return add_shared(fused_experts_ref(x, ids, weights, gate_up, down), shared)
    tokens, top_k = ids.shape
    num_experts = gate_up.shape[0]
    flat = ids.flatten()
    sorted_ids, order = torch.sort(flat, stable=True)
    # Each expert's run ends after its last id: a binary search of the sorted ids (no histogram of
    # atomics, and not bincount, which on CUDA reads the largest id back to size its output).
    offsets = torch.searchsorted(sorted_ids, torch.arange(num_experts, device=x.device, dtype=flat.dtype),
                                 right=True, out_int32=True)
    if use_triton(x, "moe") and x.dtype == gate_up.dtype:
        from .moe_triton import combine, sorted_gate_up

        # gate_up reads its rows through the sort order and applies the SiLU gate (one Triton pass); down is
        # torch's grouped GEMM over the activations, already in expert order.
        h = _grouped_mm(sorted_gate_up(x, order, offsets, gate_up, top_k), down.transpose(1, 2), offs=offsets)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=x.device)
        fold = shared is not None and shared[0].dtype == shared[1].dtype == h.dtype
        return add_shared(combine(h, inverse, weights, shared if fold else None), None if fold else shared)
    h = _grouped_mm(x[order // top_k], gate_up.transpose(1, 2), offs=offsets)
    gate, up = h.chunk(2, dim=-1)
    h = _grouped_mm(F.silu(gate) * up, down.transpose(1, 2), offs=offsets)
    per_slot = torch.empty(tokens * top_k, x.shape[1], dtype=x.dtype, device=x.device)
    per_slot[order] = h * weights.flatten()[order, None]
    return add_shared(per_slot.view(tokens, top_k, x.shape[1]).sum(dim=1, dtype=torch.float32).to(x.dtype), shared)


def fused_experts_nvfp4(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: Nvfp4,
                        down: Nvfp4, shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """:func:`fused_experts` over NVFP4 experts (``gate_up``, ``down``: :class:`~tidal.kernels.quant.Nvfp4` stacks
    ``[E, 2I, H]`` and ``[E, H, I]``). On CUDA the grouped GEMMs read the packed codes and scales
    (``moe_nvfp4_triton``: no dense copy of any expert), the SiLU gate and the combine as on the bf16 path; the
    reference (and the CPU path) dequantizes the experts to ``x``'s dtype and runs :func:`fused_experts`."""
    if not use_triton(x, "nvfp4"):
        return fused_experts(x, ids, weights, gate_up.dequantize(x.dtype), down.dequantize(x.dtype), shared)
    from .moe_nvfp4_triton import fused_experts_nvfp4_triton

    return fused_experts_nvfp4_triton(x, ids, weights, gate_up, down, shared)


def gemv_applies(x: torch.Tensor, gate_up: torch.Tensor | Nvfp4) -> bool:
    """Whether a decode batch of ``x``'s rows may run its experts as ``moe_decode_triton.moe_gemv`` (CUDA,
    Triton, at most :data:`GEMV_MAX_TOKENS` tokens, weights in ``x``'s dtype, or NVFP4 read packed and at most
    :data:`NVFP4_GEMV_MAX_TOKENS` tokens)."""
    if not (use_triton(x, "moe_gemv") and 0 < x.shape[0] <= GEMV_MAX_TOKENS):
        return False
    if isinstance(gate_up, Nvfp4):
        return x.shape[0] <= NVFP4_GEMV_MAX_TOKENS and use_triton(x, "nvfp4")
    return gate_up.dtype == x.dtype
