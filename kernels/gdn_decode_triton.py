"""Fused Gated DeltaNet decode step on slot-pool states (Triton), the kernel of ``gdn.gdn_decode_ref``.

Imported only for CUDA tensors (and on the CPU by the tests, under ``TRITON_INTERPRET=1``).

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
from .pdl_triton import pdl_enter


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
    q = q * (tl.rsqrt(tl.sum(q * q, axis=0) + eps) * scale)
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + eps)

    slot = tl.load(slots_ptr + b).to(tl.int64)
    keep_old = tl.load(fresh_ptr + b) == 0
    s_ptrs = state_ptr + slot * ss_n + h * ss_h + dks[:, None] * ss_k + dvs[None, :] * ss_v
    smask = kmask[:, None] & vmask[None, :]
    s = tl.load(s_ptrs, mask=smask & keep_old, other=0.0)

    decay = tl.exp(tl.load(g_ptr + b * sg_b + h * sg_h).to(tl.float32))
    beta = tl.load(beta_ptr + b * sb_b + h * sb_h).to(tl.float32)
    v = tl.load(v_ptr + b * sv_b + h * sv_h + dvs * sv_d, mask=vmask, other=0.0).to(tl.float32)

    s = s * decay
    memory = tl.sum(s * k[:, None], axis=0)  # S^T k, [BV]
    delta = (v - memory) * beta
    s = s + k[:, None] * delta[None, :]
    o = tl.sum(s * q[:, None], axis=0)  # S^T q (q already scaled), [BV]

    tl.store(s_ptrs, s, mask=smask)
    tl.store(out_ptr + b * so_b + h * so_h + dvs * so_d, o.to(out_ptr.dtype.element_ty), mask=vmask)


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
