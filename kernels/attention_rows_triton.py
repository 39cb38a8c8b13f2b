"""An attention layer's per-token work around its projections, in two launches (imported for CUDA tensors,
and on the CPU by the tests under ``TRITON_INTERPRET=1``).

Between the input projection and the attention, ``GatedAttention`` normalises and rotates the queries and
keys, writes K, V and the raw QSA index key to the KV cache, normalises and rotates the index queries
and pools every QSA block the forward completes (gather its raw keys, mean, norm, rotary, store). In
torch that is about twenty launches a layer, each a microsecond or two at a decode step's few rows.
:func:`attention_rows` does the per-token part with one program a token; :func:`qsa_block_keys` pools the
blocks with one program a block. Both round as the references do (``norm_triton.norm_rotary``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .norm_triton import norm_rotary, norm_rotary_heads
from .pdl_triton import pdl_enter


@triton.jit
def _attention_rows_kernel(q_ptr, sq_t, sq_h, k_ptr, sk_t, sk_h, v_ptr, sv_t, sv_h, iq_ptr, siq_t, siq_h,
                           ik_ptr, sik_t, q_w, k_w, iq_w, cos_ptr, sin_ptr, sc_t, rows_ptr,
                           q_out, sqo_t, sqo_h, k_cache, skc_r, skc_h, v_cache, svc_r, svc_h,
                           iq_out, siqo_t, siqo_h, ik_cache, sikc_r,
                           heads, kv_heads, dim, index_heads, index_dim, rot, q_eps, k_eps, iq_eps,
                           BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr, BLOCK_D: tl.constexpr,
                           BLOCK_IH: tl.constexpr, BLOCK_ID: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    dt = q_out.dtype.element_ty
    row = tl.load(rows_ptr + t)
    cos, sin = cos_ptr + t * sc_t, sin_ptr + t * sc_t
    d = tl.arange(0, BLOCK_D)
    dmask = (d < dim)[None, :]
    h = tl.arange(0, BLOCK_H)
    q = norm_rotary_heads(q_ptr + t * sq_t, sq_h, q_w, cos, sin, heads, dim, rot, q_eps, dt, BLOCK_H, BLOCK_D)
    tl.store(q_out + t * sqo_t + h[:, None] * sqo_h + d[None, :], q.to(dt), mask=(h < heads)[:, None] & dmask)
    g = tl.arange(0, BLOCK_KV)
    gmask = (g < kv_heads)[:, None] & dmask
    k = norm_rotary_heads(k_ptr + t * sk_t, sk_h, k_w, cos, sin, kv_heads, dim, rot, k_eps, dt, BLOCK_KV, BLOCK_D)
    tl.store(k_cache + row * skc_r + g[:, None] * skc_h + d[None, :], k.to(dt), mask=gmask)
    v = tl.load(v_ptr + t * sv_t + g[:, None] * sv_h + d[None, :], mask=gmask)
    tl.store(v_cache + row * svc_r + g[:, None] * svc_h + d[None, :], v, mask=gmask)
    if BLOCK_IH > 0:
        e = tl.arange(0, BLOCK_ID)
        emask = (e < index_dim)[None, :]
        i = tl.arange(0, BLOCK_IH)
        iq = norm_rotary_heads(iq_ptr + t * siq_t, siq_h, iq_w, cos, sin, index_heads, index_dim, rot, iq_eps, dt,
                               BLOCK_IH, BLOCK_ID)
        imask = (i < index_heads)[:, None] & emask
        tl.store(iq_out + t * siqo_t + i[:, None] * siqo_h + e[None, :], iq.to(dt), mask=imask)
        ik = tl.load(ik_ptr + t * sik_t + e, mask=e < index_dim)
        tl.store(ik_cache + row * sikc_r + e, ik, mask=e < index_dim)


def attention_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, norms: tuple, cos: torch.Tensor,
                   sin: torch.Tensor, rows: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   index: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Queries ``q [T, H, d]`` normalised and rotated (returned, contiguous); keys ``k [T, Hkv, d]`` the same,
    written with ``v [T, Hkv, d]`` to rows ``rows [T]`` of ``k_cache``/``v_cache [rows, Hkv, d]``. ``norms``:
    the ``(weight, eps)`` of the query and key norms. With ``index = (iq, ik, (weight, eps), ik_cache)`` also
    the index queries ``iq [T, Hi, di]`` normalised and rotated (returned) and the raw index keys ``ik [T,
    di]`` written to ``ik_cache [rows, di]``. ``cos, sin [T, rotary_dim]`` rotate both. Every feature stride
    is 1."""
    tokens, heads, dim = q.shape
    kv_heads = k.shape[1]
    rot = cos.shape[-1]
    assert rot % 2 == 0 and rot <= dim and cos.stride(1) == 1 and sin.stride() == cos.stride()
    assert q.stride(2) == k.stride(2) == v.stride(2) == k_cache.stride(2) == v_cache.stride(2) == 1
    q_out = torch.empty(tokens, heads, dim, dtype=q.dtype, device=q.device)
    (q_w, q_eps), (k_w, k_eps) = norms
    iq_out = None
    if index is not None:
        iq, ik, (iq_w, iq_eps), ik_cache = index
        index_heads, index_dim = iq.shape[1], iq.shape[2]
        assert rot <= index_dim and iq.stride(2) == ik.stride(1) == ik_cache.stride(1) == 1
        iq_out = torch.empty(tokens, index_heads, index_dim, dtype=q.dtype, device=q.device)
        index_args = (iq, iq.stride(0), iq.stride(1), ik, ik.stride(0))
        block_ih, block_id = triton.next_power_of_2(index_heads), triton.next_power_of_2(index_dim)
    else:
        iq_w, iq_eps, ik_cache, index_heads, index_dim = q_w, 0.0, k_cache, 0, 0
        index_args = (q, 0, 0, q, 0)
        block_ih = block_id = 0
    out_iq = (iq_out, iq_out.stride(0), iq_out.stride(1)) if iq_out is not None else (q_out, 0, 0)
    if tokens:
        block_h, block_d = triton.next_power_of_2(heads), triton.next_power_of_2(dim)
        _attention_rows_kernel[(tokens,)](
            q, q.stride(0), q.stride(1), k, k.stride(0), k.stride(1), v, v.stride(0), v.stride(1), *index_args,
            q_w, k_w, iq_w, cos, sin, cos.stride(0), rows,
            q_out, q_out.stride(0), q_out.stride(1), k_cache, k_cache.stride(0), k_cache.stride(1),
            v_cache, v_cache.stride(0), v_cache.stride(1), *out_iq, ik_cache, ik_cache.stride(0),
            heads, kv_heads, dim, index_heads, index_dim, rot, float(q_eps), float(k_eps), float(iq_eps),
            BLOCK_H=block_h, BLOCK_KV=triton.next_power_of_2(kv_heads), BLOCK_D=block_d, BLOCK_IH=block_ih,
            BLOCK_ID=block_id, num_warps=min(16, max(1, block_h * block_d // 512)), **pdl.launch_args(q))
    return q_out, iq_out


@triton.jit
def _block_keys_kernel(ik_cache, sik_r, rows_ptr, s_rows, pos_ptr, s_pos, s_axis, axis_ptr, w_ptr, inv_freq_ptr,
                       out_ptr, so_r, ratio, dim, rot, eps, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                       MROPE: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    m = tl.program_id(0).to(tl.int64)
    dt = out_ptr.dtype.element_ty
    i = tl.arange(0, BLOCK_R)
    rows = tl.load(rows_ptr + m * s_rows + i, mask=i < ratio, other=0)
    d = tl.arange(0, BLOCK_D)
    dmask = d < dim
    half = rot // 2
    in_rot = d < rot
    partner = tl.where(d < half, d + half, d - half)
    mask = (i < ratio)[:, None] & dmask[None, :]
    # The block's mean key in fp32, rounded to the cache's dtype (and the same at each rotate_half partner).
    x = tl.sum(tl.load(ik_cache + rows[:, None] * sik_r + d[None, :], mask=mask, other=0.0).to(tl.float32), axis=0)
    xp = tl.sum(tl.load(ik_cache + rows[:, None] * sik_r + partner[None, :], mask=mask & in_rot[None, :],
                        other=0.0).to(tl.float32), axis=0)
    x = (x * (1.0 / ratio)).to(dt).to(tl.float32)
    xp = (xp * (1.0 / ratio)).to(dt).to(tl.float32)
    w = tl.load(w_ptr + d, mask=dmask, other=0.0).to(tl.float32)
    wp = tl.load(w_ptr + partner, mask=dmask & in_rot, other=0.0).to(tl.float32)
    # Rotary of the block's first position, rounded to the cache's dtype (``Rotary.cos_sin``); with MROPE each
    # frequency turns with the (frame, row, column) position its axis names.
    if MROPE:
        axis = tl.load(axis_ptr + d % half, mask=in_rot, other=0)
        pos = tl.load(pos_ptr + axis * s_axis + m * s_pos, mask=in_rot, other=0)
    else:
        pos = tl.load(pos_ptr + m * s_pos)
    freqs = pos.to(tl.float32) * tl.load(inv_freq_ptr + d % half, mask=in_rot, other=0.0)
    c = tl.cos(freqs).to(dt).to(tl.float32)
    s = tl.sin(freqs).to(dt).to(tl.float32)
    key = norm_rotary(x[None, :], xp[None, :], w, wp, c, s, d, dim, rot, eps, dt)
    last = tl.load(rows_ptr + m * s_rows + ratio - 1)
    tl.store(out_ptr + last * so_r + d[None, :], key.to(dt), mask=dmask[None, :])


def qsa_block_keys(ik_cache: torch.Tensor, new_rows: torch.Tensor, new_pos: torch.Tensor, weight: torch.Tensor,
                   eps: float, inv_freq: torch.Tensor, out: torch.Tensor, axis: torch.Tensor | None = None) -> None:
    """For each block ``m`` of ``new_rows [Mb, ratio]`` (the KV rows of its tokens) and ``new_pos [Mb]`` (its
    first position), or ``[3, Mb]`` (its (frame, row, column) positions, each frequency turning with the one
    ``axis [rot / 2]`` names): the mean of its raw index keys in ``ik_cache [rows, d]``, RMS-normalised with
    ``weight`` and rotated by ``Rotary.cos_sin(new_pos)``, written to ``out [rows, d]`` at the row of the
    block's last token."""
    blocks, ratio = new_rows.shape
    dim = ik_cache.shape[1]
    rot = 2 * inv_freq.shape[0]
    mrope = new_pos.dim() == 2
    assert ik_cache.stride(1) == out.stride(1) == new_rows.stride(1) == 1 and rot <= dim
    assert not mrope or (axis is not None and new_pos.shape[0] == 3 and axis.shape == inv_freq.shape)
    if blocks:
        _block_keys_kernel[(blocks,)](
            ik_cache, ik_cache.stride(0), new_rows, new_rows.stride(0), new_pos, new_pos.stride(-1),
            new_pos.stride(0) if mrope else 0, axis if mrope else new_pos, weight, inv_freq, out, out.stride(0),
            ratio, dim, rot, float(eps), BLOCK_R=triton.next_power_of_2(ratio), BLOCK_D=triton.next_power_of_2(dim),
            MROPE=mrope, num_warps=4, **pdl.launch_args(ik_cache))
