"""Triton fused MoE: the routed experts as two kernels over expert-sorted, block-aligned rows.

Imported only for CUDA tensors (and on the CPU by the tests, under ``TRITON_INTERPRET=1``). It exists
for what torch's grouped GEMM does not serve well: fp32/fp16 (the grouped GEMM takes only bf16 on
CUDA) and small token counts, where every expert sees one or two rows and the work is really a
weight-streaming GEMV that the grouped GEMM's large tiles waste. The bf16 grouped path takes two of its
passes from here too: :func:`sorted_gate_up` (gate_up reading its rows through the expert sort, with the
SiLU gate) and :func:`combine` (the weighted sum of each token's expert outputs, plus the shared expert); the
NVFP4 grouped GEMMs take :func:`sort_assignments` (a small batch's grouping by expert, its inverse and row tiles in
one launch).

Layout (the well-known "fused MoE" structure):

1. :func:`align_assignments` sorts the ``T*K`` (token, slot) assignments by expert and pads each
   expert's run to a multiple of ``BLOCK_M`` on the device, so every ``BLOCK_M`` block of
   ``sorted_ids`` belongs to one expert (``block_expert``). Sizes are host-known upper bounds (no
   host sync, CUDA-graph friendly); blocks past the real count hold expert ``-1`` and their programs
   return at once.
2. ``_gate_up_kernel``, grid ``(max_blocks, cdiv(I, BLOCK_N))``: a program gathers its block's ``x``
   rows and accumulates the gate tile (columns ``n``) and the up tile (columns ``n + I``) of its
   expert's ``gate_up`` side by side, so ``silu(gate) * up`` is formed in the epilogue and only the
   ``[max_padded, I]`` activation reaches memory, in ``x``'s dtype.
3. ``_down_kernel``, grid ``(max_blocks, cdiv(H, BLOCK_N))``: the activation rows times the expert's
   ``down``, scaled by the assignment's routing weight, written to ``per_slot[assignment]``
   (``[T*K, H]``). The ``K`` slots of a token are then summed in fp32 in a fixed order: deterministic,
   no atomics.

The M-block index is grid axis 0 (no 65535 limit, and consecutive programs usually share an expert,
so its weight tiles are reused from L2); dead blocks sit at the end of the grid.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """Tile and launch parameters of one of the two kernels (``block_n`` over its output columns)."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """``block_m`` is shared: both kernels walk the same aligned ``sorted_ids``."""

    block_m: int
    gate_up: GemmConfig
    down: GemmConfig


# (largest token count T, config), first match wins. Picked for the H200 at hidden 2048, intermediate
# 512, 512 experts, top-10 (average rows per expert = T * 10 / 512), not yet measured: decode
# (T <= 32, each expert ~1 row) streams weights with narrow N tiles so there are enough programs to
# fill the SMs; prefill uses 64/128-row tiles once experts hold tens of rows.
CONFIGS: tuple[tuple[int, MoeConfig], ...] = (
    (32, MoeConfig(16, GemmConfig(32, 128, 4, 4), GemmConfig(64, 128, 4, 3))),
    (256, MoeConfig(16, GemmConfig(64, 64, 4, 4), GemmConfig(64, 64, 4, 4))),
    (1024, MoeConfig(32, GemmConfig(64, 64, 4, 4), GemmConfig(128, 64, 4, 4))),
    (8192, MoeConfig(64, GemmConfig(64, 64, 4, 3), GemmConfig(128, 64, 8, 4))),
    (1 << 62, MoeConfig(128, GemmConfig(64, 64, 8, 3), GemmConfig(128, 64, 8, 3))),
)

# Shared memory the pipelined operand buffers may take (the H200 allows ~227 KiB a block; the rest is
# left for the epilogue's layout conversions). fp32 tiles are cut down to fit it.
_SMEM_BUDGET = 160 * 1024


def pick_config(tokens: int) -> MoeConfig:
    """The :data:`CONFIGS` row for ``tokens`` tokens."""
    for limit, config in CONFIGS:
        if tokens <= limit:
            return config
    return CONFIGS[-1][1]


def _fit(gemm: GemmConfig, block_m: int, n_dim: int, k_dim: int, b_tiles: int, elem_size: int) -> GemmConfig:
    """Clamp a config to the problem (tiles no wider than the next power of two of the dimension, at
    least 16 for ``tl.dot``) and to the shared-memory budget (fewer stages, then a shorter K tile)."""
    block_n = min(gemm.block_n, max(16, triton.next_power_of_2(n_dim)))
    block_k = min(gemm.block_k, max(16, triton.next_power_of_2(k_dim)))
    stages = gemm.num_stages

    def smem() -> int:
        return stages * (block_m * block_k + b_tiles * block_k * block_n) * elem_size

    while smem() > _SMEM_BUDGET and stages > 2:
        stages -= 1
    while smem() > _SMEM_BUDGET and block_k > 16:
        block_k //= 2
    return GemmConfig(block_n, block_k, gemm.num_warps, stages)


def _bounds(assignments: int, num_experts: int, block_m: int) -> tuple[int, int]:
    """``(max_blocks, max_padded)`` from shapes only: each non-empty expert (at most
    ``min(E, T*K)`` of them) pads by under ``block_m`` rows, and never has more blocks than rows."""
    used = min(num_experts, assignments)
    max_blocks = min(assignments, triton.cdiv(assignments + used * (block_m - 1), block_m))
    return max_blocks, max_blocks * block_m


def align_assignments(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert-sorted, ``block_m``-padded assignment order, computed on the device without a host sync.

    Returns ``sorted_ids [max_padded]`` (int32 assignment ``t*K + k``, or the sentinel ``T*K`` in
    padding) and ``block_expert [max_blocks]`` (int32 expert of each block, ``-1`` past the last real
    block). Within an expert, assignments keep their flat order (stable sort).
    """
    assignments = ids.numel()
    device = ids.device
    max_blocks, max_padded = _bounds(assignments, num_experts, block_m)
    flat = ids.reshape(-1).long()
    # Not bincount: on CUDA it reads the largest id back to size its output (a host sync).
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    rank = torch.arange(assignments, device=device) - (torch.cumsum(counts, 0) - counts)[expert_of]
    dest = (pad_end - padded)[expert_of] + rank
    sorted_ids = torch.full((max_padded,), assignments, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_start = torch.arange(max_blocks, device=device) * block_m
    block_expert = torch.searchsorted(pad_end, block_start, right=True)
    block_expert = torch.where(block_start < pad_end[-1:], block_expert, -1).to(torch.int32)
    return sorted_ids, block_expert


@triton.jit
def _silu_gate_tile(a_ptrs, g_ptrs, u_ptrs, w_desc, w_row, valid, cmask, hidden, inter, sx_h, sw_h,
                    TMA: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``silu(a @ g) * (a @ u)`` of one ``[BLOCK_M, BLOCK_N]`` tile, fp32: ``a`` rows by pointer (``valid``
    rows), the gate and up weight tiles by pointer or, with ``TMA``, from ``w_desc`` (gate_up viewed
    ``[E * 2I, H]``) at rows ``w_row`` and ``w_row + inter``. The copy engine zero-fills past H, and the
    columns past I it reads belong to the next rows, which the caller does not store."""
    ks = tl.arange(0, BLOCK_K)
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, tl.cdiv(hidden, BLOCK_K)):
        if TMA:
            a = tl.load(a_ptrs, mask=valid[:, None] & (ks < hidden - kb * BLOCK_K)[None, :], other=0.0)
            g = w_desc.load([w_row, kb * BLOCK_K]).T
            u = w_desc.load([w_row + inter, kb * BLOCK_K]).T
        elif EVEN_K:
            a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
            g = tl.load(g_ptrs, mask=cmask[None, :], other=0.0)
            u = tl.load(u_ptrs, mask=cmask[None, :], other=0.0)
        else:
            kmask = ks < hidden - kb * BLOCK_K
            a = tl.load(a_ptrs, mask=valid[:, None] & kmask[None, :], other=0.0)
            g = tl.load(g_ptrs, mask=kmask[:, None] & cmask[None, :], other=0.0)
            u = tl.load(u_ptrs, mask=kmask[:, None] & cmask[None, :], other=0.0)
        if IEEE:
            acc_g = tl.dot(a, g, acc_g, input_precision="ieee")
            acc_u = tl.dot(a, u, acc_u, input_precision="ieee")
        else:
            acc_g = tl.dot(a, g, acc_g)
            acc_u = tl.dot(a, u, acc_u)
        a_ptrs += BLOCK_K * sx_h
        g_ptrs += BLOCK_K * sw_h
        u_ptrs += BLOCK_K * sw_h
    return acc_g / (1.0 + tl.exp(-acc_g)) * acc_u


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, out_ptr, sorted_ids_ptr, block_expert_ptr,
    num_assign, hidden, inter,
    sx_t, sx_h, sw_e, sw_n, sw_h, so_m, so_n,
    TOP_K: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:  # past the real blocks
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    assign = tl.load(sorted_ids_ptr + rows)
    valid = assign < num_assign
    token = (assign // TOP_K).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < inter
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + token[:, None] * sx_t + ks[None, :] * sx_h
    g_ptrs = w_ptr + expert.to(tl.int64) * sw_e + cols.to(tl.int64)[None, :] * sw_n + ks[:, None] * sw_h
    u_ptrs = g_ptrs + inter * sw_n  # up rows follow the I gate rows
    act = _silu_gate_tile(a_ptrs, g_ptrs, u_ptrs, None, 0, valid, cmask, hidden, inter, sx_h, sw_h,
                          False, False, IEEE, BLOCK_M, BLOCK_N, BLOCK_K)
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * so_m + cols[None, :] * so_n
    tl.store(out_ptrs, act.to(out_ptr.dtype.element_ty), mask=valid[:, None] & cmask[None, :])


@triton.jit
def _down_kernel(
    a_ptr, w_ptr, out_ptr, sorted_ids_ptr, block_expert_ptr, rw_ptr,
    num_assign, hidden, inter,
    sa_m, sa_i, sw_e, sw_h, sw_i, so_a, so_h,
    IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:  # past the real blocks
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    assign = tl.load(sorted_ids_ptr + rows)
    valid = assign < num_assign
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < hidden
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * sa_m + ks[None, :] * sa_i
    b_ptrs = w_ptr + expert.to(tl.int64) * sw_e + cols.to(tl.int64)[None, :] * sw_h + ks[:, None] * sw_i
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, tl.cdiv(inter, BLOCK_K)):
        kmask = ks < inter - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=valid[:, None] & kmask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=kmask[:, None] & cmask[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * sa_i
        b_ptrs += BLOCK_K * sw_i
    rw = tl.load(rw_ptr + assign, mask=valid, other=0.0).to(tl.float32)
    acc = acc * rw[:, None]
    out_ptrs = out_ptr + assign.to(tl.int64)[:, None] * so_a + cols[None, :] * so_h
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & cmask[None, :])


def fused_experts_triton(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                         down: torch.Tensor, config: MoeConfig | None = None) -> torch.Tensor:
    """Triton form of :func:`tidal.kernels.moe.fused_experts_ref` (same arguments and result).

    x ``[T, H]``; ids, weights ``[T, K]`` (weights in x's dtype); gate_up ``[E, 2I, H]`` (gate rows
    first); down ``[E, H, I]``; all of one float dtype (fp32, bf16 or fp16). ``config`` overrides the
    :data:`CONFIGS` row picked by the token count. Three launches plus the alignment's torch ops; no
    host sync.
    """
    tokens, hidden = x.shape
    top_k = ids.shape[1]
    num_experts, two_inter, _ = gate_up.shape
    inter = two_inter // 2
    assert gate_up.shape[2] == hidden and down.shape == (num_experts, hidden, inter)
    assert gate_up.dtype == down.dtype == x.dtype
    assignments = tokens * top_k
    if assignments == 0:
        return torch.zeros_like(x)
    cfg = config or pick_config(tokens)
    block_m = cfg.block_m
    elem = x.element_size()
    cfg_a = _fit(cfg.gate_up, block_m, inter, hidden, 2, elem)
    cfg_b = _fit(cfg.down, block_m, hidden, inter, 1, elem)
    ieee = x.dtype == torch.float32
    sorted_ids, block_expert = align_assignments(ids, num_experts, block_m)
    max_blocks = block_expert.shape[0]
    act = torch.empty((sorted_ids.shape[0], inter), dtype=x.dtype, device=x.device)
    _gate_up_kernel[(max_blocks, triton.cdiv(inter, cfg_a.block_n))](
        x, gate_up, act, sorted_ids, block_expert,
        assignments, hidden, inter,
        x.stride(0), x.stride(1), gate_up.stride(0), gate_up.stride(1), gate_up.stride(2),
        act.stride(0), act.stride(1),
        TOP_K=top_k, IEEE=ieee, BLOCK_M=block_m, BLOCK_N=cfg_a.block_n, BLOCK_K=cfg_a.block_k,
        num_warps=cfg_a.num_warps, num_stages=cfg_a.num_stages,
    )
    per_slot = torch.empty((assignments, hidden), dtype=x.dtype, device=x.device)
    _down_kernel[(max_blocks, triton.cdiv(hidden, cfg_b.block_n))](
        act, down, per_slot, sorted_ids, block_expert, weights.reshape(-1).contiguous(),
        assignments, hidden, inter,
        act.stride(0), act.stride(1), down.stride(0), down.stride(1), down.stride(2),
        per_slot.stride(0), per_slot.stride(1),
        IEEE=ieee, BLOCK_M=block_m, BLOCK_N=cfg_b.block_n, BLOCK_K=cfg_b.block_k,
        num_warps=cfg_b.num_warps, num_stages=cfg_b.num_stages,
    )
    return per_slot.view(tokens, top_k, hidden).sum(dim=1, dtype=torch.float32).to(x.dtype)


# The gate_up pass of the grouped path (:func:`sorted_gate_up`): (block_m, config) for every row count, so
# a row's arithmetic (the K order of its dot products) never depends on how many rows share its forward.
# From tools/tune_moe.py on the H200 at 32K tokens: 2,997-3,016 us
# with weight tiles by tensor descriptor, 3,061-3,073 us by pointer, against 3,196-3,433 us for the
# gathered copy, torch's grouped GEMM and the SiLU-gate pass it replaces. (Four stages do not fit the
# shared-memory budget at this tile; ``_fit`` runs them as three.)
SORTED_GATE_UP: tuple[int, GemmConfig] = (128, GemmConfig(128, 64, 8, 3))
SORTED_GATE_UP_TMA = True


@triton.jit
def _tile_end_kernel(ends_ptr, tile_end_ptr, num_experts, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """``tile_end[e]``: how many ``BLOCK_M``-row tiles experts ``0..e`` take, from where their runs end."""
    e = tl.arange(0, BLOCK_E)
    ok = e < num_experts
    end = tl.load(ends_ptr + e, mask=ok, other=0)
    start = tl.load(ends_ptr + e - 1, mask=ok & (e > 0), other=0)
    tiles = tl.where(ok, (end - start + BLOCK_M - 1) // BLOCK_M, 0)
    tl.store(tile_end_ptr + e, tl.cumsum(tiles, 0), mask=ok)


# The most (token, expert) assignments :func:`sort_assignments` groups in its one program (decode batches, short
# prompts).
SORT_MAX = 1024


@triton.jit
def _sort_kernel(ids_ptr, order_ptr, inverse_ptr, token_ptr, ends_ptr, tile_end_ptr, cursor_ptr, assignments,
                 num_experts, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_A: tl.constexpr, BINS: tl.constexpr):
    """One program: the experts' counts (a histogram), where their runs end and their row tiles
    (:func:`_tile_end_kernel`) by two scans, then each assignment takes the next place of its expert's run by an
    atomic increment of a cursor from the run's start."""
    i = tl.arange(0, BLOCK_A)
    ok = i < assignments
    expert = tl.where(ok, tl.load(ids_ptr + i, mask=ok, other=0).to(tl.int32), num_experts)  # past: a spare bin
    count = tl.histogram(expert, BINS)
    end = tl.cumsum(count, 0)
    e = tl.arange(0, BINS)
    real = e < num_experts
    tl.store(ends_ptr + e, end, mask=real)
    tl.store(cursor_ptr + e, end - count, mask=real)
    tl.store(tile_end_ptr + e, tl.cumsum((count + BLOCK_M - 1) // BLOCK_M, 0), mask=real)
    tl.debug_barrier()  # the cursors stored above, taken by other threads
    pos = tl.atomic_add(cursor_ptr + expert, 1, mask=ok)
    tl.store(inverse_ptr + i, pos, mask=ok)
    tl.store(order_ptr + pos, i, mask=ok)
    tl.store(token_ptr + pos, i // TOP_K, mask=ok)


def sort_assignments(ids: torch.Tensor, num_experts: int, block_m: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(order, inverse, token, ends, tile_end)`` of ``ids [T, K]``'s at most :data:`SORT_MAX` assignments in one
    launch: ``order`` the assignments grouped by expert in expert order (within an expert's run in no set order,
    which no row's result depends on), ``inverse`` its inverse, ``token = order // K``, ``ends`` int32 where each
    expert's run ends, ``tile_end`` as :func:`tile_ends` gives for ``block_m``-row tiles."""
    assignments, top_k = ids.numel(), ids.shape[1]
    assert 0 < assignments <= SORT_MAX, assignments
    flat = ids.reshape(-1)
    order = torch.empty(assignments, dtype=torch.int64, device=ids.device)
    inverse, token = torch.empty_like(order), torch.empty_like(order)
    ends = torch.empty(num_experts, dtype=torch.int32, device=ids.device)
    tile_end, cursor = torch.empty_like(ends), torch.empty_like(ends)
    block_a = max(32, triton.next_power_of_2(assignments))
    _sort_kernel[(1,)](flat, order, inverse, token, ends, tile_end, cursor, assignments, num_experts, TOP_K=top_k,
                       BLOCK_M=block_m, BLOCK_A=block_a, BINS=triton.next_power_of_2(num_experts + 1), num_warps=4)
    return order, inverse, token, ends, tile_end


@triton.jit
def expert_tile(pid_m, ends_ptr, tile_end_ptr, num_experts, BLOCK_M: tl.constexpr):
    """``(expert, rows [BLOCK_M], valid)`` of row tile ``pid_m`` (below the real tile count) of expert-sorted rows
    whose runs end at ``ends`` and take ``tile_end`` tiles up to each expert (:func:`_tile_end_kernel`)."""
    lo = 0  # the expert of this tile: the first whose tile_end exceeds pid_m
    hi = num_experts - 1
    while lo < hi:
        mid = (lo + hi) // 2
        above = tl.load(tile_end_ptr + mid) > pid_m
        hi = tl.where(above, mid, hi)
        lo = tl.where(above, lo, mid + 1)
    expert = lo
    start = tl.load(ends_ptr + expert - 1, mask=expert > 0, other=0)
    end = tl.load(ends_ptr + expert)
    first_tile = tl.load(tile_end_ptr + expert) - tl.cdiv(end - start, BLOCK_M)
    rows = start + (pid_m - first_tile) * BLOCK_M + tl.arange(0, BLOCK_M)
    return expert, rows, rows < end


@triton.jit
def _sorted_gate_up_kernel(
    x_ptr, w_ptr, w_desc, out_ptr, order_ptr, ends_ptr, tile_end_ptr,
    num_experts, hidden, inter,
    sx_t, sx_h, sw_e, sw_n, sw_h, so_m, so_n,
    TOP_K: tl.constexpr, IEEE: tl.constexpr, EVEN_K: tl.constexpr, TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # Column tiles vary fastest, so the programs of one row tile run together and share its gathered rows.
    num_n = tl.cdiv(inter, BLOCK_N)
    pid_m = tl.program_id(0) // num_n
    pid_n = tl.program_id(0) % num_n
    if pid_m >= tl.load(tile_end_ptr + num_experts - 1):  # past the real tiles
        return
    expert, rows, valid = expert_tile(pid_m, ends_ptr, tile_end_ptr, num_experts, BLOCK_M)
    token = (tl.load(order_ptr + rows, mask=valid, other=0) // TOP_K).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < inter
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + token[:, None] * sx_t + ks[None, :] * sx_h
    g_ptrs = w_ptr + expert.to(tl.int64) * sw_e + cols.to(tl.int64)[None, :] * sw_n + ks[:, None] * sw_h
    u_ptrs = g_ptrs + inter * sw_n  # up rows follow the I gate rows
    w_row = expert * 2 * inter + pid_n * BLOCK_N  # the gate tile's first row in gate_up viewed [E * 2I, H]
    act = _silu_gate_tile(a_ptrs, g_ptrs, u_ptrs, w_desc, w_row, valid, cmask, hidden, inter, sx_h, sw_h,
                          TMA, EVEN_K, IEEE, BLOCK_M, BLOCK_N, BLOCK_K)
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * so_m + cols[None, :] * so_n
    tl.store(out_ptrs, act.to(out_ptr.dtype.element_ty), mask=valid[:, None] & cmask[None, :])


def tile_ends(ends: torch.Tensor, rows: int, block_m: int) -> tuple[torch.Tensor, int]:
    """``(tile_end [E], max_tiles)`` for ``rows`` expert-sorted rows whose runs end at ``ends``: the
    ``block_m``-row tiles experts ``0..e`` take (one launch), and a bound on their count from shapes alone."""
    num_experts = ends.shape[0]
    tile_end = torch.empty_like(ends)
    _tile_end_kernel[(1,)](ends, tile_end, num_experts, BLOCK_M=block_m, BLOCK_E=triton.next_power_of_2(num_experts))
    return tile_end, max_tiles(rows, block_m, num_experts)


def max_tiles(rows: int, block_m: int, num_experts: int) -> int:
    """A bound on the ``block_m``-row tiles ``rows`` expert-sorted rows over ``num_experts`` take, from shapes alone."""
    return triton.cdiv(rows, block_m) + min(num_experts, rows)


def sorted_gate_up(x: torch.Tensor, order: torch.Tensor, ends: torch.Tensor, gate_up: torch.Tensor, top_k: int,
                   config: tuple[int, GemmConfig] | None = None, tma: bool | None = None) -> torch.Tensor:
    """``silu(g) * u`` where ``[g | u] = x[order // top_k] @ gate_up[e].T`` for the rows of each expert ``e``.

    x ``[T, H]``; ``order [A]`` the (token, slot) assignments sorted by expert (``A = T * top_k``);
    ``ends [E]`` int32, where each expert's run in ``order`` ends (expert ``e`` holds rows
    ``ends[e-1]:ends[e]``); gate_up ``[E, 2I, H]`` (gate rows first). Returns ``[A, I]`` in ``order``'s
    order: the gather, the grouped GEMM and the SiLU gate in one pass, with no ``[A, H]`` gathered copy and
    no ``[A, 2I]`` product in memory. Each row tile belongs to one expert; no host sync. ``tma`` (default
    :data:`SORTED_GATE_UP_TMA`) reads the weight tiles through a tensor descriptor where ``gate_up`` is
    contiguous and 16-byte aligned; the rows are gathered by pointer either way.
    """
    assignments, (num_experts, two_inter, hidden) = order.numel(), gate_up.shape
    inter = two_inter // 2
    assert x.shape[1] == hidden and ends.shape == (num_experts,) and x.dtype == gate_up.dtype
    block_m, gemm = config or SORTED_GATE_UP
    tma = SORTED_GATE_UP_TMA if tma is None else tma
    gemm = _fit(gemm, block_m, inter, hidden, 2, x.element_size())
    out = torch.empty(assignments, inter, dtype=x.dtype, device=x.device)
    if assignments == 0:
        return out
    tile_end, max_tiles = tile_ends(ends, assignments, block_m)
    grid = (max_tiles * triton.cdiv(inter, gemm.block_n),)
    tma = tma and gate_up.is_contiguous() and gate_up.data_ptr() % 16 == 0 and hidden * x.element_size() % 16 == 0
    desc = TensorDescriptor.from_tensor(gate_up.view(-1, hidden), [gemm.block_n, gemm.block_k]) if tma else None
    _sorted_gate_up_kernel[grid](
        x, gate_up, desc, out, order, ends, tile_end, num_experts, hidden, inter,
        x.stride(0), x.stride(1), gate_up.stride(0), gate_up.stride(1), gate_up.stride(2),
        out.stride(0), out.stride(1),
        TOP_K=top_k, IEEE=x.dtype == torch.float32, EVEN_K=hidden % gemm.block_k == 0, TMA=tma,
        BLOCK_M=block_m, BLOCK_N=gemm.block_n, BLOCK_K=gemm.block_k,
        num_warps=gemm.num_warps, num_stages=gemm.num_stages,
    )
    return out


@triton.jit
def _silu_mul_kernel(h_ptr, out_ptr, rows, inter, stride_h, stride_o, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = (r < rows)[:, None] & (c < inter)[None, :]
    base = h_ptr + r.to(tl.int64)[:, None] * stride_h + c[None, :]
    gate = tl.load(base, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(base + inter, mask=ok, other=0.0).to(tl.float32)
    act = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + r.to(tl.int64)[:, None] * stride_o + c[None, :], act.to(out_ptr.dtype.element_ty), mask=ok)


def silu_mul(h: torch.Tensor) -> torch.Tensor:
    """``silu(h[:, :I]) * h[:, I:]`` for ``h [R, 2I]`` in one pass (fp32 arithmetic)."""
    rows, inter = h.shape[0], h.shape[1] // 2
    out = torch.empty(rows, inter, dtype=h.dtype, device=h.device)
    if rows:
        grid = (triton.cdiv(rows, 16), triton.cdiv(inter, 256))
        _silu_mul_kernel[grid](h, out, rows, inter, h.stride(0), out.stride(0), BLOCK_R=16, BLOCK_C=256,
                               num_warps=4)
    return out


@triton.jit
def _round_bf16(x):
    """fp32 -> the nearest bfloat16 value (ties to even), still fp32; NaN stays NaN. Integer operations on
    the bits: the result does not depend on how the compiler treats a float cast round trip, and Triton's
    interpreter (whose casts to bf16 truncate) computes the same."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))


@triton.jit
def _combine_kernel(h_ptr, inv_ptr, w_ptr, out_ptr, shared_ptr, gate_ptr, hidden, stride_h, stride_o, stride_s,
                    TOP_K: tl.constexpr, SHARED: tl.constexpr, ROUND_BF16: tl.constexpr, BLOCK_C: tl.constexpr):
    t = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = c < hidden
    acc = tl.zeros([BLOCK_C], tl.float32)
    for k in tl.static_range(TOP_K):
        src = tl.load(inv_ptr + t * TOP_K + k).to(tl.int64)
        w = tl.load(w_ptr + t * TOP_K + k).to(tl.float32)
        acc += w * tl.load(h_ptr + src * stride_h + c, mask=ok, other=0.0).to(tl.float32)
    if ROUND_BF16:  # rounded here, so the store converts exact values (Triton's interpreter truncates)
        acc = _round_bf16(acc)
    if SHARED:  # + gate * shared_out, each op rounded to bf16 as torch's bf16 ops round
        gate = tl.load(gate_ptr + t).to(tl.float32)
        s = tl.load(shared_ptr + t.to(tl.int64) * stride_s + c, mask=ok, other=0.0).to(tl.float32)
        acc = _round_bf16(acc + _round_bf16(gate * s))
    tl.store(out_ptr + t.to(tl.int64) * stride_o + c, acc.to(out_ptr.dtype.element_ty), mask=ok)


def combine(h_sorted: torch.Tensor, inverse: torch.Tensor, weights: torch.Tensor,
            shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``out[t] = sum_k weights[t, k] * h_sorted[inverse[t * K + k]]`` in fp32, one read of ``h_sorted``.

    ``h_sorted`` holds the expert outputs in expert-sorted order; ``inverse`` maps each (token, slot)
    assignment to its row there. Replaces the scale, scatter and sum passes of the grouped path.
    ``shared = (shared_out [T, H], gate [T, 1])``, bf16 like ``h_sorted``, adds the gated shared expert in
    the same pass with the roundings of the torch ops ``out.to(bf16) + gate * shared_out``: the same bits.
    """
    tokens, top_k = weights.shape
    hidden = h_sorted.shape[1]
    out = torch.empty(tokens, hidden, dtype=h_sorted.dtype, device=h_sorted.device)
    if shared is not None:
        shared_out, gate = shared
        assert h_sorted.dtype == shared_out.dtype == gate.dtype == torch.bfloat16, "the shared fold rounds to bf16"
        assert shared_out.shape == out.shape and shared_out.stride(-1) == 1 and gate.shape == (tokens, 1)
        extra = (shared_out, gate.contiguous(), shared_out.stride(0))
    else:
        extra = (out, out, 0)  # unused
    if tokens:
        grid = (tokens, triton.cdiv(hidden, 1024))
        _combine_kernel[grid](h_sorted, inverse, weights.contiguous(), out, extra[0], extra[1], hidden,
                              h_sorted.stride(0), out.stride(0), extra[2], TOP_K=top_k, SHARED=shared is not None,
                              ROUND_BF16=out.dtype == torch.bfloat16, BLOCK_C=1024, num_warps=4)
    return out
