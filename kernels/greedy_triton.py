"""The arg-max of a decode graph's logits inside the graph: each row's greedy token, also written to its
slot's entry of ``last_ids`` (imported for CUDA tensors, and on the CPU by the tests under
``TRITON_INTERPRET=1``).

torch's arg-max of one 248K-wide row is one reduction kernel of about 8 us, then an index_put of 2 us for
``last_ids``, both launched after the replay. Here two launches inside the graph do it: ``_argmax_part_kernel``,
grid ``(rows, parts)``, reduces a chunk of a row each (its value and index); ``_argmax_final_kernel``, one
program a row, picks the best chunk and stores the id and the slot's last id. Ties go to the lowest index,
as torch's arg-max: within a chunk by the reduction's left tie-break, across chunks (in index order) by the
same and by a strict comparison in the chunk's loop. A NaN logit is passed over (torch's arg-max would return
its index); a model whose logits hold NaN has failed either way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .pdl_triton import pdl_enter

# Logits a part program reads per loop step, and the most parts a row is split into.
BLOCK = 2048
MAX_PARTS = 64


@triton.jit
def _argmax_part_kernel(logits_ptr, part_v_ptr, part_i_ptr, vocab, stride_l, chunk,
                        PARTS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    start = c * chunk
    cols = tl.arange(0, BLOCK)
    best_v = tl.full([], float("-inf"), tl.float32)
    best_i = start
    for lo in range(start, start + chunk, BLOCK):
        idx = lo + cols
        x = tl.load(logits_ptr + r * stride_l + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32)
        v, at = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
        take = v > best_v
        best_i = tl.where(take, lo + at, best_i)
        best_v = tl.where(take, v, best_v)
    tl.store(part_v_ptr + r * PARTS + c, best_v)
    tl.store(part_i_ptr + r * PARTS + c, best_i)


@triton.jit
def _argmax_final_kernel(part_v_ptr, part_i_ptr, ids_ptr, slots_ptr, last_ptr, parts,
                         PARTS: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    r = tl.program_id(0).to(tl.int64)
    p = tl.arange(0, PARTS)
    v = tl.load(part_v_ptr + r * PARTS + p, mask=p < parts, other=float("-inf"))
    _, at = tl.max(v, 0, return_indices=True, return_indices_tie_break_left=True)
    token = tl.load(part_i_ptr + r * PARTS + at).to(tl.int64)
    tl.store(ids_ptr + r, token)
    tl.store(last_ptr + tl.load(slots_ptr + r), token)


def greedy_ids(logits: torch.Tensor, slots: torch.Tensor, last_ids: torch.Tensor, out: torch.Tensor) -> None:
    """``out[r] = argmax(logits[r])`` (int64, lowest index on ties) and ``last_ids[slots[r]] = out[r]`` for every
    row of ``logits [R, V]`` (unit column stride); two launches, no host sync."""
    rows, vocab = logits.shape
    if rows == 0:
        return
    assert logits.stride(1) == 1 and out.dtype == last_ids.dtype == torch.int64
    parts = min(MAX_PARTS, triton.cdiv(vocab, BLOCK))
    chunk = triton.cdiv(triton.cdiv(vocab, parts), BLOCK) * BLOCK
    parts = triton.cdiv(vocab, chunk)
    part_v = torch.empty(rows, MAX_PARTS, dtype=torch.float32, device=logits.device)
    part_i = torch.empty(rows, MAX_PARTS, dtype=torch.int32, device=logits.device)
    launch = pdl.launch_args(logits)
    _argmax_part_kernel[(rows, parts)](logits, part_v, part_i, vocab, logits.stride(0), chunk, PARTS=MAX_PARTS,
                                       BLOCK=BLOCK, num_warps=4, **launch)
    _argmax_final_kernel[(rows,)](part_v, part_i, out, slots, last_ids, parts, PARTS=MAX_PARTS, num_warps=1,
                                  **launch)
