"""Triton kernel for PLE's per-stream value gate (``ple`` holds the reference, :func:`ple_gate_ref`).

``_ple_gate_kernel``: one program per (row, stream). It reads the stream's slice of the key projection
and of the query-normalised streams, and the row's n-gram value (shared by the ``hc`` neighbouring
programs through L2); it normalises the key, forms the gate, and writes the gated value and its conv
norm: the reference spends two norms, two broadcast products and a dozen small passes on it. Every
rounding of the reference's torch ops (to the tensors' dtype) is copied, so bf16 agrees with it to
about an ulp.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .common import MAX_WIDTH
from .hyper_connection_triton import stream_slice


@triton.jit
def _ple_gate_kernel(k_ptr, q_ptr, v_ptr, kw_ptr, cw_ptr, gated_ptr, normed_ptr, hidden, inv_sqrt_hidden,
                     stride_k, stride_q, stride_v, stride_out, eps, HC: tl.constexpr, BLOCK: tl.constexpr):
    row, _, cols, mask, feat = stream_slice(hidden, HC, BLOCK)
    dt = gated_ptr.dtype.element_ty
    k = tl.load(k_ptr + row * stride_k + feat, mask=mask, other=0.0).to(tl.float32)
    kw = tl.load(kw_ptr + feat, mask=mask, other=0.0).to(tl.float32)
    key = (k * tl.rsqrt(tl.sum(k * k, axis=0) / hidden + eps) * (1.0 + kw)).to(dt).to(tl.float32)
    q = tl.load(q_ptr + row * stride_q + feat, mask=mask, other=0.0).to(tl.float32)
    dot = tl.sum((key * q).to(dt).to(tl.float32), axis=0).to(dt).to(tl.float32)
    g = (dot * inv_sqrt_hidden).to(dt).to(tl.float32)
    mag = tl.sqrt_rn(tl.maximum(tl.abs(g), 1e-6).to(dt).to(tl.float32)).to(dt).to(tl.float32)  # as torch.sqrt
    g = tl.where(g > 0, mag, tl.where(g < 0, -mag, 0.0))
    gate = tl.sigmoid(g).to(dt).to(tl.float32)
    v = tl.load(v_ptr + row * stride_v + cols, mask=mask, other=0.0).to(tl.float32)
    gated = (gate * v).to(dt)
    out = row * stride_out + feat
    tl.store(gated_ptr + out, gated, mask=mask)
    x = gated.to(tl.float32)
    cw = tl.load(cw_ptr + feat, mask=mask, other=0.0).to(tl.float32)
    tl.store(normed_ptr + out, (x * tl.rsqrt(tl.sum(x * x, axis=0) / hidden + eps) * (1.0 + cw)).to(dt), mask=mask)


def ple_gate_triton(key_raw: torch.Tensor, query: torch.Tensor, value: torch.Tensor, key_weight: torch.Tensor,
                    conv_weight: torch.Tensor, hc: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused :func:`~tidal.kernels.ple.ple_gate_ref`; the three activations share a dtype and have unit
    feature stride (any row stride)."""
    hidden = value.shape[-1]
    width = hc * hidden
    rows = value.shape[0]
    if key_raw.shape != (rows, width) or query.shape != (rows, width) or key_weight.numel() != width \
            or conv_weight.numel() != width:
        raise ValueError(f"key {tuple(key_raw.shape)}, query {tuple(query.shape)}, value {tuple(value.shape)} and "
                         f"norm weights {key_weight.numel()}, {conv_weight.numel()} do not fit hc={hc}")
    if not key_raw.dtype == query.dtype == value.dtype:
        raise ValueError("key, query and value must share a dtype")
    if hidden > MAX_WIDTH or min(t.stride(-1) for t in (key_raw, query, value)) != 1:
        raise ValueError(f"ple_gate_triton takes at most {MAX_WIDTH} features a stream and unit feature strides")
    gated = torch.empty(rows, width, dtype=value.dtype, device=value.device)
    normed = torch.empty_like(gated)
    if rows == 0:
        return gated, normed
    block = triton.next_power_of_2(hidden)
    _ple_gate_kernel[(rows * hc,)](
        key_raw, query, value, key_weight.contiguous(), conv_weight.contiguous(), gated, normed, hidden,
        1.0 / math.sqrt(hidden), key_raw.stride(0), query.stride(0), value.stride(0), width, float(eps),
        HC=hc, BLOCK=block, num_warps=min(16, max(4, block // 256)))
    return gated, normed


@triton.jit
def _gather_rows_kernel(table_ptr, ids_ptr, out_ptr, n, width, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = r < n
    row = tl.load(ids_ptr + r, mask=ok, other=0).to(tl.int64)
    w = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    m = ok[:, None] & (w < width)[None, :]
    values = tl.load(table_ptr + row[:, None] * width + w[None, :], mask=m)
    tl.store(out_ptr + r.to(tl.int64)[:, None] * width + w[None, :], values, mask=m)


# Rows a program copies, and the bytes of a row it copies (whole 128-byte lines of a PLE row).
GATHER_ROWS, GATHER_BYTES = 16, 512


def gather_rows_triton(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``table[ids]`` (rows of a contiguous 2-D ``table`` of any dtype) written to ``ids``' device in one launch,
    the rows read by the kernel itself: ``table`` may be in pinned host memory (mapped into the device's address
    space), so no row passes through the host and nothing waits for the ids there (a CUDA graph can hold it)."""
    assert table.dim() == 2 and table.is_contiguous()
    out = torch.empty((*ids.shape, table.shape[1]), dtype=table.dtype, device=ids.device)
    n = ids.numel()
    if n:
        raw = table.view(torch.uint8)  # bytes: one kernel for every table dtype (float8 included)
        width = raw.shape[1]
        grid = (triton.cdiv(n, GATHER_ROWS), triton.cdiv(width, GATHER_BYTES))
        _gather_rows_kernel[grid](raw, ids.reshape(-1).contiguous(), out.view(n, -1).view(torch.uint8), n, width,
                                  BLOCK_R=GATHER_ROWS, BLOCK_W=GATHER_BYTES, num_warps=4)
    return out
