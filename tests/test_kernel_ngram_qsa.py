"""Flat-batch n-gram hashing and the QSA block choice against their per-sequence references."""

from __future__ import annotations

import pytest
import torch

from tidal.kernels.ngram import ngram_ids, ngram_ids_varlen
from tidal.kernels.qsa import pick_blocks, pick_blocks_ref


@pytest.mark.parametrize("width", [1, 2, 3])
def test_varlen_ngram_ids_equal_per_segment(width):
    eos = 9
    multipliers = torch.tensor([3, 5, 7, 11][:width + 1])
    heads = 2
    sizes = torch.tensor([101, 103, 107, 109, 113, 127][:width * heads])
    offsets = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.long), sizes[:-1]]), 0)
    g = torch.Generator().manual_seed(width)
    lengths = [1, 7, 1, 30, 2]
    ctx = torch.randint(0, 40, (len(lengths), width), generator=g)
    ctx[1, -1] = eos
    tokens = torch.randint(0, 40, (sum(lengths),), generator=g)
    tokens[[3, 10, 11]] = eos
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    row_segment = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    flat = ngram_ids_varlen(ctx, tokens, row_segment, cu, eos, multipliers, sizes, offsets, heads)
    ref = torch.cat([ngram_ids(ctx[i], tokens[cu[i]:cu[i + 1]], eos, multipliers, sizes, offsets, heads)
                     for i in range(len(lengths))])
    assert torch.equal(flat, ref)


def test_pick_blocks_ref_ranks_only_visible_blocks():
    scores = torch.tensor([[[5.0, 1.0, 4.0, 9.0, 2.0], [5.0, 1.0, 4.0, 9.0, 2.0]]])
    picked = pick_blocks_ref(scores, torch.tensor([[2, 5]]), 3)
    assert picked[0, 0].tolist() == [0, 1, -1]
    assert picked[0, 1].tolist() == [3, 0, 2]


@pytest.mark.gpu
def test_masked_topk_equals_reference_without_ties():
    g = torch.Generator().manual_seed(0)
    scores = torch.rand(3, 257, 40, generator=g).cuda() + 0.01  # distinct, no ties
    visible = torch.randint(0, 41, (3, 257), generator=g).cuda()
    fast = pick_blocks(scores, visible, 8)
    ref = pick_blocks_ref(scores, visible, 8)
    assert torch.equal(fast.sort(-1).values, ref.sort(-1).values)
