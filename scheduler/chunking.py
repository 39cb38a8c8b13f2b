"""Where a prompt's forwards (and layer-major internal chunks) are cut: shared by the scheduler, which
plans them, and the executor, which cuts a layer-major prompt into internal chunks."""

from __future__ import annotations

# Prompt forwards end on multiples of this many tokens (positions counted from the prompt's start): the
# block of the chunked GDN kernels, flash-linear-attention's and the torch reference's, which split each
# forward's rows into blocks from its first row. Cut there, a prompt runs its recurrence over the same
# blocks in one forward or in several (cut elsewhere, chunks of 1,000 moved the `small` preset's bf16
# logits by up to 0.21; cut at 960 they equal one forward's bitwise on the CPU). A prefix-cache hit
# resumes at a multiple of --checkpoint-align, so hits keep the blocks too when that is a multiple of
# 64, as by default.
CHUNK_ALIGN = 64


def chunk_step(max_chunk: int) -> int:
    """Tokens per prompt forward under ``--max-prefill-length max_chunk``: rounded down to a multiple of
    :data:`CHUNK_ALIGN`, unless the limit is below one block (then kept, and forwards are not aligned)."""
    return max_chunk // CHUNK_ALIGN * CHUNK_ALIGN if max_chunk >= CHUNK_ALIGN else max_chunk


def chunk_bounds(start: int, end: int, max_chunk: int | None) -> list[int]:
    """Where the forwards of rows ``[start, end)`` begin and end (``[start, ..., end]``): at most
    ``max_chunk`` rows each, ending on multiples of :data:`CHUNK_ALIGN` when ``max_chunk`` is at least
    one block, so that a ``start`` off a block boundary only shortens the first forward."""
    if not max_chunk:
        return [start, end]
    step, aligned = chunk_step(max_chunk), max_chunk >= CHUNK_ALIGN
    bounds = [start]
    while bounds[-1] < end:
        lo = bounds[-1]
        bounds.append(min(end, (lo + step) // CHUNK_ALIGN * CHUNK_ALIGN if aligned else lo + step))
    return bounds
