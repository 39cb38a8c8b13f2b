"""Triton kernels for the MoE of small batches: the router's softmax top-k, and the routed plus shared
experts as weight-streaming GEMV kernels.

Imported only for CUDA tensors (and on the CPU by the tests, under ``TRITON_INTERPRET=1``).

At decode sizes a token's ten experts are ten distinct weight matrices read once each: the work is
streaming weights at memory bandwidth, and what costs is everything around it (sorting assignments by
expert, padding them to GEMM tiles, two grouped GEMMs with their setup kernels, the SiLU-gate, the
combine, and the shared expert's own two GEMMs, gate, sigmoid and add: about 25 launches a layer).
Here a layer's MoE is three launches (two after a router that is not a decode step's few rows):

1. ``_router_kernel`` (decode steps of at most :data:`tidal.kernels.gemv.GEMV_ROWS` rows) or the router
   GEMM then ``_route_kernel``: softmax over the expert logits in fp32, the top-k by repeated arg-max
   (ties go to the lower expert id), renormalised if the model says so. ``_router_kernel`` computes the
   logits as ``gemv_triton`` does and routes in its last program (``arrival``); ``_route_kernel`` takes
   one program per token.
2. ``_gate_up_kernel``, grid ``(T * (K + S), cdiv(I, BLOCK_N))`` (``S`` = 1 with a shared expert):
   each program takes one (token, expert) assignment (the shared expert is assignment ``K``) and
   ``BLOCK_N`` of its intermediate columns, reads the gate and up rows of that expert against the
   token's ``x``, and writes ``silu(gate) * up`` in ``x``'s dtype.
3. ``_down_kernel``, the same grid over ``H``: one assignment's ``down`` rows against its activation,
   an fp32 part per assignment (the shared expert's times ``sigmoid(x . shared_gate)``). One program
   per assignment keeps every expert's read in flight at once: a program that walked a token's ten
   experts in turn waited for ten dependent HBM round trips (17.5 us a layer at one token, against
   14.7 us for ``gate_up``'s twice as many bytes; docs/device/2026-11-29e/call6/profile_kernels.log).
   The last of a token's programs over a column block to finish (``arrival``) sums the block: the
   routing-weighted parts in expert order, plus the shared part; fp32 and one rounding at the end.
   Deterministic: the sum's order does not depend on which program arrives last.

Each assignment reads its expert's weights once, so a batch whose tokens share experts reads those
weights once per token (from L2 when it can): the kernels serve batches up to
:data:`tidal.kernels.moe.GEMV_MAX_TOKENS`, and larger ones take the grouped GEMM.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from . import pdl
from .arrival import arrive_last, counters, rearm
from .pdl_triton import pdl_enter, pdl_launch_next, pdl_wait

# Warps of a router program: the top-k is TOP_K dependent reductions over the experts, and within one
# warp they need no shared memory. Measured at 512 experts with scripts/bench_decode_kernels.py.
ROUTE_WARPS = 1


@triton.jit
def _route_row(logits, e, ok, w_ptr, ids_ptr, TOP_K: tl.constexpr, K_PAD: tl.constexpr, RENORM: tl.constexpr):
    """One token's route from its fp32 logits over experts ``e`` (``ok`` masks the padding): the top-k
    probabilities (renormalised if ``RENORM``) and their expert ids, stored at ``w_ptr`` and ``ids_ptr``."""
    p = tl.exp(logits - tl.max(logits, 0))
    p = tl.where(ok, p, 0.0)
    probs = p / tl.sum(p, 0)
    cur = tl.where(ok, probs, -1.0)  # probabilities are >= 0: -1 marks padding and experts taken
    kk = tl.arange(0, K_PAD)
    vals = tl.zeros([K_PAD], tl.float32)
    idx = tl.zeros([K_PAD], tl.int64)
    for k in tl.static_range(TOP_K):
        best, at = tl.max(cur, 0, return_indices=True, return_indices_tie_break_left=True)
        vals = tl.where(kk == k, best, vals)
        idx = tl.where(kk == k, at.to(tl.int64), idx)
        cur = tl.where(e == at, -1.0, cur)
    if RENORM:
        vals = vals / tl.sum(vals, 0)
    out = kk < TOP_K
    tl.store(w_ptr + kk, vals.to(w_ptr.dtype.element_ty), mask=out)
    tl.store(ids_ptr + kk, idx, mask=out)


@triton.jit
def _route_kernel(logits_ptr, w_ptr, ids_ptr, n_experts, stride_l,
                  TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_E: tl.constexpr, RENORM: tl.constexpr,
                  PDL: tl.constexpr):
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    ok = e < n_experts
    logits = tl.load(logits_ptr + t * stride_l + e, mask=ok, other=float("-inf")).to(tl.float32)
    _route_row(logits, e, ok, w_ptr + t * TOP_K, ids_ptr + t * TOP_K, TOP_K, K_PAD, RENORM)


@triton.jit
def _router_kernel(x_ptr, gate_ptr, logits_ptr, w_ptr, ids_ptr, count_ptr, n_experts, hidden, stride_x, stride_g,
                   ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
                   TOP_K: tl.constexpr, K_PAD: tl.constexpr, RENORM: tl.constexpr, PDL: tl.constexpr):
    """The router's projection of ``ROWS`` rows as the weight-streaming GEMV (``gemv_triton``: ``BLOCK_N``
    whole gate rows a program, loaded before the PDL wait, one fp32 dot a logit rounded to the logits'
    dtype), then the route in the program that finishes last (``arrival``), from the rounded logits."""
    pdl_launch_next(PDL)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    nmask = n < n_experts
    kmask = k < hidden
    g = tl.load(gate_ptr + n.to(tl.int64)[:, None] * stride_g + k[None, :],
                mask=nmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
    pdl_wait(PDL)
    for m in tl.static_range(ROWS):
        x = tl.load(x_ptr + m * stride_x + k, mask=kmask, other=0.0).to(tl.float32)
        y = tl.sum(g * x[None, :], axis=1)
        tl.store(logits_ptr + m * n_experts + n, y.to(logits_ptr.dtype.element_ty), mask=nmask)
    if arrive_last(count_ptr, tl.num_programs(0)):
        e = tl.arange(0, BLOCK_E)
        ok = e < n_experts
        for m in tl.static_range(ROWS):
            logits = tl.load(logits_ptr + m * n_experts + e, mask=ok, other=float("-inf"),
                             cache_modifier=".cg").to(tl.float32)
            _route_row(logits, e, ok, w_ptr + m * TOP_K, ids_ptr + m * TOP_K, TOP_K, K_PAD, RENORM)
        rearm(count_ptr)


def route_triton(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                 num_warps: int = ROUTE_WARPS) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`tidal.kernels.moe.route`: ``(weights [T, K] in the logits' dtype,
    expert ids [T, K] int64)``; one launch."""
    tokens, experts = router_logits.shape
    if not 0 < top_k <= experts:
        raise ValueError(f"top_k ({top_k}) must be between 1 and the number of experts ({experts})")
    weights = torch.empty(tokens, top_k, dtype=router_logits.dtype, device=router_logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=router_logits.device)
    if tokens:
        logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
        block = triton.next_power_of_2(experts)
        _route_kernel[(tokens,)](logits, weights, ids, experts, logits.stride(0), TOP_K=top_k,
                                 K_PAD=triton.next_power_of_2(top_k), BLOCK_E=block, RENORM=renormalize,
                                 num_warps=num_warps, **pdl.launch_args(logits))
    return weights, ids


