"""Routed experts kept in their stored format: :class:`QuantTensor`, a stack of quantized matrices with a leading
expert dimension, and the ops the device expert cache and host banks use on it (the same ones they use on a
plain tensor).

NVFP4 (``fmt == "nvfp4"``): ``data`` uint8 ``[E, R, C/2]`` (two e2m1 codes a byte), ``scale`` float8_e4m3fn
``[E, R, C/16]``, ``scale_2`` fp32 ``[E, R, 1]`` (one global scale per row: a checkpoint's gate and up rows may
carry different ones). Block FP8 (``fmt == "fp8"``): ``data`` float8_e4m3fn ``[E, R, C]``, ``scale`` fp32 ``[E,
RB, CB]``, and ``block_rows`` ``[R]`` naming each row's block row (gate and up are separate tensors, each with
its own 128-row blocks, stacked). Values are :mod:`tidal.kernels.quant`'s formulas.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.backend import use_triton
from ..kernels.moe import fused_experts, fused_experts_nvfp4
from ..kernels.quant import FP8_BLOCK, NVFP4_GROUP, Nvfp4, dequantize_fp8_block, dequantize_nvfp4

EXPERT_FORMATS = ("nvfp4", "fp8")
# The per-expert parts of a QuantTensor, in order (buffer names end in them).
PARTS = ("data", "scale", "scale_2")


@dataclass
class QuantTensor:
    fmt: str
    data: torch.Tensor
    scale: torch.Tensor
    scale_2: torch.Tensor | None  # nvfp4
    block_rows: torch.Tensor | None  # fp8, shared by every expert
    cols: int

    # -- shape -----------------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.data.shape[:-1], self.cols)

    @property
    def device(self) -> torch.device:
        return self.data.device

    def parts(self) -> list[torch.Tensor]:
        """The tensors with the leading expert dimension."""
        return [t for t in (self.data, self.scale, self.scale_2) if t is not None]

    def _with(self, parts: list[torch.Tensor]) -> QuantTensor:
        data, scale, *rest = parts
        return QuantTensor(self.fmt, data, scale, rest[0] if rest else None, self.block_rows, self.cols)

    def bytes_per_expert(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in self.parts())

    # -- the ops of a tensor that the expert store uses ------------------------------------------
    def __getitem__(self, index) -> QuantTensor:
        return self._with([t[index] for t in self.parts()])

    # Indexing moves bytes: float8 parts go through a uint8 view (torch indexes float8 on no device).
    def index_select(self, dim: int, index: torch.Tensor) -> QuantTensor:
        return self._with([_bytes(t).index_select(dim, index).view(t.dtype) for t in self.parts()])

    def index_copy_(self, dim: int, index: torch.Tensor, source: QuantTensor) -> QuantTensor:
        for mine, theirs in zip(self.parts(), source.parts(), strict=True):
            _bytes(mine).index_copy_(dim, index, _bytes(theirs))
        return self

    def copy_(self, source: QuantTensor, non_blocking: bool = False) -> QuantTensor:
        for mine, theirs in zip(self.parts(), source.parts(), strict=True):
            mine.copy_(theirs, non_blocking=non_blocking)
        return self

    def new_empty(self, experts: int, device: torch.device | str, pin_memory: bool = False) -> QuantTensor:
        """An uninitialised stack of ``experts`` in the same format, on ``device``."""
        parts = [torch.empty((experts, *t.shape[1:]), dtype=t.dtype, device=device, pin_memory=pin_memory)
                 for t in self.parts()]
        out = self._with(parts)
        if self.block_rows is not None:
            out.block_rows = self.block_rows.to(device)
        return out

    # -- values ----------------------------------------------------------------------------------
    def nvfp4(self) -> Nvfp4:
        """The NVFP4 parts as the kernels read them."""
        assert self.fmt == "nvfp4", self.fmt
        return Nvfp4(self.data, self.scale, self.scale_2)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The dense ``[..., R, C]`` values in ``dtype`` (one Triton launch for CUDA tensors)."""
        block_rows = self.block_rows.to(self.data.device) if self.block_rows is not None else None
        if use_triton(self.data, "dequant"):
            from ..kernels.quant_triton import dequantize_fp8_block_triton, dequantize_nvfp4_triton

            if self.fmt == "nvfp4":
                return dequantize_nvfp4_triton(self.data, self.scale, self.scale_2, dtype)
            return dequantize_fp8_block_triton(self.data, self.scale, dtype, block_rows)
        if self.fmt == "nvfp4":
            return dequantize_nvfp4(self.data, self.scale, self.scale_2, dtype)
        return dequantize_fp8_block(self.data, self.scale, dtype, block_rows)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


def new_like(t: torch.Tensor | QuantTensor, experts: int, device: torch.device | str,
             pin_memory: bool = False) -> torch.Tensor | QuantTensor:
    """An uninitialised stack of ``experts`` like ``t`` (a plain tensor or a :class:`QuantTensor`)."""
    if isinstance(t, QuantTensor):
        return t.new_empty(experts, device, pin_memory)
    return torch.empty((experts, *t.shape[1:]), dtype=t.dtype, device=device, pin_memory=pin_memory)


