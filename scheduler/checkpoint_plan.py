"""Where a prompt's forwards start and end, and where its state is checkpointed."""

from __future__ import annotations

from dataclasses import dataclass, field

from .chunking import chunk_bounds, chunk_step


@dataclass
class CheckpointPlan:
    """``chunks``: the prompt forwards ``[start, end)``; ``checkpoints``: positions whose complete
    state is exported into prefix-cache slots."""

    chunks: list[tuple[int, int]]
    checkpoints: list[int] = field(default_factory=list)
    reason: str = ""


def plan_prompt(prompt_len: int, cached: int, max_chunk: int | None, align: int, coalesce: bool,
                checkpoint: bool, branch: int = 0) -> CheckpointPlan:
    """Plan the forwards of a prompt whose first ``cached`` tokens come from the prefix cache, cut by
    :func:`chunk_bounds` (``max_chunk`` ``None``: one forward).

    Checkpoints sit at multiples of ``align`` beyond ``cached`` and at most ``prompt_len - 1`` (so a
    later hit always leaves a token to compute): the last one of the prompt, and, when the prompt's
    first ``branch`` tokens are already cached as KV pages of another prompt without a checkpoint
    there, the last one of that shared prefix, so the next prompt branching off it hits too.
    Without coalescing, a forward ends exactly at each checkpoint (the tail runs as its own
    forward); with coalescing the executor exports the state from inside the forward.
    """
    bounds = chunk_bounds(cached, prompt_len, max_chunk)
    chunked = len(bounds) > 2
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
    if chunked:
        step = chunk_step(max_chunk)
        reasons.append(f"chunked by --max-prefill-length {max_chunk}"
                       + (f" (forwards end on multiples of {step})" if step != max_chunk else ""))
    return CheckpointPlan(chunks=list(zip(bounds[:-1], bounds[1:], strict=True)), checkpoints=positions,
                          reason="; ".join(reasons))
