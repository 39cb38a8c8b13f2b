"""The seeded n-gram table kernel (``kernels/seeded_triton``) against the reference of
:func:`tidal.executor.weights.table_rows`, bit for bit: rows anywhere in a table, rows of any shape, the ends of the
24-bit codes' range, the lookup table built by the reference's arithmetic.

Without CUDA the kernel runs in the interpreter; the ``gpu`` test draws chunks of ``flash-next``'s table through the
dispatcher with the kernel on and off.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Must precede the first import of triton; on a GPU machine the kernel runs compiled instead.
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton")

from tidal.executor import weights  # noqa: E402
from tidal.kernels.seeded_triton import seeded_rows  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def test_the_kernel_draws_the_references_bits_for_rows_of_any_shape_and_place():
    name, dim, seed = "model.layers.3.ple.ple_embedding.ngram_embedding.weight", 40, 7
    lut = weights._normal_values(torch.arange(1 << 24, device=DEV))
    # the extreme codes are the table's ends: the largest magnitudes a table holds
    assert lut[0] == -lut[-1] and lut[0] < -5.4 and torch.all(lut[1:] > lut[:-1])
    rows = torch.tensor([[0, 1, 5], [2**31 + 3, 320_000_000 - 1, 77]], device=DEV)
    for index in (rows, rows[1], torch.arange(1000, 1057, device=DEV)):
        got = seeded_rows(index, dim, weights._stable_seed(seed, name), lut)
        want = weights.table_rows(name, index.cpu(), dim, seed)
        assert got.shape == (*index.shape, dim)
        assert torch.equal(_bits(got.cpu()), _bits(want))
    other = seeded_rows(rows, dim, weights._stable_seed(seed + 1, name), lut)
    assert not torch.equal(other.cpu(), weights.table_rows(name, rows.cpu(), dim, seed))
    assert seeded_rows(rows[:0], dim, 1, lut).shape == (0, 3, dim)


@pytest.mark.gpu
def test_table_chunks_drawn_on_the_gpu_equal_the_reference_gpu(monkeypatch):
    """Chunks of ``flash-next``'s table (320 values a row) drawn by ``table_rows`` on CUDA, the kernel against
    ``TIDAL_KERNELS=torch:seeded_rows``; and a row gather of a decode step's shape."""
    name, dim, seed = "model.layers.2.ple.ple_embedding.ngram_embedding.weight", 320, 1234
    for rows in (torch.arange(5_000_000, 5_000_000 + 200_000, device="cuda"),
                 torch.randint(0, 320_000_000, (64, 8), device="cuda")):
        monkeypatch.delenv("TIDAL_KERNELS", raising=False)
        got = weights.table_rows(name, rows, dim, seed)
        monkeypatch.setenv("TIDAL_KERNELS", "torch:seeded_rows")
        want = weights.table_rows(name, rows, dim, seed)
        assert torch.equal(_bits(got), _bits(want))
