"""When a prefill runs layer-major (``--prefill-layer-major``), and why not otherwise.

Layer-major prefill runs each decoder layer over all internal chunks of a long prompt before the
next layer, so experts streamed from host memory cross to the device once per layer instead of once
per chunk. It pays only where experts are streamed and keeps every chunk's activations alive
between layers, so it is limited to the case the mechanism is for: one long text prompt at a time, on
one rank, with experts offloaded and PLE tables in memory. Everything else runs chunked, and the plan
says why.

With ``--layer-major-turns`` > 1 (the default 2) the prefill runs over that many scheduling turns of whole
decoder layers (over all its internal chunks), and the requests already decoding take a step between turns;
so a long prompt is eligible while others decode. Prompts that arrive meanwhile wait until it is done (their
chunks would stream every layer again and compete for the same copies). With 1 it is one turn, eligible
only while nothing else runs or waits.
"""

from __future__ import annotations

from ..config.server_args import ServerArgs
from .chunking import chunk_step


def layer_major_decision(args: ServerArgs, new_tokens: int, others: int, want_logits: bool,
                         busy: bool = False, layers: int | None = None) -> tuple[bool, str]:
    """``(eligible, reason)`` for a prompt with ``new_tokens`` uncached tokens, while ``others``
    other requests are running or waiting; ``busy``: another layer-major prefill is under way. With the
    model's decoder ``layers`` given, the turns are at most one a layer."""
    turns = args.layer_major_turns if layers is None else min(args.layer_major_turns, layers)
    if not args.prefill_layer_major:
        return False, "layer-major off"
    chunk = args.max_prefill_length
    checks = [
        (args.tp == 1, f"--tp {args.tp} (layer-major needs 1)"),
        (args.moe_strategy == "offload", "experts resident (layer-major needs --moe-strategy offload)"),
        (args.ple_backend != "disk", "--ple-backend disk (layer-major needs gpu or pinned)"),
        (not busy, "another layer-major prefill is under way"),
        (others == 0 or turns > 1, f"{others} other request(s) running or waiting "
         f"(one turn runs alone: --layer-major-turns {args.layer_major_turns})"),
        (not want_logits, "every prompt row is needed (scoring or prompt log-probabilities)"),
        (chunk is not None and new_tokens > chunk,
         f"{new_tokens} new tokens within --max-prefill-length {chunk}"),
        (new_tokens <= args.layer_major_max_tokens,
         f"{new_tokens} new tokens exceed --layer-major-max-tokens {args.layer_major_max_tokens}"),
    ]
    for ok, why in checks:
        if not ok:
            return False, f"chunked: {why}"
    return True, (f"layer-major: {new_tokens} new tokens in internal chunks of {chunk_step(chunk)}, "
                  + (f"{turns} turns" if turns > 1 else "one turn"))
