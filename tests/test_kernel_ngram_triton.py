"""The Triton n-gram id kernel against the torch reference: equal ids (integer arithmetic).

Without a GPU the kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``); with one, compiled.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Must precede the first import of triton; on a GPU machine the kernel runs compiled instead.
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton")

from tidal.kernels.ngram import layer_multipliers, ngram_ids_varlen_ref  # noqa: E402
from tidal.kernels.ngram_triton import ngram_ids_varlen  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _case(width: int, heads: int, lengths: list[int], vocab: int, seed: int):
    eos = 9
    g = torch.Generator().manual_seed(seed)
    multipliers = torch.tensor(layer_multipliers(vocab, width + 1, 0, seed))
    sizes = torch.randint(50, 5000, (width * heads,), generator=g)
    offsets = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.long), sizes[:-1]]), 0)
    ctx = torch.randint(0, 40, (len(lengths), width), generator=g)
    ctx[min(1, len(lengths) - 1), -1] = eos  # an EOS just before a segment's first token
    tokens = torch.randint(0, vocab, (sum(lengths),), generator=g)
    tokens[torch.randint(0, len(tokens), (max(1, len(tokens) // 6),), generator=g)] = eos
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    row_segment = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    return ctx, tokens, row_segment, cu, eos, multipliers, sizes, offsets, heads


@pytest.mark.parametrize("width,heads", [(1, 2), (2, 4), (3, 3)])
@pytest.mark.parametrize("lengths", [[1], [1, 7, 1, 30, 2], [70, 1, 1, 65]])
def test_triton_ngram_ids_equal_the_reference(width, heads, lengths):
    """Decode rows (length 1), short and long segments, EOS in the context and among the tokens, ids up to a
    150K vocabulary (products near the int64 bound the multipliers are chosen for)."""
    args = _case(width, heads, lengths, 151_936, width * 10 + len(lengths))
    ref = ngram_ids_varlen_ref(*args)
    ctx, tokens, row_segment, cu, eos, multipliers, sizes, offsets, heads = args
    out = ngram_ids_varlen(ctx.to(DEV), tokens.to(DEV), row_segment.to(DEV), cu.to(DEV), eos, multipliers.to(DEV),
                           sizes.to(DEV), offsets.to(DEV), heads)
    assert out.dtype == torch.long and torch.equal(out.cpu(), ref)


def test_triton_ngram_ids_int32_offsets():
    """The model passes int32 ``cu_seqlens`` and ``row_segment``; the kernel reads them as they are."""
    ctx, tokens, row_segment, cu, eos, multipliers, sizes, offsets, heads = _case(2, 4, [3, 1, 12], 1000, 1)
    ref = ngram_ids_varlen_ref(ctx, tokens, row_segment, cu, eos, multipliers, sizes, offsets, heads)
    out = ngram_ids_varlen(ctx.to(DEV), tokens.to(DEV), row_segment.int().to(DEV), cu.int().to(DEV), eos,
                           multipliers.to(DEV), sizes.to(DEV), offsets.to(DEV), heads)
    assert torch.equal(out.cpu(), ref)
