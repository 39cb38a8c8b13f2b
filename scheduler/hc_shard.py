"""Which prefill batches run hyper-connection row sharding (``--hc-prefill-mode shard``).

Under tensor parallelism every rank repeats the hyper-connection work (norms, mixing, residual
updates over ``hc_count`` streams) on every token row. In an eligible pure prefill each rank owns
``rows / TP`` rows for that work instead; all-gathers feed attention, GDN and MoE their full inputs
and reduce-scatters return each block's output to the owning rank. It pays only on large pure
prefills; decodes and mixed batches keep full rows (and CUDA graphs, where they exist).
"""

from __future__ import annotations

from ..config.server_args import ServerArgs

MIN_ROWS = 1024


def hc_shard_decision(args: ServerArgs, rows: int, has_decode: bool) -> tuple[bool, str]:
    """``(shard, reason)`` for a batch of ``rows`` token rows."""
    if args.tp < 2 or args.hc_prefill_mode != "shard":
        return False, "replicated"
    if has_decode:
        return False, "replicated: the batch decodes"
    if rows < MIN_ROWS:
        return False, f"replicated: {rows} rows < {MIN_ROWS}"
    if rows % args.tp:
        return False, f"replicated: {rows} rows do not divide by --tp {args.tp}"
    return True, f"shard: {rows // args.tp} rows per rank"
