"""What one forward pass needs to know about its rows: the executor's view of a ``Batch``."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .memory import KVPool, StatePool


@dataclass
class Segment:
    """A contiguous run of one request's tokens inside the flat batch.

    ``exports`` lists ``(offset, dst_slot)``: after the segment's first ``offset`` tokens
    (``0 < offset <= length``), the request's complete state is written to ``dst_slot``. An offset
    inside the segment splits the recurrence there; it never recomputes tokens.
    """

    slot: int
    start: int
    length: int
    row0: int
    page_table: torch.Tensor | None = None
    exports: list[tuple[int, int]] = field(default_factory=list)

    @property
    def fresh(self) -> bool:
        """Starts at position 0: the state before it is the zero state, whatever the slot holds."""
        return self.start == 0

    @property
    def rows(self) -> slice:
        return slice(self.row0, self.row0 + self.length)

    @property
    def end(self) -> int:
        return self.start + self.length

    def split_points(self) -> list[int]:
        """Sorted internal offsets where the recurrence must be split for an export."""
        return sorted({off for off, _ in self.exports if 0 < off < self.length})


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    segments: list[Segment]
    kv: KVPool | None
    states: StatePool
    # Per segment: the n-gram context before its first token (``[ngram_size - 1]`` ids), for PLE.
    ngram_context: list[torch.Tensor] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def decode_segments(self) -> list[Segment]:
        return [s for s in self.segments if s.length == 1]

    def prefill_segments(self) -> list[Segment]:
        return [s for s in self.segments if s.length > 1]
