"""Triton kernels for the MoE of small batches: the router's softmax top-k, and the routed plus shared
experts as weight-streaming GEMV kernels.

Imported only for CUDA tensors (and on the CPU by the tests, under ``TRITON_INTERPRET=1``).

At decode sizes a token's ten experts are ten distinct weight matrices read once each: the work is
streaming weights at memory bandwidth, and what costs is everything around it (sorting assignments by
expert, padding them to GEMM tiles, two grouped GEMMs with their setup kernels, the SiLU-gate, the
combine, and the shared expert's own two GEMMs, gate, sigmoid and add: about 25 launches a layer).
Here a layer's MoE after the router GEMM is four launches:

1. ``_route_kernel``, one program per token: softmax over the expert logits in fp32, the top-k by
   repeated arg-max (ties go to the lower expert id), renormalised if the model says so.
2. ``_gate_up_kernel``, grid ``(T * (K + S), cdiv(I, BLOCK_N))`` (``S`` = 1 with a shared expert):
   each program takes one (token, expert) assignment (the shared expert is assignment ``K``) and
   ``BLOCK_N`` of its intermediate columns, reads the gate and up rows of that expert against the
   token's ``x``, and writes ``silu(gate) * up`` in ``x``'s dtype.
3. ``_down_kernel``, the same grid over ``H``: one assignment's ``down`` rows against its activation,
   an fp32 part per assignment (the shared expert's times ``sigmoid(x . shared_gate)``). One program
   per assignment keeps every expert's read in flight at once: a program that walked a token's ten
   experts in turn waited for ten dependent HBM round trips (17.5 us a layer at one token, against
   14.7 us for ``gate_up``'s twice as many bytes; tools/profile_decode.py --kernel-table).
4. ``_combine_kernel``, grid ``(T, cdiv(H, 512))``: the routing-weighted sum of a token's parts in
   expert order, plus the shared part; fp32 and one rounding at the end. Deterministic: no atomics.

Each assignment reads its expert's weights once, so a batch whose tokens share experts reads those
weights once per token (from L2 when it can): the kernels serve batches up to
:data:`tidal.kernels.moe.GEMV_MAX_TOKENS` (:data:`~tidal.kernels.moe.NVFP4_GEMV_MAX_TOKENS` for NVFP4 experts), and
larger ones take the grouped GEMM.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from . import pdl
from .moe_nvfp4_triton import FP4_UNSCALE, use_asm
from .pdl_triton import pdl_enter, pdl_launch_next, pdl_wait
from .quant import NVFP4_GROUP, Nvfp4

# Warps of a router program: the top-k is TOP_K dependent reductions over the experts, and within one
# warp they need no shared memory. Measured at 512 experts with benchmarks/bench_decode_kernels.py.
ROUTE_WARPS = 1


@triton.jit
def _route_kernel(logits_ptr, w_ptr, ids_ptr, n_experts, stride_l,
                  TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_E: tl.constexpr, RENORM: tl.constexpr,
                  PDL: tl.constexpr):
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    ok = e < n_experts
    logits = tl.load(logits_ptr + t * stride_l + e, mask=ok, other=float("-inf")).to(tl.float32)
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
    tl.store(w_ptr + t * TOP_K + kk, vals.to(w_ptr.dtype.element_ty), mask=out)
    tl.store(ids_ptr + t * TOP_K + kk, idx, mask=out)


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


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    """``block_n`` output columns a program; ``block_k`` the reduction tile."""

    block_n: int
    block_k: int
    num_warps: int


# (largest token count, gate_up config, down config), first match wins. Chosen on the H200 at the bench
# shapes (hidden 2048, intermediate 512, top-10 + shared) with benchmarks/bench_decode_kernels.py: gate_up
# up to 8 tokens 2 columns a program over the whole 2,048-wide reduction in one tile (its loads all in
# flight at once): 28.6 / 45.2 / 132.7 us for the layer's MoE at 1 / 2 / 8 tokens, against 30.2 / 47.0 /
# 139.5 with 8 columns and 512-wide tiles, which larger batches keep (measured from 1 to 64 tokens); the
# per-assignment down kernel 32 columns at 1, 8, 32 and 64 tokens (33.1 / 139.5 / 447.5 / 845.4 us, against
# 34.1 / 157.4 / 519.0 / 946.0 with 16).
CONFIGS: tuple[tuple[int, GemvConfig, GemvConfig], ...] = (
    (8, GemvConfig(2, 2048, 4), GemvConfig(32, 512, 4)),
    (1 << 62, GemvConfig(8, 512, 4), GemvConfig(32, 512, 4)),
)


# The same for NVFP4 routed experts, chosen at flash-next's shapes (hidden 2,560, intermediate 640, top-10, 512
# experts) with tools/tune_moe.py --quantization nvfp4 --hidden 2560 --intermediate 640 (CUDA-graph timing, PTX
# decode, on an H100): reduction tiles that divide 2,560 and 640, so no masked remainder tile. The MoE without the
# shared expert with 2 columns x 512 (gate_up) and 8 x 128 (down): 19.8 / 126.5 / 470.1 us at 1 / 8 / 32 tokens,
# the fastest of the sweep at 1 and 8 tokens and within 0.5% of it at 32.
FP4_CONFIGS: tuple[tuple[int, GemvConfig, GemvConfig], ...] = (
    (1 << 62, GemvConfig(2, 512, 4), GemvConfig(8, 128, 4)),
)


def pick_config(tokens: int, fp4: bool = False) -> tuple[GemvConfig, GemvConfig]:
    """The (gate_up, down) configs for ``tokens`` tokens: :data:`FP4_CONFIGS` for NVFP4 experts, else
    :data:`CONFIGS`."""
    table = FP4_CONFIGS if fp4 else CONFIGS
    for limit, gate_up, down in table:
        if tokens <= limit:
            return gate_up, down
    return table[-1][1], table[-1][2]


@triton.jit
def _gate_up_rows(x_row, w, cols, cmask, hidden, n_out, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """fp32 ``(gate, up)`` of columns ``cols`` of the dense ``[gate; up]`` weight at ``w`` (``2 * n_out`` rows of
    ``hidden``) against the row ``x_row``."""
    g_rows = w + cols.to(tl.int64)[:, None] * hidden  # gate rows; the up rows follow the n_out gate rows
    u_rows = g_rows + n_out * hidden
    ks = tl.arange(0, BLOCK_K)
    acc_g = tl.zeros([BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        kmask = k0 + ks < hidden
        xv = tl.load(x_row + k0 + ks, mask=kmask, other=0.0).to(tl.float32)
        m = cmask[:, None] & kmask[None, :]
        g = tl.load(g_rows + k0 + ks[None, :], mask=m, other=0.0).to(tl.float32)
        u = tl.load(u_rows + k0 + ks[None, :], mask=m, other=0.0).to(tl.float32)
        acc_g += tl.sum(g * xv[None, :], 1)
        acc_u += tl.sum(u * xv[None, :], 1)
    return acc_g, acc_u


@triton.jit
def fp4_codes_asm(b):
    """Packed bytes ``b`` (uint8) as fp16 ``code * 2^-14`` without their scale: ``(even values, odd values)``, four
    bytes a register in PTX. A byte permute puts two bytes in the high halves of a register's 16-bit lanes; there
    the even code's magnitude sits one bit below an fp16's low exponent bits and top mantissa bit and its sign four
    bits below the sign bit, the odd code's magnitude three bits above them and its sign in place: a shift and a
    mask each."""
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 z, r, t, u;
        mov.b32 z, 0;
        prmt.b32 r, $4, z, 0x1404;
        shl.b32 t, r, 1;
        shl.b32 u, r, 4;
        and.b32 t, t, 0x0E000E00;
        and.b32 u, u, 0x80008000;
        or.b32 $0, t, u;
        shr.b32 t, r, 3;
        and.b32 t, t, 0x0E000E00;
        and.b32 u, r, 0x80008000;
        or.b32 $2, t, u;
        prmt.b32 r, $4, z, 0x3424;
        shl.b32 t, r, 1;
        shl.b32 u, r, 4;
        and.b32 t, t, 0x0E000E00;
        and.b32 u, u, 0x80008000;
        or.b32 $1, t, u;
        shr.b32 t, r, 3;
        and.b32 t, t, 0x0E000E00;
        and.b32 u, r, 0x80008000;
        or.b32 $3, t, u;
        }
        """,
        constraints="=r,=r,=r,=r,r", args=[b], dtype=(tl.float16, tl.float16), is_pure=True, pack=4)