def expert_bytes(t: torch.Tensor | QuantTensor) -> int:
    return t.bytes_per_expert() if isinstance(t, QuantTensor) else t[0].numel() * t.element_size()


def read_packed(x: torch.Tensor, t: torch.Tensor | QuantTensor) -> bool:
    """Whether the experts ``t`` compute against ``x`` in their stored bytes: NVFP4 on the kernels' path (CUDA,
    Triton, ``nvfp4`` not sent to the reference by ``TIDAL_KERNELS``)."""
    return isinstance(t, QuantTensor) and t.fmt == "nvfp4" and use_triton(x, "nvfp4")


def routed_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor | QuantTensor,
                   down: torch.Tensor | QuantTensor, shared: tuple[torch.Tensor, torch.Tensor] | None = None
                   ) -> torch.Tensor:
    """:func:`~tidal.kernels.moe.fused_experts` over experts in any stored format: NVFP4 read packed where
    :func:`read_packed`, anything else dequantized to ``x``'s dtype first."""
    if read_packed(x, gate_up):
        return fused_experts_nvfp4(x, ids, weights, gate_up.nvfp4(), down.nvfp4(), shared)
    return fused_experts(x, ids, weights, dense(gate_up, x.dtype), dense(down, x.dtype), shared)


def dense(t: torch.Tensor | QuantTensor, dtype: torch.dtype) -> torch.Tensor:
    """``t``'s values for an operation in ``dtype``: a plain tensor as it is, a quantized one dequantized."""
    return t.dequantize(dtype) if isinstance(t, QuantTensor) else t


def stacked_block_rows(parts: list[int]) -> torch.Tensor:
    """Block row of each row of FP8 matrices of ``parts`` rows each, stacked (each its own 128-row blocks)."""
    rows, base = [], 0
    for n in parts:
        rows.append(torch.arange(n, device="cpu") // FP8_BLOCK + base)
        base += -(-n // FP8_BLOCK)
    return torch.cat(rows)


def empty_experts(fmt: str, experts: int, parts: list[int], cols: int, device: torch.device | str,
                  pin_memory: bool = False) -> QuantTensor:
    """Uninitialised storage of ``experts`` stacked matrices of ``sum(parts)`` rows (``parts``: the rows of each
    checkpoint tensor stacked, e.g. ``[I, I]`` for gate and up) and ``cols`` columns, in ``fmt``."""
    rows = sum(parts)

    def empty(shape, dtype):
        return torch.empty((experts, *shape), dtype=dtype, device=device, pin_memory=pin_memory)

    if fmt == "nvfp4":
        if cols % NVFP4_GROUP:
            raise ValueError(f"NVFP4 needs rows of a multiple of {NVFP4_GROUP} values, got {cols}")
        return QuantTensor("nvfp4", empty((rows, cols // 2), torch.uint8),
                           empty((rows, cols // NVFP4_GROUP), torch.float8_e4m3fn), empty((rows, 1), torch.float32),
                           None, cols)
    if fmt == "fp8":
        blocks = sum(-(-n // FP8_BLOCK) for n in parts)
        return QuantTensor("fp8", empty((rows, cols), torch.float8_e4m3fn),
                           empty((blocks, -(-cols // FP8_BLOCK)), torch.float32), None,
                           stacked_block_rows(parts).to(device), cols)
    raise ValueError(f"experts cannot be stored as {fmt!r}; expected one of {EXPERT_FORMATS}")


def quantize_experts(values: torch.Tensor, parts: list[int], fmt: str, chunk: int = 64) -> QuantTensor:
    """``values [E, R, C]`` (the ``parts`` row blocks of each expert are separate checkpoint tensors, each with its
    own NVFP4 global scale or FP8 blocks) in ``fmt``, ``chunk`` experts at a time."""
    from ..kernels.quant import quantize_fp8_block, quantize_nvfp4

    experts, rows, cols = values.shape
    out = empty_experts(fmt, experts, parts, cols, values.device)
    bounds = [0]
    for n in parts:
        bounds.append(bounds[-1] + n)
    for lo in range(0, experts, chunk):
        hi = min(experts, lo + chunk)
        for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            w = values[lo:hi, a:b].float()
            if fmt == "nvfp4":
                amax = w.abs().amax(dim=(-2, -1), keepdim=True)
                data, scale, scale_2 = quantize_nvfp4(w, amax / (6.0 * 448.0))
                out.data[lo:hi, a:b], out.scale[lo:hi, a:b] = data, scale
                out.scale_2[lo:hi, a:b] = scale_2.expand(hi - lo, b - a, 1)
            else:
                data, scale = quantize_fp8_block(w, torch.bfloat16)  # the published layout's bf16 scales
                out.data[lo:hi, a:b] = data
                first = sum(-(-n // FP8_BLOCK) for n in parts[:i])
                out.scale[lo:hi, first:first + scale.shape[1]] = scale
    return out
