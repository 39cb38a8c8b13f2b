"""The few-row Triton GEMV against ``F.linear``.

Without a GPU the kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``, fp32); on a GPU the same
tests run compiled, and the ``gpu``-marked one adds bf16 at a decode projection's shape.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    # Must precede the first import of triton; on a GPU machine the kernel runs compiled instead.
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton")

from tidal.kernels.gemv_triton import gemv  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("rows", [1, 3, 4])
@pytest.mark.parametrize("n,k,block_n,block_k", [(37, 300, 4, 64), (8, 64, 8, 512), (19, 1000, 2, 128)])
def test_gemv_equals_linear(rows, n, k, block_n, block_k):
    g = torch.Generator().manual_seed(n + k + rows)
    x = torch.randn(rows, 2 * k, generator=g)[:, ::2].to(DEV)  # a strided x is made contiguous
    w = torch.randn(n, k, generator=g).to(DEV)
    torch.testing.assert_close(gemv(x, w, block_n, block_k), F.linear(x, w), rtol=1e-5, atol=1e-4)


@pytest.mark.gpu
def test_gemv_bf16_gpu():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 8192, generator=g).to("cuda", torch.bfloat16)
    w = (torch.randn(328, 8192, generator=g) / 90).to("cuda", torch.bfloat16)
    ref = F.linear(x.float(), w.float())
    out = gemv(x, w).float()
    assert ((out - ref).norm() / ref.norm()).item() <= 5e-3
