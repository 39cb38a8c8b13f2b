"""A decode graph's arg-max kernel (``kernels/greedy_triton``) against ``torch.argmax`` and the index write it
replaces: ties inside a chunk, across a chunk's loop steps and across chunks go to the lowest index, a
maximum at the last column, rows of -inf, and the slots' ``last_ids``.

Without CUDA the kernel runs in the interpreter on fp32 CPU tensors; on a GPU it runs compiled, and the
``gpu`` test adds the bench vocabulary in bf16 and the tiny model's greedy ids through the graphs.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Must precede the first import of triton; on a GPU machine the kernels run compiled instead.
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton")

from tidal.kernels.greedy_triton import BLOCK, greedy_ids  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _check(logits: torch.Tensor, slots: list[int], num_slots: int) -> None:
    slot_t = torch.tensor(slots, device=logits.device)
    last = torch.full((num_slots,), -7, dtype=torch.long, device=logits.device)
    out = torch.full((logits.shape[0],), -7, dtype=torch.long, device=logits.device)
    greedy_ids(logits, slot_t, last, out)
    want = torch.argmax(logits, dim=-1)
    assert torch.equal(out, want)
    expect_last = torch.full_like(last, -7)
    expect_last[slot_t] = want
    assert torch.equal(last, expect_last)


def _planted(rows: int, vocab: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen)
    top = logits.max() + 1
    ties = [(0, 100), (0, vocab - 5), (1, BLOCK - 1), (1, BLOCK), (2, vocab - 1)]
    if vocab > 3 * BLOCK:
        ties += [(3, BLOCK + 17), (3, 2 * BLOCK + 3)]  # the loop's later step of a chunk, or the next chunk
    for r, c in ties:
        if r < rows:
            logits[r, c] = top
    if rows > 4:
        logits[4] = float("-inf")  # every column tied: index 0
    return logits.to(DEV, dtype)


@pytest.mark.parametrize("vocab", [5000, 140_001])
def test_greedy_ids_match_argmax(vocab):
    """5000 columns: three chunks of one loop step; 140,001: 35 chunks of two steps each."""
    _check(_planted(5, vocab, torch.float32, seed=vocab), [3, 0, 6, 2, 5], 8)


def test_one_row_and_a_strided_batch():
    logits = _planted(4, 3 * BLOCK + 1, torch.float32, seed=1)
    _check(logits[:1], [2], 4)
    wide = torch.zeros(4, 3 * BLOCK + 9, device=DEV)
    wide[:, :3 * BLOCK + 1] = logits
    _check(wide[:, :3 * BLOCK + 1], [0, 1, 2, 3], 4)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 32])
def test_greedy_ids_bench_vocab_gpu(rows):
    """The bench vocabulary (248,320) in bf16, where ties between rounded logits are common."""
    _check(_planted(rows, 248_320, torch.bfloat16, seed=rows), list(range(rows)), 40)


@pytest.mark.gpu
def test_the_model_takes_the_greedy_kernel_gpu(same_ids_as_torch_ops):
    same_ids_as_torch_ops("greedy")
