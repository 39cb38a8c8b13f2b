"""A tensor-core GEMM for the few rows of a decode batch: ``y = x W^T`` for ``x [M, K]`` of up to
:data:`MAX_ROWS` rows (imported for CUDA tensors, and on the CPU by the tests under ``TRITON_INTERPRET=1``).

A decode batch of tens of rows multiplies each weight with every row: too many multiply-adds for the
GEMV's CUDA cores, too few rows for a GEMM's tiles. cuBLAS covers it with split-K kernels and a
reduce (two launches a projection, each a few microseconds whatever the bytes; about twice the
step's dense bytes over the bandwidth at 32 rows). Here the weight is the MMA's wide operand: a
program takes ``BLOCK_N`` weight rows and one slice of the reduction and computes ``W_tile @ x^T`` into
a ``[BLOCK_N, rows]`` fp32 accumulator (rows padded to 16 at least), its K loop software-pipelined
so several weight tiles are in flight. Where the weight has too few rows to fill the GPU, the
reduction is split over programs: each writes its fp32 partial sum, and a second launch adds the
partials in split order (deterministic: a row's result never depends on which program ends first).

Each output is an fp32 sum over the whole row, rounded once to ``y``'s dtype; the split depends only on
the weight's shape and the device, never on the row count. Launched with PDL (``kernels/pdl``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import pdl
from .pdl_triton import pdl_enter, pdl_launch_next, pdl_wait

# The most rows one launch serves (the accumulator is [BLOCK_N, rows padded to a power of two]).
MAX_ROWS = 64


@dataclass(frozen=True)
class SkinnyConfig:
    """A launch's shape: weight rows a program, reduction step, warps, pipeline stages, and the fewest
    programs a launch should have (the reduction is split until it has, or each slice is one step)."""

    block_n: int = 32
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4
    min_programs: int = 264


# Measured on an H100 with ``benchmarks/bench_decode_kernels.py --parts skinny`` over the flash-next
# projections at 8-64 rows.
DEFAULT = SkinnyConfig()


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, out_ptr, rows, n_out, k_in, k_split, stride_x, stride_w, stride_o, stride_split,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
                   PRECISION: tl.constexpr, PDL: tl.constexpr):
    pdl_launch_next(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    nmask = n < n_out
    mmask = m < rows
    k_start = pid_k * k_split
    k_stop = tl.minimum(k_start + k_split, k_in)
    w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_w
    x_rows = x_ptr + m[:, None] * stride_x
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    pdl_wait(PDL)  # x is the previous kernel's output
    for k0 in tl.range(k_start, k_stop, BLOCK_K, num_stages=STAGES):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < k_stop
        w = tl.load(w_rows + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
        x = tl.load(x_rows + k[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        acc = tl.dot(w, tl.trans(x), acc, input_precision=PRECISION)
    # out is y [rows, n_out] (one slice) or the fp32 partials [splits, rows, n_out]
    dest = out_ptr + pid_k * stride_split + m[None, :] * stride_o + n[:, None]
    tl.store(dest, acc.to(out_ptr.dtype.element_ty), mask=nmask[:, None] & mmask[None, :])


@triton.jit
def _sum_splits_kernel(part_ptr, y_ptr, count, splits, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """``y = sum over s of part[s]`` in split order, for ``count`` contiguous outputs."""
    pdl_enter(PDL)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < count
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(splits):
        acc += tl.load(part_ptr + s * count + i, mask=mask, other=0.0)
    tl.store(y_ptr + i, acc.to(y_ptr.dtype.element_ty), mask=mask)


@functools.cache
def _sm_count(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def k_split(n_out: int, k_in: int, cfg: SkinnyConfig, sms: int | None = None) -> tuple[int, int]:
    """``(features a program reduces, programs along K)``: the reduction cut into whole ``block_k`` steps
    until ``cdiv(n_out, block_n)`` weight tiles times the slices reach ``cfg.min_programs`` (``sms``
    scales it for a device other than the one measured: ``min_programs`` is for 132 SMs)."""
    tiles = triton.cdiv(n_out, cfg.block_n)
    steps = max(1, triton.cdiv(k_in, cfg.block_k))
    target = cfg.min_programs if sms is None else triton.cdiv(cfg.min_programs * sms, 132)
    per = max(1, steps // max(1, triton.cdiv(target, tiles)))
    return per * cfg.block_k, triton.cdiv(steps, per)


def skinny_triton(x: torch.Tensor, weight: torch.Tensor, config: SkinnyConfig | None = None) -> torch.Tensor:
    """``x @ weight.T`` for ``x [M, K]`` (M <= :data:`MAX_ROWS`, unit column stride) and ``weight [N, K]``
    (unit column stride, 16-byte aligned rows for the fast path but any stride works), in ``x``'s dtype."""
    cfg = config or DEFAULT
    rows, k_in = x.shape
    n_out = weight.shape[0]
    if weight.shape[1] != k_in:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} do not multiply")
    if rows > MAX_ROWS:
        raise ValueError(f"skinny_triton takes at most {MAX_ROWS} rows, got {rows}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    y = torch.empty(rows, n_out, dtype=x.dtype, device=x.device)
    if rows == 0 or n_out == 0:
        return y
    if k_in == 0:
        return y.zero_()
    sms = _sm_count(x.device.index if x.device.index is not None else torch.cuda.current_device()) \
        if x.is_cuda else None
    per, slices = k_split(n_out, k_in, cfg, sms)
    out = y if slices == 1 else torch.empty(slices, rows, n_out, dtype=torch.float32, device=x.device)
    launch = pdl.launch_args(x)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    _skinny_kernel[(triton.cdiv(n_out, cfg.block_n), slices)](
        x, weight, out, rows, n_out, k_in, per, x.stride(0), weight.stride(0), n_out, rows * n_out,
        BLOCK_M=max(16, triton.next_power_of_2(rows)), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        STAGES=cfg.num_stages, PRECISION=precision, num_warps=cfg.num_warps, **launch)
    if slices > 1:
        count, block = rows * n_out, 1024
        _sum_splits_kernel[(triton.cdiv(count, block),)](out, y, count, slices, BLOCK=block, num_warps=4, **launch)
    return y
