"""A decode graph's per-row tensors from one kernel (``kernels/decode_prep_triton``) against the torch
ops of ``DecodeGraphs._forward_batch`` that it replaces, on the same inputs: random page tables, token
ids of -1 read from ``last_ids``, fresh rows, padding rows, positions across page and QSA block
boundaries, rotary shifts (the text after a request's images), and the slots' n-gram contexts it moves on.

Without CUDA the kernel runs in the interpreter on CPU tensors; the ``gpu`` test runs it compiled, with
the model's dtype for cos and sin.
"""

from __future__ import annotations

import os

import pytest
import torch

_INTERPRET = not torch.cuda.is_available()
if _INTERPRET:  # never on a GPU machine: it would turn every kernel of the session into the interpreter
    os.environ["TRITON_INTERPRET"] = "1"

from tidal import LLM  # noqa: E402


def _graphs(checkpoint: str, device: str, dtype: str, max_batch: int, max_pages: int):
    llm = LLM(checkpoint, device=device, dtype=dtype, max_prefill_length=64)
    llm.runner.use_graphs(max_batch, max_pages, capture=False)
    return llm.runner.graphs


def _check(graphs, rows: list[tuple[int, ...]], seed: int) -> None:
    """``rows``: (token id, position, slot[, rotary shift]) of the real rows; the rest of the batch is padding."""
    from tidal.kernels import decode_prep_triton

    g = torch.Generator().manual_seed(seed)
    dev = graphs.device
    graphs.slot_pages.copy_(torch.randint(0, 1000, graphs.slot_pages.shape, generator=g, dtype=torch.int32))
    graphs.last_ids.copy_(torch.randint(0, 5000, graphs.last_ids.shape, generator=g))
    ctx = graphs.states.ngram_context
    ctx.copy_(torch.randint(0, 5000, ctx.shape, generator=g))
    rows = [(*r, 0) if len(r) == 3 else r for r in rows]
    ids, positions, slots, shifts = (list(c) for c in zip(*rows, strict=True))
    graphs._fill(ids, positions, slots, shifts)
    size, blocks = graphs._shape(positions)
    before = ctx.clone()
    want = graphs._forward_batch(size, blocks)  # the torch ops: CPU tensors, or TIDAL_KERNELS on a GPU
    want_ctx = ctx.clone()
    ctx.copy_(before)
    rotary = graphs.rotary
    dtype = graphs.model.model.embed_tokens.weight.dtype
    got = decode_prep_triton.decode_prep(graphs.inputs[:, :size], graphs.last_ids, graphs.slot_pages,
                                         graphs.page_size, ctx, graphs.ngram_eos, rotary.inv_freq(dev), dtype,
                                         graphs.ratio, blocks)
    assert torch.equal(got["ids"], want.input_ids)
    assert torch.equal(got["fresh"], want.all.fresh)
    assert torch.equal(got["kv_lens"], want.all.kv_lens)
    assert torch.equal(got["page_table"], want.all.page_table)
    assert torch.equal(got["kv_rows"], want.kv_write_rows)
    assert torch.equal(got["ngram_context"], want.ngram_context)
    assert torch.equal(ctx, want_ctx)
    assert torch.equal(want.rope_positions, want.positions + torch.tensor(shifts + [0] * (size - len(rows))).to(dev))
    cos, sin = rotary.cos_sin(want.rope_positions, dtype)
    # One rounding of the same fp32 angle: libdevice's and torch's cos may differ in the last fp32 bit.
    tol = dict(rtol=0, atol=2e-2 if dtype == torch.bfloat16 else 1e-6)
    torch.testing.assert_close(got["cos"], cos, **tol)
    torch.testing.assert_close(got["sin"], sin, **tol)
    assert torch.equal(got["new_rows"], want.qsa.new_rows)
    assert torch.equal(got["new_pos"], want.qsa.new_pos)
    assert torch.equal(got["key_rows"], want.qsa.key_rows)


# Token -1 (read from last_ids), position 0 (fresh), positions at page (16) and QSA block (8) edges, a row
# past the 64-block floor of the graph shapes' block count.
ROWS = [(-1, 37, 3), (17, 0, 5), (-1, 63, 0), (4, 15, 7), (9, 8, 1)]


def test_decode_prep_matches_the_torch_ops(tiny_checkpoint, monkeypatch):
    """fp32: in the interpreter on CPU tensors without CUDA, compiled on a GPU."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TIDAL_KERNELS", "torch:decode_prep")  # on a GPU, the reference's ops in _forward_batch
    graphs = _graphs(tiny_checkpoint, "cpu" if _INTERPRET else "cuda", "float32", max_batch=8, max_pages=40)
    _check(graphs, ROWS, seed=0)
    _check(graphs, ROWS[:1], seed=1)  # one row and seven padding rows
    _check(graphs, [(5, 600, 2), (6, 639, 4)], seed=2)  # 80 blocks: past the smallest graph's 64
    _check(graphs, [(-1, 300, 3, -250), (8, 47, 6, 0), (2, 95, 1, -9)], seed=4)  # rows after images


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_decode_prep_matches_the_torch_ops_gpu(tiny_checkpoint, dtype, monkeypatch):
    """The model's dtypes, and positions whose page tables need thousands of pages."""
    graphs = _graphs(tiny_checkpoint, "cuda", dtype, max_batch=8, max_pages=7000)
    monkeypatch.setenv("TIDAL_KERNELS", "torch:decode_prep")  # the reference's ops in _forward_batch
    _check(graphs, ROWS, seed=0)
    _check(graphs, [(5, 600, 2), (6, 639, 4)], seed=2)
    _check(graphs, [(-1, 300, 3, -250), (8, 47, 6, 0), (2, 95, 1, -9)], seed=4)
    _check(graphs, [(-1, 100_000 + 7 * i, i) for i in range(8)], seed=3)  # long positions: the angles' range
