"""The dequantization kernels (``kernels/quant_triton``) against ``kernels/quant``'s references, bit for bit: every
e4m3 byte as a scale (subnormals, both zeros, NaN), every e2m1 code, a global scale per row or one for the tensor,
FP8 blocks of stacked gate and up rows with partial blocks at the edges, fp32 and bf16 block scales.

Without CUDA the kernels run in the interpreter on small shapes in fp32; the ``gpu`` tests add ``flash-next``'s
expert shapes in bf16.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Must precede the first import of triton; on a GPU machine the kernels run compiled instead.
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton")

from tidal.executor.quant import stacked_block_rows  # noqa: E402
from tidal.kernels.quant import (  # noqa: E402
    dequantize_fp8_block,
    dequantize_nvfp4,
    quantize_fp8_block,
    quantize_nvfp4,
)
from tidal.kernels.quant_triton import dequantize_fp8_block_triton, dequantize_nvfp4_triton  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    # Signed zeros too: the bits, not only the values.
    assert torch.equal(got.view(torch.int16 if got.element_size() == 2 else torch.int32)[~want.isnan()],
                       want.view(torch.int16 if want.element_size() == 2 else torch.int32)[~want.isnan()])


def _every_byte(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """uint8 of ``shape`` holding every value 0-255 at least once, the rest random."""
    flat = torch.randint(0, 256, (int(torch.tensor(shape).prod()),), generator=gen, dtype=torch.int32)
    flat[:256] = torch.arange(256)
    return flat[torch.randperm(flat.numel(), generator=gen)].to(torch.uint8).view(shape)


@pytest.mark.parametrize("per_row", [True, False])
def test_nvfp4_every_code_and_scale_byte(per_row):
    gen = torch.Generator().manual_seed(int(per_row))
    experts, rows, cols = 3, 19, 4 * 16 + 32  # a row of 96 values: 48 bytes, less than one program's tile
    packed = _every_byte((experts, rows, cols // 2), gen)
    scale = _every_byte((experts, rows, cols // 16), gen).view(torch.float8_e4m3fn)
    scale_2 = (torch.rand((experts, rows, 1), generator=gen) + 0.5 if per_row
               else torch.tensor(0.0123, dtype=torch.float32))
    want = dequantize_nvfp4(packed, scale, scale_2, torch.float32)
    got = dequantize_nvfp4_triton(packed.to(DEV), scale.to(DEV), scale_2.to(DEV), torch.float32)
    _same(got.cpu(), want)


def test_nvfp4_rows_past_one_tile_and_a_quantized_matrix():
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(2, 37, 320, generator=gen)
    packed, scale, scale_2 = quantize_nvfp4(w)
    want = dequantize_nvfp4(packed, scale, scale_2, torch.float32)
    got = dequantize_nvfp4_triton(packed.to(DEV), scale.to(DEV), scale_2.to(DEV), torch.float32)
    _same(got.cpu(), want)
    assert (want - w).abs().max() < 0.2 * w.abs().max()  # the values are the matrix, not noise


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_fp8_block_every_byte_with_stacked_rows(scale_dtype):
    gen = torch.Generator().manual_seed(5)
    parts, cols = [200, 200], 300  # gate and up of 200 rows each (2 blocks each, the second partial); 3 col blocks
    block_rows = stacked_block_rows(parts)
    q = _every_byte((2, sum(parts), cols), gen).view(torch.float8_e4m3fn)
    scale = (torch.rand((2, 4, 3), generator=gen) + 0.25).to(scale_dtype)
    want = dequantize_fp8_block(q, scale, torch.float32, block_rows)
    got = dequantize_fp8_block_triton(q.to(DEV), scale.to(DEV), torch.float32, block_rows.to(DEV))
    _same(got.cpu(), want)


def test_fp8_block_default_rows_of_a_quantized_matrix():
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(150, 260, generator=gen)
    q, scale = quantize_fp8_block(w)
    want = dequantize_fp8_block(q, scale, torch.float32)
    got = dequantize_fp8_block_triton(q.to(DEV), scale.to(DEV), torch.float32)
    _same(got.cpu(), want)
    assert (want - w).abs().max() < 0.1 * w.abs().max()


def test_empty_stacks():
    packed = torch.zeros((0, 4, 8), dtype=torch.uint8, device=DEV)
    scale = torch.zeros((0, 4, 1), dtype=torch.uint8, device=DEV).view(torch.float8_e4m3fn)
    assert dequantize_nvfp4_triton(packed, scale, torch.ones((0, 4, 1), device=DEV), torch.float32).shape == (0, 4, 16)
    q = torch.zeros((0, 4, 8), dtype=torch.uint8, device=DEV).view(torch.float8_e4m3fn)
    assert dequantize_fp8_block_triton(q, torch.ones((0, 1, 1), device=DEV), torch.float32).shape == (0, 4, 8)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_flash_next_expert_shapes_gpu(dtype):
    """64 of ``flash-next``'s experts: gate_up ``[1280, 2560]`` and down ``[2560, 640]``, in both formats."""
    gen = torch.Generator(device="cuda").manual_seed(11)
    for rows, cols, parts in ((1280, 2560, [640, 640]), (2560, 640, [2560])):
        w = torch.randn((64, rows, cols), generator=gen, device="cuda")
        packed, scale, _ = quantize_nvfp4(w)
        scale_2 = torch.rand((64, rows, 1), generator=gen, device="cuda") * 1e-3
        _same(dequantize_nvfp4_triton(packed, scale, scale_2, dtype), dequantize_nvfp4(packed, scale, scale_2, dtype))
        block_rows = stacked_block_rows(parts).cuda()
        q, fscale = quantize_fp8_block(w)
        _same(dequantize_fp8_block_triton(q, fscale, dtype, block_rows),
              dequantize_fp8_block(q, fscale, dtype, block_rows))