# The router's launch shape: gate weights a program reads (``gemv_triton``'s tile) and warps. The route
# runs in the last program, its top-k a chain of reductions over the experts.
ROUTER_TILE = 4096
ROUTER_WARPS = 8


def router_triton(x: torch.Tensor, gate: torch.Tensor, top_k: int, renormalize: bool,
                  tile: int = ROUTER_TILE, num_warps: int = ROUTER_WARPS) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`tidal.kernels.moe.route` of ``x @ gate.T`` for the few rows of a decode step (``x [T, H]``,
    T <= :data:`tidal.kernels.gemv.MAX_ROWS`; ``gate [E, H]`` in x's dtype): ``(weights [T, K] in x's
    dtype, expert ids [T, K] int64)`` in one launch."""
    from .gemv import MAX_K, MAX_ROWS
    from .gemv_triton import block_n

    tokens, hidden = x.shape
    experts = gate.shape[0]
    if gate.shape[1] != hidden:
        raise ValueError(f"x {tuple(x.shape)} and the router's gate {tuple(gate.shape)} do not multiply")
    if not 0 < top_k <= experts:
        raise ValueError(f"top_k ({top_k}) must be between 1 and the number of experts ({experts})")
    if tokens > MAX_ROWS or hidden > MAX_K:
        raise ValueError(f"router_triton takes at most {MAX_ROWS} rows and {MAX_K} input features, "
                         f"got {tokens} x {hidden}")
    weights = torch.empty(tokens, top_k, dtype=x.dtype, device=x.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=x.device)
    if tokens == 0:
        return weights, ids
    if x.stride(1) != 1:
        x = x.contiguous()
    if gate.stride(1) != 1:
        gate = gate.contiguous()
    logits = torch.empty(tokens, experts, dtype=x.dtype, device=x.device)
    bn = block_n(experts, hidden, tile)
    _router_kernel[(triton.cdiv(experts, bn),)](
        x, gate, logits, weights, ids, counters(x.device, "router", 1), experts, hidden, x.stride(0),
        gate.stride(0), ROWS=tokens, BLOCK_N=bn, BLOCK_K=triton.next_power_of_2(hidden),
        BLOCK_E=triton.next_power_of_2(experts), TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k),
        RENORM=renormalize, num_warps=num_warps, **pdl.launch_args(x))
    return weights, ids


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    """``block_n`` output columns a program; ``block_k`` the reduction tile."""

    block_n: int
    block_k: int
    num_warps: int


# (largest token count, gate_up config, down config), first match wins. Chosen on the H200 at the bench
# shapes (hidden 2048, intermediate 512, top-10 + shared) with scripts/bench_decode_kernels.py: gate_up
# up to 8 tokens 2 columns a program over the whole 2,048-wide reduction in one tile (its loads all in
# flight at once): 28.6 / 45.2 / 132.7 us for the layer's MoE at 1 / 2 / 8 tokens, against 30.2 / 47.0 /
# 139.5 with 8 columns and 512-wide tiles (docs/device/2026-11-30i/call4/), which larger batches keep
# (docs/device/2026-11-29e/call2/, measured from 1 to 64 tokens); the per-assignment down kernel 32 columns
# at 1, 8, 32 and 64 tokens (33.1 / 139.5 / 447.5 / 845.4 us, against 34.1 / 157.4 / 519.0 / 946.0 with
# 16; docs/device/2026-11-29f/call5/).
CONFIGS: tuple[tuple[int, GemvConfig, GemvConfig], ...] = (
    (8, GemvConfig(2, 2048, 4), GemvConfig(32, 512, 4)),
    (1 << 62, GemvConfig(8, 512, 4), GemvConfig(32, 512, 4)),
)


def pick_config(tokens: int) -> tuple[GemvConfig, GemvConfig]:
    for limit, gate_up, down in CONFIGS:
        if tokens <= limit:
            return gate_up, down
    return CONFIGS[-1][1], CONFIGS[-1][2]


@triton.jit
def _gate_up_kernel(x_ptr, ids_ptr, gu_ptr, sgu_ptr, act_ptr,
                    hidden, inter, s_inter, act_width, sx_t, sgu_e,
                    TOP_K: tl.constexpr, SHARED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    PDL: tl.constexpr):
    # Wait, then let the down kernel start: its programs read the expert ids before their own wait.
    pdl_wait(PDL)
    pdl_launch_next(PDL)
    a = tl.program_id(0).to(tl.int64)
    per_token: tl.constexpr = TOP_K + SHARED
    t = a // per_token
    k = a % per_token
    if k < TOP_K:
        expert = tl.load(ids_ptr + t * TOP_K + k).to(tl.int64)
        w = gu_ptr + expert * sgu_e
        n_out = inter
    else:
        w = sgu_ptr
        n_out = s_inter
    n0 = tl.program_id(1) * BLOCK_N
    if n0 >= n_out:  # the routed and the shared intermediate sizes may differ
        return
    cols = n0 + tl.arange(0, BLOCK_N)
    cmask = cols < n_out
    g_rows = w + cols.to(tl.int64)[:, None] * hidden  # gate rows; the up rows follow the n_out gate rows
    u_rows = g_rows + n_out * hidden
    ks = tl.arange(0, BLOCK_K)
    acc_g = tl.zeros([BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        kmask = k0 + ks < hidden
        xv = tl.load(x_ptr + t * sx_t + k0 + ks, mask=kmask, other=0.0).to(tl.float32)
        m = cmask[:, None] & kmask[None, :]
        g = tl.load(g_rows + k0 + ks[None, :], mask=m, other=0.0).to(tl.float32)
        u = tl.load(u_rows + k0 + ks[None, :], mask=m, other=0.0).to(tl.float32)
        acc_g += tl.sum(g * xv[None, :], 1)
        acc_u += tl.sum(u * xv[None, :], 1)
    act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    tl.store(act_ptr + a * act_width + cols, act.to(act_ptr.dtype.element_ty), mask=cmask)


@triton.jit
def _down_kernel(x_ptr, act_ptr, ids_ptr, rw_ptr, down_ptr, sdown_ptr, sgate_ptr, part_ptr, out_ptr, count_ptr,
                 hidden, inter, s_inter, act_width, sx_t, sd_e, so_t,
                 TOP_K: tl.constexpr, SHARED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PDL: tl.constexpr):
    """One (token, expert) assignment's ``down`` rows against its activation, an fp32 part, unweighted; the
    shared expert's (assignment ``K``) times ``sigmoid(x . shared_gate)``. The last of a token's
    assignments to store its part of a column block (``arrival``) sums the parts there: ``sum_k w_k *
    part_k`` in expert order, plus the shared part, fp32, rounded once to the output's dtype.

    Launched with PDL it starts while ``_gate_up_kernel`` finishes: the expert ids are the router's (whose
    grid has completed once every gate_up program has passed its wait, see there), so a program loads its
    first tile of weights before its own wait, and the activations after it."""
    pdl_launch_next(PDL)
    a = tl.program_id(0).to(tl.int64)
    per_token: tl.constexpr = TOP_K + SHARED
    t = a // per_token
    k = a % per_token
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < hidden
    col_off = cols.to(tl.int64)[:, None]
    if k < TOP_K:
        expert = tl.load(ids_ptr + t * TOP_K + k).to(tl.int64)
        rows = down_ptr + expert * sd_e + col_off * inter
        n_red = inter
    else:
        rows = sdown_ptr + col_off * s_inter
        n_red = s_inter
    ks = tl.arange(0, BLOCK_K)
    first = tl.load(rows + ks[None, :], mask=cmask[:, None] & (ks < n_red)[None, :], other=0.0)
    pdl_wait(PDL)
    a_row = act_ptr + a * act_width
    av = tl.load(a_row + ks, mask=ks < n_red, other=0.0).to(tl.float32)
    part = tl.sum(first.to(tl.float32) * av[None, :], 1)
    for k0 in range(BLOCK_K, n_red, BLOCK_K):
        kmask = k0 + ks < n_red
        av = tl.load(a_row + k0 + ks, mask=kmask, other=0.0).to(tl.float32)
        d = tl.load(rows + k0 + ks[None, :], mask=cmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
        part += tl.sum(d * av[None, :], 1)
    if k >= TOP_K:
        gate = tl.zeros([BLOCK_K], tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            kmask = k0 + ks < hidden
            xv = tl.load(x_ptr + t * sx_t + k0 + ks, mask=kmask, other=0.0).to(tl.float32)
            gate += xv * tl.load(sgate_ptr + k0 + ks, mask=kmask, other=0.0).to(tl.float32)
        part = part / (1.0 + tl.exp(-tl.sum(gate, 0)))
    tl.store(part_ptr + a * hidden + cols, part, mask=cmask)
    count = count_ptr + t * tl.num_programs(1) + tl.program_id(1)
    if arrive_last(count, per_token):
        acc = tl.zeros([BLOCK_N], tl.float32)
        for j in tl.static_range(TOP_K):
            weight = tl.load(rw_ptr + t * TOP_K + j).to(tl.float32)
            acc += weight * tl.load(part_ptr + (t * per_token + j) * hidden + cols, mask=cmask, other=0.0,
                                    cache_modifier=".cg")
        if SHARED:
            acc += tl.load(part_ptr + (t * per_token + TOP_K) * hidden + cols, mask=cmask, other=0.0,
                           cache_modifier=".cg")
        tl.store(out_ptr + t * so_t + cols, acc.to(out_ptr.dtype.element_ty), mask=cmask)
        rearm(count)


def moe_gemv(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
             down: torch.Tensor, shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
             configs: tuple[GemvConfig, GemvConfig] | None = None) -> torch.Tensor:
    """``sum_k w_k * down_e(silu(gate_e(x)) * up_e(x))`` over each token's experts ``e = ids[:, k]``, plus
    ``sigmoid(x . gate_s) * down_s(silu(gate_s(x)) * up_s(x))`` when ``shared`` is given; two launches.

    Args: x ``[T, H]``; ids, weights ``[T, K]``; gate_up ``[E, 2I, H]`` (gate rows first); down
    ``[E, H, I]``; ``shared = (gate_up_s [2Is, H], down_s [H, Is], gate [1, H] or [H])``. Weights in
    x's dtype, contiguous along their last dimension; ``configs`` overrides :data:`CONFIGS`.
    """
    tokens, hidden = x.shape
    top_k = ids.shape[1]
    num_experts, two_inter, _ = gate_up.shape
    inter = two_inter // 2
    assert gate_up.shape[2] == hidden and down.shape == (num_experts, hidden, inter)
    assert gate_up.stride(2) == 1 and gate_up.stride(1) == hidden and down.stride(2) == 1 and down.stride(1) == inter
    out = torch.empty_like(x)
    if tokens == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    if shared is not None:
        s_gate_up, s_down, s_gate = (t.contiguous() for t in shared)
        s_inter = s_gate_up.shape[0] // 2
        assert s_gate_up.shape == (2 * s_inter, hidden) and s_down.shape == (hidden, s_inter)
        assert s_gate.numel() == hidden
    else:
        s_gate_up, s_down, s_gate, s_inter = gate_up, down, x, 0
    per_token = top_k + (shared is not None)
    width = max(inter, s_inter)
    cfg_a, cfg_b = configs or pick_config(tokens)
    launch = pdl.launch_args(x)
    act = torch.empty(tokens * per_token, width, dtype=x.dtype, device=x.device)
    ids = ids.contiguous()
    _gate_up_kernel[(tokens * per_token, triton.cdiv(width, cfg_a.block_n))](
        x, ids, gate_up, s_gate_up, act, hidden, inter, s_inter, width, x.stride(0), gate_up.stride(0),
        TOP_K=top_k, SHARED=shared is not None, BLOCK_N=cfg_a.block_n,
        BLOCK_K=min(cfg_a.block_k, triton.next_power_of_2(hidden)), num_warps=cfg_a.num_warps, **launch)
    part = torch.empty(tokens * per_token, hidden, dtype=torch.float32, device=x.device)
    blocks = triton.cdiv(hidden, cfg_b.block_n)
    _down_kernel[(tokens * per_token, blocks)](
        x, act, ids, weights.contiguous(), down, s_down, s_gate, part, out,
        counters(x.device, "moe_down", tokens * blocks), hidden, inter, s_inter, width, x.stride(0),
        down.stride(0), out.stride(0), TOP_K=top_k, SHARED=shared is not None, BLOCK_N=cfg_b.block_n,
        BLOCK_K=min(cfg_b.block_k, triton.next_power_of_2(max(inter, s_inter, 16))),
        num_warps=cfg_b.num_warps, **launch)
    return out
