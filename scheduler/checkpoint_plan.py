"""Where a prompt's forwards start and end, and where its state is checkpointed."""

from __future__ import annotations

from dataclasses import dataclass, field

# Prompt forwards end on multiples of this many tokens past the cached prefix (itself a multiple of the
# checkpoint alignment): the block of the chunked GDN kernels, flash-linear-attention's and the torch
# reference's. A prompt cut there runs its recurrence over the same blocks in one forward or in several
# (cut elsewhere, chunks of 1,000 moved the `small` preset's bf16 logits by up to 0.21; cut at 960 they
# equal one forward's bitwise on the CPU).
CHUNK_ALIGN = 64


def chunk_step(max_chunk: int) -> int:
    """Tokens per prompt forward under ``--max-prefill-length max_chunk``: rounded down to a multiple of
    :data:`CHUNK_ALIGN`, unless the limit is below one block."""
    return max_chunk // CHUNK_ALIGN * CHUNK_ALIGN if max_chunk >= CHUNK_ALIGN else max_chunk


@dataclass
class CheckpointPlan:
    """``chunks``: the prompt forwards ``[start, end)``; ``checkpoints``: positions whose complete
    state is exported into prefix-cache slots."""

    chunks: list[tuple[int, int]]
    checkpoints: list[int] = field(default_factory=list)
    reason: str = ""


def plan_prompt(prompt_len: int, cached: int, max_chunk: int | None, align: int, coalesce: bool,
                checkpoint: bool, branch: int = 0) -> CheckpointPlan:
    """Plan the forwards of a prompt whose first ``cached`` tokens come from the prefix cache: at most
    ``chunk_step(max_chunk)`` tokens each (``None``: one forward).

    Checkpoints sit at multiples of ``align`` beyond ``cached`` and at most ``prompt_len - 1`` (so a
    later hit always leaves a token to compute): the last one of the prompt, and, when the prompt's
    first ``branch`` tokens are already cached as KV pages of another prompt without a checkpoint
    there, the last one of that shared prefix, so the next prompt branching off it hits too.
    Without coalescing, a forward ends exactly at each checkpoint (the tail runs as its own
    forward); with coalescing the executor exports the state from inside the forward.
    """
    step = chunk_step(max_chunk) if max_chunk else prompt_len
    bounds = list(range(cached, prompt_len, step)) + [prompt_len]
    reasons = [f"prefix hit: {cached} cached tokens" if cached else "no prefix hit"]
    positions: list[int] = []
    if checkpoint:
        last = (prompt_len - 1) // align * align
        shared = min(branch, prompt_len - 1) // align * align
        positions = sorted({p for p in (shared, last) if p > cached})
        if shared > cached and shared != last:
            reasons.append(f"branch checkpoint {shared}: the first {branch} tokens are shared with a cached prompt")
        if coalesce:
            reasons.append(f"tail coalesced: checkpoints {positions} exported inside forwards")
        elif positions:
            cut = [p for p in positions if p not in bounds]
            bounds = sorted(set(bounds) | set(cut))
            reasons.append(f"align: forwards end at checkpoints {positions}")
    if max_chunk and prompt_len - cached > max_chunk:
        reasons.append(f"chunked by --max-prefill-length {max_chunk}"
                       + (f" (forwards of {step}, a multiple of {CHUNK_ALIGN})" if step != max_chunk else ""))
    return CheckpointPlan(chunks=list(zip(bounds[:-1], bounds[1:], strict=True)), checkpoints=positions,
                          reason="; ".join(reasons))
