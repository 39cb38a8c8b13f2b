"""The published weight formats, quantized and dequantized exactly, in torch (the reference every kernel is checked
against, and the CPU path).

- **NVFP4** (NVIDIA ModelOpt): each value an e2m1 code (magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 the sign),
  two a byte with the even element in the low nibble; a float8_e4m3fn scale per 16 consecutive values of a row;
  an fp32 global scale. ``value = e2m1 * float(scale) * scale_2``, with ``scale_2 = amax / (6 * 448)``.
- **Block FP8** (Qwen, DeepSeek): float8_e4m3fn values and one scale per 128 x 128 block (``weight_scale_inv``,
  bf16 or fp32). ``value = fp8 * scale`` of its block.
- **Per-tensor FP8** (the n-gram table): float8_e4m3fn values and one fp32 scale for the whole tensor.

Quantizing rounds to nearest (ties to the even code for e2m1, as torch's float8 cast does for e4m3).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

E2M1_MAX, E4M3_MAX = 6.0, 448.0
NVFP4_GROUP = 16
FP8_BLOCK = 128
# e2m1 code -> value (codes 8-15 are the negatives of 0-7).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# Midpoints between consecutive e2m1 magnitudes: a magnitude rounds to the code past the midpoints it exceeds.
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """The float32 values of uint8 e2m1 codes (``E2M1_VALUES[code]``), by arithmetic on the code's bits: no table
    copied to the device, so a CUDA graph can capture it."""
    e, m = (codes >> 1) & 3, (codes & 1).float()
    mag = torch.where(e == 0, m * 0.5, (m + 2) * torch.exp2(e.float() - 2))
    return torch.where(codes >= 8, -mag, mag)


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """uint8 e2m1 codes of ``x`` (already divided by its scales): the nearest magnitude, a tie going to the even
    code; beyond 6 the largest; the sign in bit 3 (zero is positive)."""
    mag = x.abs().float()
    mids = torch.tensor(_MIDPOINTS, dtype=torch.float32, device=x.device)
    code = torch.bucketize(mag, mids)  # the number of midpoints below mag: exactly at one, the lower code
    # A tie between two codes goes to the even one.
    tie = (mag[..., None] == mids).any(-1)
    code = torch.where(tie & (code % 2 == 1), code + 1, code)
    return (code.to(torch.uint8) | ((x < 0).to(torch.uint8) << 3))


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """``[..., 2n]`` codes -> ``[..., n]`` bytes, the even element in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """:func:`pack_nibbles` undone: ``[..., n]`` bytes -> ``[..., 2n]`` codes."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def quantize_nvfp4(w: torch.Tensor, scale_2: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``w [..., R, C]`` (``C`` a multiple of 16) -> ``(packed uint8 [..., R, C/2], scale e4m3 [..., R, C/16],
    scale_2 fp32 scalar)``; ``scale_2`` defaults to ``amax(|w|) / (6 * 448)``."""
    if w.shape[-1] % NVFP4_GROUP:
        raise ValueError(f"NVFP4 needs rows of a multiple of {NVFP4_GROUP} values, got {w.shape[-1]}")
    w = w.float()
    if scale_2 is None:
        scale_2 = w.abs().amax() / (E2M1_MAX * E4M3_MAX)
    scale_2 = torch.as_tensor(scale_2, dtype=torch.float32, device=w.device)
    groups = w.unflatten(-1, (-1, NVFP4_GROUP))
    scale = groups.abs().amax(-1) / (E2M1_MAX * scale_2)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    scale = scale.clamp(2.0 ** -9, E4M3_MAX).to(torch.float8_e4m3fn)
    codes = e2m1_codes(groups / (scale.float() * scale_2)[..., None]).flatten(-2)
    return pack_nibbles(codes), scale, scale_2


def dequantize_nvfp4(packed: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``e2m1 * (float(scale) * scale_2)``. ``scale_2`` is a scalar, or one per row as ``[..., R, 1]``."""
    values = e2m1_values(unpack_nibbles(packed))
    block = scale.float() * scale_2.float()  # the scale of each group of 16 (the producer's order of rounding)
    return (values.unflatten(-1, (-1, NVFP4_GROUP)) * block[..., None]).flatten(-2).to(dtype)


class Nvfp4(NamedTuple):
    """A stack of NVFP4 matrices ``[..., R, C]`` as stored: ``packed`` uint8 ``[..., R, C/2]``, ``scale`` e4m3
    ``[..., R, C/16]``, ``scale_2`` fp32 ``[..., R, 1]`` (one global scale per row)."""

    packed: torch.Tensor
    scale: torch.Tensor
    scale_2: torch.Tensor

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_nvfp4(self.packed, self.scale, self.scale_2, dtype)


def quantize_fp8_block(w: torch.Tensor, scale_dtype: torch.dtype = torch.float32
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [..., R, C]`` -> ``(float8_e4m3fn [..., R, C], scale [..., ceil(R/128), ceil(C/128)])`` with
    ``scale = amax / 448`` of each block (1 for an all-zero block), rounded to ``scale_dtype`` before the values
    are divided by it (so that dequantizing with the stored scale is what was quantized)."""
    w = w.float()
    rows, cols = w.shape[-2:]
    rb, cb = -(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)
    padded = torch.zeros((*w.shape[:-2], rb * FP8_BLOCK, cb * FP8_BLOCK), dtype=torch.float32, device=w.device)
    padded[..., :rows, :cols] = w
    blocks = padded.unflatten(-2, (rb, FP8_BLOCK)).unflatten(-1, (cb, FP8_BLOCK))  # [..., rb, 128, cb, 128]
    scale = blocks.abs().amax(dim=(-3, -1)) / E4M3_MAX
    scale = torch.where(scale == 0, torch.ones_like(scale), scale).to(scale_dtype)
    q = (blocks / scale.float()[..., :, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.flatten(-4, -3).flatten(-2)[..., :rows, :cols].contiguous(), scale


def dequantize_fp8_block(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32,
                         block_rows: torch.Tensor | None = None) -> torch.Tensor:
    """``fp8 * scale`` of its 128 x 128 block. ``block_rows`` (``[R]``) names each row's block row when rows of
    different tensors were stacked (gate rows, then up rows, each tensor's blocks its own); by default row
    ``r`` is in block row ``r // 128``."""
    rows, cols = q.shape[-2:]
    if block_rows is None:
        block_rows = torch.arange(rows, device=q.device) // FP8_BLOCK
    per_row = scale.float().index_select(-2, block_rows)  # [..., R, CB]
    per_value = per_row.repeat_interleave(FP8_BLOCK, dim=-1)[..., :cols]
    return (q.float() * per_value).to(dtype)


def quantize_fp8_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor FP8: ``(float8_e4m3fn values, fp32 scale)`` with ``scale = amax / 448``."""
    w = w.float()
    scale = w.abs().amax() / E4M3_MAX
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return (w / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def dequantize_fp8_tensor(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.float() * scale.float()).to(dtype)
