"""Fused Gated DeltaNet decode step on slot-pool states (Triton), the kernel of ``gdn.gdn_decode_ref``.

Imported only for CUDA tensors (and on the CPU by the tests, under ``TRITON_INTERPRET=1``).

Two kernels. ``_gdn_decode_kernel`` (:func:`gdn_decode`) is the recurrent step alone, for the decode rows of
a mixed batch. ``_gdn_step_kernel`` (:func:`gdn_decode_step`) is a decode-only batch's whole GDN core after
the conv: the gates from the raw ``a``/``b`` projections, the step, and the gated output norm, one program a
(request, value head) over the head's whole state (the norm spans the head's ``dv`` outputs), so a
layer's gates, recurrence and norm are one launch instead of three.

Decode is bandwidth-bound on the recurrent state (``dk x dv`` fp32 per value head, e.g. 64 KB): the
kernel reads and writes it exactly once per token, in place in the pool. Grid ``(B, Hv, dv / BV)``:
each program loads the q/k rows of its key head (``h // (Hv // Hk)``), l2-normalises them in
registers, loads the ``[dk, BV]`` state tile from the slot (zeros when fresh, without reading the
slot), applies decay, delta update and readout, and stores the tile back and its ``BV`` outputs.
Programs of one slot own disjoint tiles, so the in-place update needs no synchronisation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .gdn_gates_triton import gates
from .norm_triton import gated_norm_rows
from .pdl_triton import pdl_enter, pdl_launch_next, pdl_wait


@triton.jit
def _gdn_decode_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, out_ptr, slots_ptr, fresh_ptr,
    dk, dv, scale, eps,
    sq_b, sq_h, sq_d, sk_b, sk_h, sk_d, sv_b, sv_h, sv_d, sg_b, sg_h, sb_b, sb_h,
    ss_n, ss_h, ss_k, ss_v, so_b, so_h, so_d,
    GROUP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PDL: tl.constexpr,
):
    pdl_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    hk = h // GROUP
    dks = tl.arange(0, BK)
    dvs = tl.program_id(2) * BV + tl.arange(0, BV)
    kmask = dks < dk
    vmask = dvs < dv

    q = tl.load(q_ptr + b * sq_b + hk * sq_h + dks * sq_d, mask=kmask, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + b * sk_b + hk * sk_h + dks * sk_d, mask=kmask, other=0.0).to(tl.float32)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    keep_old = tl.load(fresh_ptr + b) == 0
    s_ptrs = state_ptr + slot * ss_n + h * ss_h + dks[:, None] * ss_k + dvs[None, :] * ss_v
    smask = kmask[:, None] & vmask[None, :]
    s = tl.load(s_ptrs, mask=smask & keep_old, other=0.0)
    g = tl.load(g_ptr + b * sg_b + h * sg_h).to(tl.float32)
    beta = tl.load(beta_ptr + b * sb_b + h * sb_h).to(tl.float32)
    v = tl.load(v_ptr + b * sv_b + h * sv_h + dvs * sv_d, mask=vmask, other=0.0).to(tl.float32)
    s, o = delta_step(q, k, v, s, g, beta, scale, eps)
    tl.store(s_ptrs, s, mask=smask)
    tl.store(out_ptr + b * so_b + h * so_h + dvs * so_d, o.to(out_ptr.dtype.element_ty), mask=vmask)


@triton.jit
def delta_step(q, k, v, s, g, beta, scale, eps):
    """One token of the gated delta rule on a ``[BK, BV]`` fp32 state tile: ``(new tile, output [BV])`` from raw
    fp32 ``q``, ``k`` ``[BK]`` (l2-normalised here, q scaled), ``v`` ``[BV]``, log decay ``g`` and ``beta``."""
    q = q * (tl.rsqrt(tl.sum(q * q, axis=0) + eps) * scale)
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + eps)
    s = s * tl.exp(g)
    memory = tl.sum(s * k[:, None], axis=0)  # S^T k, [BV]
    delta = (v - memory) * beta
    s = s + k[:, None] * delta[None, :]
    return s, tl.sum(s * q[:, None], axis=0)  # S^T q (q already scaled), [BV]


def gdn_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               state_pool: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
    """Triton form of :func:`tidal.kernels.gdn.gdn_decode_ref` (same arguments, result and in-place update).

    ``state_pool`` must be fp32; any strides are accepted for every tensor.
    """
    batch, k_heads, dk = k.shape
    v_heads, dv = v.shape[1], v.shape[2]
    assert q.shape == k.shape and v_heads % k_heads == 0 and state_pool.dtype == torch.float32
    assert state_pool.shape[1:] == (v_heads, dk, dv)
    out = torch.empty((batch, v_heads, dv), dtype=v.dtype, device=v.device)
    if batch == 0:
        return out
    block_k = triton.next_power_of_2(dk)
    block_v = min(32, triton.next_power_of_2(dv))
    fresh = fresh.view(torch.uint8) if fresh.dtype == torch.bool else fresh
    grid = (batch, v_heads, triton.cdiv(dv, block_v))
    _gdn_decode_kernel[grid](
        q, k, v, g, beta, state_pool, out, slots, fresh,
        dk, dv, dk ** -0.5, 1e-6,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), g.stride(0), g.stride(1), beta.stride(0), beta.stride(1),
        state_pool.stride(0), state_pool.stride(1), state_pool.stride(2), state_pool.stride(3),
        out.stride(0), out.stride(1), out.stride(2),
        GROUP=v_heads // k_heads, BK=block_k, BV=block_v, num_warps=4, **pdl.launch_args(v),
    )
    return out


# Warps of a step program. At the bench shapes (a 128 x 128 head) with tools/tune_gdn_step.py, at 1 / 8 / 32
# requests: 4.50 / 8.96 / 47.19 us, against 5.52 / 13.07 / 62.72 with 8 and 8.02 / 17.52 / 76.65 with 16, and
# 6.61 / 12.11 / 46.90 for the three launches it replaces.
STEP_WARPS = 4


@triton.jit
def _gdn_step_kernel(
    qkv_ptr, z_ptr, b_ptr, a_ptr, a_log_ptr, dt_bias_ptr, norm_w_ptr, state_ptr, out_ptr, slots_ptr, fresh_ptr,
    key_dim, dk, dv, scale, eps, norm_eps,
    s_qkv, s_z, s_b, s_a, ss_n, ss_h, ss_k, ss_v, s_o,
    GROUP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, SILU: tl.constexpr, ROUND_MID: tl.constexpr,
    PDL: tl.constexpr,
):
    """Launched with PDL, a program loads the head's state, the gate parameters and the norm weight before
    its wait: the slots are the forward's inputs (on the device before its first kernel) and a slot's state
    was last written by an earlier forward (it serves generated-token decodes only; ``kernels/pdl`` says why
    that write is complete). The fresh flags and the projections are this forward's
    own (read after the wait); a fresh row's state is replaced by zeros without arithmetic on what the slot
    held."""
    pdl_launch_next(PDL)
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    hk = h // GROUP
    dks = tl.arange(0, BK)
    dvs = tl.arange(0, BV)
    kmask = dks < dk
    vmask = dvs < dv
    slot = tl.load(slots_ptr + b).to(tl.int64)
    s_ptrs = state_ptr + slot * ss_n + h * ss_h + dks[:, None] * ss_k + dvs[None, :] * ss_v
    smask = kmask[:, None] & vmask[None, :]
    s = tl.load(s_ptrs, mask=smask, other=0.0)
    a_log = tl.load(a_log_ptr + h).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    w = tl.load(norm_w_ptr + dvs, mask=vmask, other=0.0).to(tl.float32)
    pdl_wait(PDL)
    s = tl.where(tl.load(fresh_ptr + b) == 0, s, 0.0)
    row = qkv_ptr + b * s_qkv
    q = tl.load(row + hk * dk + dks, mask=kmask, other=0.0).to(tl.float32)
    k = tl.load(row + key_dim + hk * dk + dks, mask=kmask, other=0.0).to(tl.float32)
    v = tl.load(row + 2 * key_dim + h * dv + dvs, mask=vmask, other=0.0).to(tl.float32)
    g, beta = gates(tl.load(a_ptr + b * s_a + h).to(tl.float32), tl.load(b_ptr + b * s_b + h).to(tl.float32),
                    a_log, dt_bias)
    dt = out_ptr.dtype.element_ty
    s, o = delta_step(q, k, v, s, g, beta.to(b_ptr.dtype.element_ty).to(tl.float32), scale, eps)
    tl.store(s_ptrs, s, mask=smask)
    # The gated norm of the head's output, rounded to the output dtype first as the core output is.
    z = tl.load(z_ptr + b * s_z + h * dv + dvs, mask=vmask, other=0.0).to(tl.float32)
    out = gated_norm_rows(o.to(dt).to(tl.float32)[None, :], z[None, :], w, dv, norm_eps, dt, SILU, ROUND_MID)
    tl.store(out_ptr + b * s_o + h * dv + dvs[None, :], out.to(dt), mask=vmask[None, :])


def gdn_decode_step(qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor, a_log: torch.Tensor,
                    dt_bias: torch.Tensor, norm_weight: torch.Tensor, norm_eps: float, activation: str,
                    state_pool: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor,
                    num_warps: int | None = None) -> torch.Tensor:
    """Triton form of :func:`tidal.kernels.gdn_varlen.gdn_decode_step` (same arguments, result and in-place
    update): one program a (request, value head) over the head's whole ``dk x dv`` state; ``num_warps``
    overrides :data:`STEP_WARPS`."""
    batch = qkv.shape[0]
    v_heads, dk, dv = state_pool.shape[1:]
    key_dim = (qkv.shape[1] - v_heads * dv) // 2
    k_heads = key_dim // dk
    assert state_pool.dtype == torch.float32 and k_heads * dk == key_dim and v_heads % k_heads == 0
    assert qkv.stride(1) == z.stride(1) == 1 and z.shape == (batch, v_heads * dv)
    assert a.shape == b.shape == (batch, v_heads)
    out = torch.empty((batch, v_heads * dv), dtype=qkv.dtype, device=qkv.device)
    if batch == 0:
        return out
    fresh = fresh.view(torch.uint8) if fresh.dtype == torch.bool else fresh
    block_k, block_v = triton.next_power_of_2(dk), triton.next_power_of_2(dv)
    round_mid = qkv.dtype != torch.float32 and torch.promote_types(norm_weight.dtype, qkv.dtype) == qkv.dtype
    _gdn_step_kernel[(batch, v_heads)](
        qkv, z, b, a, a_log, dt_bias, norm_weight, state_pool, out, slots, fresh,
        key_dim, dk, dv, dk ** -0.5, 1e-6, float(norm_eps),
        qkv.stride(0), z.stride(0), b.stride(0), a.stride(0),
        state_pool.stride(0), state_pool.stride(1), state_pool.stride(2), state_pool.stride(3), out.stride(0),
        GROUP=v_heads // k_heads, BK=block_k, BV=block_v, SILU=activation == "silu", ROUND_MID=round_mid,
        num_warps=num_warps or STEP_WARPS, **pdl.launch_args(qkv),
    )
    return out