@triton.jit
def _fp4_tile(v_row, q_rows, s_rows, zero, rmask, k0, N_RED: tl.constexpr, PAIRS: tl.constexpr, GROUP: tl.constexpr,
              BLOCK_K: tl.constexpr):
    """The loads of one K tile of :func:`_fp4_dot`: ``(packed bytes, scale bytes, v's words or even columns, v's
    odd columns)`` (with ``PAIRS`` the words twice)."""
    H: tl.constexpr = BLOCK_K // 8
    h = tl.arange(0, H)
    at = k0 // 2 + h[:, None] * 4 + tl.arange(0, 4)[None, :]  # [H, 4]: the tile's bytes (column pairs)
    hmask = h * 8 < N_RED - k0
    m3 = rmask[:, None, None] & hmask[None, :, None]
    b = tl.load(q_rows[:, :, None] + at[None, :, :], mask=m3, other=0)
    s = tl.load(s_rows + k0 // GROUP + h[None, :] // (GROUP // 8), mask=rmask[:, None] & hmask[None, :], other=0)
    if PAIRS:
        v = tl.load(v_row.to(tl.pointer_type(tl.uint32)) + zero + at[None, :, :], mask=m3, other=0)
        v_odd = v  # not read
    else:
        v = tl.load(v_row + zero + 2 * at[None, :, :], mask=m3, other=0.0)
        v_odd = tl.load(v_row + zero + 2 * at[None, :, :] + 1, mask=m3, other=0.0)
    return b, s, v, v_odd


@triton.jit
def _fp4_tile_dot(acc, b, s, v, v_odd, ASM: tl.constexpr, PAIRS: tl.constexpr):
    """``acc`` plus one K tile's scaled half-group sums (see :func:`_fp4_dot`)."""
    if PAIRS:
        v_even = (v << 16).to(tl.float32, bitcast=True)
        v_odd = ((v >> 16) << 16).to(tl.float32, bitcast=True)
    else:
        v_even = v.to(tl.float32)
        v_odd = v_odd.to(tl.float32)
    if ASM:
        w_even, w_odd = fp4_codes_asm(b)
    else:
        b16 = b.to(tl.uint16)
        w_even = (((b16 & 7) << 9) | ((b16 & 8) << 12)).to(tl.float16, bitcast=True)
        w_odd = (((b16 & 0x70) << 5) | ((b16 & 0x80) << 8)).to(tl.float16, bitcast=True)
    part = tl.sum(w_even.to(tl.float32) * v_even + w_odd.to(tl.float32) * v_odd, 2)
    return acc + part * s.to(tl.float8e4nv, bitcast=True).to(tl.float16).to(tl.float32)


@triton.jit
def _fp4_dot(v_row, q_ptr, s_ptr, rows, rmask, N_RED: tl.constexpr, ASM: tl.constexpr, PAIRS: tl.constexpr,
             GROUP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """fp32 ``sum_k W[r, k] * v[k]`` for the NVFP4 rows ``rows`` (int64 row numbers of the stack: ``N_RED / 2``
    packed bytes and ``N_RED / 16`` scale bytes a row; ``rmask`` the real ones), without their global scale: 2^-14
    times the sum (times ``FP4_UNSCALE`` and the global scale, it is the rows' product).

    A tile is ``[BLOCK_R, BLOCK_K / 8, 4]``: four packed bytes (eight codes, half a scale group) a thread. Their
    even and odd codes (fp16 ``code * 2^-14``, exact in fp32) meet ``v``'s even and odd columns, loaded in the
    same shape (so in the same layout: no exchange between threads), the eight products are summed in fp32 and
    the sum scaled by its group's e4m3 scale once; the partial sums stay apart until the end, so the reduction
    across threads runs once a program. ``PAIRS``: ``v`` is bf16 and each (even, odd) pair is read as one 32-bit
    word (bf16 widens to fp32 by a shift). The K loop is unrolled (``N_RED`` is a constant) and each tile's loads
    are issued before the tile before it is computed, so a program keeps two tiles of weights in flight."""
    zero = (rows * 0)[:, None, None]  # v's pointers as wide as the weight tile: the same layout
    q_rows = q_ptr + rows[:, None] * (N_RED // 2)
    s_rows = s_ptr + rows[:, None] * (N_RED // GROUP)
    acc = tl.zeros([BLOCK_R, BLOCK_K // 8], tl.float32)
    b, s, v, v_odd = _fp4_tile(v_row, q_rows, s_rows, zero, rmask, 0, N_RED, PAIRS, GROUP, BLOCK_K)
    for k0 in tl.static_range(BLOCK_K, N_RED, BLOCK_K):
        nb, ns, nv, nv_odd = _fp4_tile(v_row, q_rows, s_rows, zero, rmask, k0, N_RED, PAIRS, GROUP, BLOCK_K)
        acc = _fp4_tile_dot(acc, b, s, v, v_odd, ASM, PAIRS)
        b, s, v, v_odd = nb, ns, nv, nv_odd
    acc = _fp4_tile_dot(acc, b, s, v, v_odd, ASM, PAIRS)
    return tl.sum(acc, 1)


@triton.jit
def _gate_up_kernel(x_ptr, ids_ptr, gu_ptr, gus_ptr, gus2_ptr, sgu_ptr, act_ptr,
                    hidden: tl.constexpr, inter: tl.constexpr, s_inter, act_width, sx_t, sgu_e,
                    TOP_K: tl.constexpr, SHARED: tl.constexpr, FP4: tl.constexpr, PAIRS: tl.constexpr,
                    ASM: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    PDL: tl.constexpr):
    # Wait, then let the down kernel start: its programs read the expert ids before their own wait.
    pdl_wait(PDL)
    pdl_launch_next(PDL)
    a = tl.program_id(0).to(tl.int64)
    per_token: tl.constexpr = TOP_K + SHARED
    t = a // per_token
    k = a % per_token
    n_out = tl.where(k < TOP_K, inter, s_inter)  # the routed and the shared intermediate sizes may differ
    n0 = tl.program_id(1) * BLOCK_N
    if n0 >= n_out:
        return
    cols = n0 + tl.arange(0, BLOCK_N)
    cmask = cols < n_out
    x_row = x_ptr + t * sx_t
    if FP4:  # routed experts in NVFP4 (gate rows, then up rows, a global scale each), the shared one dense
        if k < TOP_K:
            # The columns' gate rows and up rows in one tile of 2 * BLOCK_N rows: twice the bytes in flight.
            r = tl.arange(0, 2 * BLOCK_N)
            r_cols = n0 + r % BLOCK_N
            r_mask = r_cols < n_out
            rows = tl.load(ids_ptr + t * TOP_K + k).to(tl.int64) * 2 * inter + r_cols + (r // BLOCK_N) * inter
            acc = _fp4_dot(x_row, gu_ptr, gus_ptr, rows, r_mask, hidden, ASM, PAIRS, GROUP, 2 * BLOCK_N, BLOCK_K)
            acc = tl.reshape(acc * tl.load(gus2_ptr + rows, mask=r_mask, other=0.0) * FP4_UNSCALE, (2, BLOCK_N))
            half = tl.arange(0, 2)[:, None]
            acc_g = tl.sum(tl.where(half == 0, acc, 0.0), 0)
            acc_u = tl.sum(tl.where(half == 1, acc, 0.0), 0)
        else:
            acc_g, acc_u = _gate_up_rows(x_row, sgu_ptr, cols, cmask, hidden, n_out, BLOCK_N, BLOCK_K)
    else:
        if k < TOP_K:
            w = gu_ptr + tl.load(ids_ptr + t * TOP_K + k).to(tl.int64) * sgu_e
        else:
            w = sgu_ptr
        acc_g, acc_u = _gate_up_rows(x_row, w, cols, cmask, hidden, n_out, BLOCK_N, BLOCK_K)
    act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    tl.store(act_ptr + a * act_width + cols, act.to(act_ptr.dtype.element_ty), mask=cmask)


@triton.jit
def _dense_rows(rows, a_row, cmask, n_red, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """fp32 ``sum_k rows[:, k] * a[k]`` (``rows``: pointers to each dense row); the first weight tile is loaded
    before the wait for the previous kernel, the activations after it."""
    ks = tl.arange(0, BLOCK_K)
    first = tl.load(rows + ks[None, :], mask=cmask[:, None] & (ks < n_red)[None, :], other=0.0)
    pdl_wait(PDL)
    av = tl.load(a_row + ks, mask=ks < n_red, other=0.0).to(tl.float32)
    part = tl.sum(first.to(tl.float32) * av[None, :], 1)
    for k0 in range(BLOCK_K, n_red, BLOCK_K):
        kmask = k0 + ks < n_red
        av = tl.load(a_row + k0 + ks, mask=kmask, other=0.0).to(tl.float32)
        d = tl.load(rows + k0 + ks[None, :], mask=cmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
        part += tl.sum(d * av[None, :], 1)
    return part


@triton.jit
def _down_kernel(x_ptr, act_ptr, ids_ptr, down_ptr, ds_ptr, ds2_ptr, sdown_ptr, sgate_ptr, part_ptr,
                 hidden: tl.constexpr, inter: tl.constexpr, s_inter, act_width, sx_t, sd_e,
                 TOP_K: tl.constexpr, SHARED: tl.constexpr, FP4: tl.constexpr, PAIRS: tl.constexpr,
                 ASM: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PDL: tl.constexpr):
    """One (token, expert) assignment's ``down`` rows against its activation, fp32, unweighted; the
    shared expert's (assignment ``K``) times ``sigmoid(x . shared_gate)``.

    Launched with PDL it starts while ``_gate_up_kernel`` finishes: the expert ids are the router's (whose
    grid has completed once every gate_up program has passed its wait, see there), so a dense program loads
    its first tile of weights before its own wait, and the activations after it."""
    pdl_launch_next(PDL)
    a = tl.program_id(0).to(tl.int64)
    per_token: tl.constexpr = TOP_K + SHARED
    t = a // per_token
    k = a % per_token
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < hidden
    col_off = cols.to(tl.int64)[:, None]
    a_row = act_ptr + a * act_width
    if FP4:  # routed experts in NVFP4, the shared one dense
        if k < TOP_K:
            w_rows = tl.load(ids_ptr + t * TOP_K + k).to(tl.int64) * hidden + cols
            pdl_wait(PDL)
            part = _fp4_dot(a_row, down_ptr, ds_ptr, w_rows, cmask, inter, ASM, PAIRS, GROUP, BLOCK_N, BLOCK_K)
            part *= tl.load(ds2_ptr + w_rows, mask=cmask, other=0.0) * FP4_UNSCALE
        else:
            part = _dense_rows(sdown_ptr + col_off * s_inter, a_row, cmask, s_inter, BLOCK_K, PDL)
    else:
        if k < TOP_K:
            rows = down_ptr + tl.load(ids_ptr + t * TOP_K + k).to(tl.int64) * sd_e + col_off * inter
            n_red = inter
        else:
            rows = sdown_ptr + col_off * s_inter
            n_red = s_inter
        part = _dense_rows(rows, a_row, cmask, n_red, BLOCK_K, PDL)
    if k >= TOP_K:
        ks = tl.arange(0, BLOCK_K)
        gate = tl.zeros([BLOCK_K], tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            kmask = k0 + ks < hidden
            xv = tl.load(x_ptr + t * sx_t + k0 + ks, mask=kmask, other=0.0).to(tl.float32)
            gate += xv * tl.load(sgate_ptr + k0 + ks, mask=kmask, other=0.0).to(tl.float32)
        part = part / (1.0 + tl.exp(-tl.sum(gate, 0)))
    tl.store(part_ptr + a * hidden + cols, part, mask=cmask)


@triton.jit
def _combine_kernel(part_ptr, rw_ptr, out_ptr, hidden, so_t,
                    TOP_K: tl.constexpr, SHARED: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    """``sum_k w_k * part_k`` over a token's routed experts in order, then plus the shared expert's part;
    fp32, one rounding."""
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    per_token: tl.constexpr = TOP_K + SHARED
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < hidden
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k in tl.static_range(TOP_K):
        weight = tl.load(rw_ptr + t * TOP_K + k).to(tl.float32)
        acc += weight * tl.load(part_ptr + (t * per_token + k) * hidden + cols, mask=cmask, other=0.0)
    if SHARED:
        acc += tl.load(part_ptr + (t * per_token + TOP_K) * hidden + cols, mask=cmask, other=0.0)
    tl.store(out_ptr + t * so_t + cols, acc.to(out_ptr.dtype.element_ty), mask=cmask)


# NVFP4 experts' codes decoded by PTX on packed registers (:func:`fp4_codes_asm`; never in the interpreter) rather
# than by Triton's per-value integer operations.
FP4_ASM = True

# Output features a combine program sums.
COMBINE_BLOCK = 512


def moe_gemv(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor | Nvfp4,
             down: torch.Tensor | Nvfp4, shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
             configs: tuple[GemvConfig, GemvConfig] | None = None) -> torch.Tensor:
    """``sum_k w_k * down_e(silu(gate_e(x)) * up_e(x))`` over each token's experts ``e = ids[:, k]``, plus
    ``sigmoid(x . gate_s) * down_s(silu(gate_s(x)) * up_s(x))`` when ``shared`` is given; three launches.

    Args: x ``[T, H]``; ids, weights ``[T, K]``; gate_up ``[E, 2I, H]`` (gate rows first); down
    ``[E, H, I]``; ``shared = (gate_up_s [2Is, H], down_s [H, Is], gate [1, H] or [H])``. Weights in
    x's dtype, contiguous along their last dimension, or the routed experts as contiguous
    :class:`~tidal.kernels.quant.Nvfp4` stacks (each assignment then streams 4.5 bits a weight: packed codes and
    group scales decoded in registers, the row's global scale applied to its sum). ``configs`` overrides
    :data:`CONFIGS` (:data:`FP4_CONFIGS`).
    """
    tokens, hidden = x.shape
    top_k = ids.shape[1]
    fp4 = isinstance(gate_up, Nvfp4)
    if fp4:
        assert isinstance(down, Nvfp4)
        num_experts, two_inter = gate_up.packed.shape[:2]
        inter = two_inter // 2
        assert gate_up.packed.shape == (num_experts, two_inter, hidden // 2) and hidden % NVFP4_GROUP == 0
        assert down.packed.shape == (num_experts, hidden, inter // 2) and inter % NVFP4_GROUP == 0
        assert all(t.is_contiguous() for t in (*gate_up, *down))
        gu, gus, gus2 = gate_up.packed, gate_up.scale.view(torch.uint8), gate_up.scale_2
        dn, ds, ds2 = down.packed, down.scale.view(torch.uint8), down.scale_2
    else:
        num_experts, two_inter, _ = gate_up.shape
        inter = two_inter // 2
        assert gate_up.shape[2] == hidden and down.shape == (num_experts, hidden, inter)
        assert gate_up.stride(2) == 1 and gate_up.stride(1) == hidden
        assert down.stride(2) == 1 and down.stride(1) == inter
        gu, gus, gus2, dn, ds, ds2 = gate_up, gate_up, gate_up, down, down, down  # no scales
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
        s_gate_up, s_down, s_gate, s_inter = x, x, x, 0  # not read
    per_token = top_k + (shared is not None)
    width = max(inter, s_inter)
    cfg_a, cfg_b = configs or pick_config(tokens, fp4)
    launch = pdl.launch_args(x)
    act = torch.empty(tokens * per_token, width, dtype=x.dtype, device=x.device)
    ids = ids.contiguous()
    _gate_up_kernel[(tokens * per_token, triton.cdiv(width, cfg_a.block_n))](
        x, ids, gu, gus, gus2, s_gate_up, act, hidden, inter, s_inter, width, x.stride(0), gu.stride(0),
        TOP_K=top_k, SHARED=shared is not None, FP4=fp4, PAIRS=x.dtype == torch.bfloat16, ASM=fp4 and use_asm(FP4_ASM),
        GROUP=NVFP4_GROUP, BLOCK_N=cfg_a.block_n,
        BLOCK_K=min(cfg_a.block_k, triton.next_power_of_2(hidden)), num_warps=cfg_a.num_warps, **launch)
    part = torch.empty(tokens * per_token, hidden, dtype=torch.float32, device=x.device)
    _down_kernel[(tokens * per_token, triton.cdiv(hidden, cfg_b.block_n))](
        x, act, ids, dn, ds, ds2, s_down, s_gate, part, hidden, inter, s_inter, width, x.stride(0), dn.stride(0),
        TOP_K=top_k, SHARED=shared is not None, FP4=fp4, PAIRS=x.dtype == torch.bfloat16, ASM=fp4 and use_asm(FP4_ASM),
        GROUP=NVFP4_GROUP, BLOCK_N=cfg_b.block_n,
        BLOCK_K=min(cfg_b.block_k, triton.next_power_of_2(max(inter, s_inter, 16))),
        num_warps=cfg_b.num_warps, **launch)
    block = min(COMBINE_BLOCK, triton.next_power_of_2(hidden))
    _combine_kernel[(tokens, triton.cdiv(hidden, block))](
        part, weights.contiguous(), out, hidden, out.stride(0), TOP_K=top_k, SHARED=shared is not None,
        BLOCK_N=block, num_warps=4, **launch)
    return out
