"""The row gather that reads a PLE table where it is (``kernels/ple.gather_rows``) against ``index_select``.

Without a GPU it runs in Triton's interpreter; the ``gpu`` test reads a pinned host table from the device, inside a
CUDA graph as a decode step does.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton")

from tidal.kernels.ple import gather_rows  # noqa: E402
from tidal.kernels.ple_triton import GATHER_BYTES, gather_rows_triton  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("rows,dim", [(1, 8), (37, 24), (20, GATHER_BYTES + 40)])
def test_gather_rows_equals_index_select(dtype, rows, dim):
    """Every dtype's bytes (float8 included), rows past one program and rows wider than one program's bytes,
    repeated and out-of-order ids of shape ``[T, heads]``."""
    g = torch.Generator().manual_seed(rows)
    table = torch.randn(300, dim, generator=g).to(dtype)
    ids = torch.randint(0, 300, (rows, 3), generator=g)
    ids[0, 1] = ids[0, 0]
    got = gather_rows_triton(table, ids)
    want = table.view(torch.uint8).index_select(0, ids.flatten()).view(rows, 3, -1)
    assert got.shape == (rows, 3, dim) and got.dtype == dtype
    assert torch.equal(got.view(torch.uint8).view(rows, 3, -1), want)


def test_no_rows():
    assert gather_rows_triton(torch.zeros(4, 8), torch.zeros(0, 2, dtype=torch.long)).shape == (0, 2, 8)


def test_the_reference_path_on_the_cpu():
    table = torch.arange(40.0).view(10, 4)
    ids = torch.tensor([[3, 1], [9, 3]])
    assert torch.equal(gather_rows(table, ids), table[ids])


@pytest.mark.gpu
def test_a_cuda_graph_reads_a_pinned_host_table_gpu():
    """The table stays in pinned host memory; the ids change between replays of one captured graph, and each
    replay gathers the rows of the ids it finds (as a decode step's n-gram rows)."""
    from tidal.executor.memory.pinned import pinned_empty

    table = pinned_empty((5000, 160), torch.bfloat16)
    table.copy_(torch.randn(5000, 160).to(torch.bfloat16))
    ids = torch.zeros(8, 4, dtype=torch.long, device="cuda")
    gather_rows(table, ids)  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gather_rows(table, ids)
    for seed in range(3):
        new = torch.randint(0, 5000, (8, 4), generator=torch.Generator().manual_seed(seed))
        ids.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), table[new])
