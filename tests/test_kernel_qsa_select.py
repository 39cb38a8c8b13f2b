"""The Triton QSA block choice (scores + top-k in one launch) against torch scoring and
``pick_blocks_ref``.

Without a GPU the kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``, fp32); on a GPU the
same tests run compiled, and the ``gpu``-marked one adds the bench shapes in bf16.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Must precede the first import of triton; on a GPU machine the kernel runs compiled instead.
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton")

from tidal.kernels.qsa import pick_blocks_ref  # noqa: E402
from tidal.kernels.qsa_triton import qsa_select  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _case(lengths, starts, heads, dim, ratio, positive, dtype, seed=0):
    """Segments with ``lengths`` new rows after ``starts`` cached tokens; block keys scattered over a
    cache of rows (``key_rows`` a random permutation, as pages would)."""
    g = torch.Generator().manual_seed(seed)
    n_blocks = max((s + n) // ratio for s, n in zip(starts, lengths, strict=True))
    rows_total = len(lengths) * n_blocks + 5
    draw = (lambda *s: torch.rand(*s, generator=g) + 0.01) if positive else (lambda *s: torch.randn(*s, generator=g))
    keys = draw(rows_total, dim)
    key_rows = torch.randperm(rows_total, generator=g)[:len(lengths) * n_blocks].view(len(lengths), n_blocks)
    row_segment = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths, strict=True)])
    q = draw(len(positions), heads, dim)
    to = lambda t: t.to(DEV, dtype)  # noqa: E731
    return to(q), to(keys), key_rows.to(DEV), row_segment.to(DEV), positions.to(DEV), n_blocks


def _reference(q, keys, key_rows, row_segment, positions, n_blocks, ratio, width):
    seg_keys = keys.float()[key_rows[row_segment, :n_blocks]]  # [T, B, d]
    scores = torch.einsum("thd,tbd->thb", q.float(), seg_keys).relu().sum(1) * q.shape[-1] ** -0.5
    visible = ((positions + 1) // ratio).clamp(max=n_blocks)
    return scores, pick_blocks_ref(scores, visible, width)


@pytest.mark.parametrize("width", [1, 9, 64])  # 64: past the 37 blocks, up to their next power of two
@pytest.mark.parametrize("heads,dim", [(3, 24), (16, 32)])
def test_select_equals_scores_and_topk(width, heads, dim):
    ratio = 4
    # A decode row, a prompt from scratch, a chunk after cached tokens, one row that sees no block.
    args = _case([1, 22, 9, 1], [150, 0, 41, 2], heads, dim, ratio, True, torch.float32)
    n_blocks = args[-1]
    sel = qsa_select(*args[:5], n_blocks, ratio, width)
    _, ref = _reference(*args, ratio, width)
    assert sel.dtype == torch.int32
    assert torch.equal(sel, ref.to(sel.device))  # positive inputs: distinct scores, no ties


def test_select_ties_at_zero_take_the_lowest_blocks():
    ratio = 4
    q, keys, key_rows, row_segment, positions, n_blocks = _case([5, 1], [60, 90], 3, 24, ratio, False,
                                                                torch.float32, seed=7)
    width = 12
    sel = qsa_select(q, keys, key_rows, row_segment, positions, n_blocks, ratio, width)
    scores, ref = _reference(q, keys, key_rows, row_segment, positions, n_blocks, ratio, width)
    sel, scores, ref = sel.cpu(), scores.cpu(), ref.cpu()
    assert bool((scores == 0).any())  # the case has ties at zero
    for r in range(sel.shape[0]):
        chosen = sel[r][sel[r] >= 0]
        assert torch.equal(chosen.sort().values, chosen.unique())  # no block twice
        assert torch.equal(scores[r, chosen].sort().values, scores[r, ref[r][ref[r] >= 0]].sort().values)
        assert (sel[r] >= 0).sum() == (ref[r] >= 0).sum()
        # Among equal scores the lower block comes first.
        s = scores[r, chosen]
        same = s[1:] == s[:-1]
        assert bool((chosen[1:][same] > chosen[:-1][same]).all())


@pytest.mark.gpu
def test_select_bf16_bench_shapes_gpu():
    """16 index heads of 128, blocks of 64, top-32, a 32K prompt's worth of blocks and decode rows:
    the chosen blocks' reference scores equal the reference top-32's (bf16 inputs, fp32 scores)."""
    ratio, width = 64, 32
    args = _case([1, 1, 3000], [8000, 30000, 29000], 16, 128, ratio, False, torch.bfloat16, seed=1)
    n_blocks = args[-1]
    sel = qsa_select(*args[:5], n_blocks, ratio, width)
    scores, ref = _reference(*args, ratio, width)
    picked = scores.gather(1, sel.long().clamp(min=0)).masked_fill(sel < 0, -1)
    wanted = scores.gather(1, ref.long().clamp(min=0)).masked_fill(ref < 0, -1)
    torch.testing.assert_close(picked.sort(-1).values, wanted.sort(-1).values, rtol=1e-5, atol=1e-5)


def test_the_layer_dispatch_limit_is_the_kernels():
    from tidal.executor.layers.attention import QSA_TRITON_MAX_BLOCKS
    from tidal.kernels.qsa_triton import MAX_BLOCKS

    assert QSA_TRITON_MAX_BLOCKS == MAX_BLOCKS


def test_select_in_row_chunks_equals_one_launch(monkeypatch):
    from tidal.kernels import qsa_triton

    ratio = 4
    args = _case([1, 22, 9, 1], [150, 0, 41, 2], 3, 24, ratio, True, torch.float32)
    whole = qsa_select(*args[:5], args[-1], ratio, 5)
    monkeypatch.setattr(qsa_triton, "_SCRATCH_ELEMENTS", 64 * 7)  # 7 rows a launch
    assert torch.equal(qsa_select(*args[:5], args[-1], ratio, 5), whole)
