"""The tensor-parallel group of this executor process, and its counted collectives.

Layers read ``tp()`` when they are built (to size their shard) and when they run (to reduce their
partial outputs). A process that never calls :func:`init_tp` is rank 0 of 1 and every collective
is a no-op, so the single-device path is the same code. Collectives go through
``torch.distributed``: NCCL between GPUs, gloo on the CPU.
"""

from __future__ import annotations

import contextlib
import datetime
from collections import Counter

import torch
import torch.distributed as dist


class TPGroup:
    """``rank`` of ``size`` ranks; ``counters`` count the collectives issued (by kind)."""

    def __init__(self, rank: int = 0, size: int = 1, group=None):
        self.rank, self.size, self.group = rank, size, group
        self.counters: Counter[str] = Counter()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` over ranks (in place)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
            self.counters["all_reduce"] += 1
        return x

    def all_gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Every rank's ``x`` concatenated along ``dim`` in rank order."""
        if self.size == 1:
            return x
        x = x.movedim(dim, 0).contiguous()
        out = x.new_empty((self.size * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x, group=self.group)
        self.counters["all_gather"] += 1
        if dim == 0:
            return out
        return torch.cat([part.movedim(0, dim) for part in out.chunk(self.size)], dim=dim)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank ``src``'s ``x`` on every rank (in place)."""
        if self.size > 1:
            dist.broadcast(x, src=src, group=self.group)
            self.counters["broadcast"] += 1
        return x

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """Rank ``r``'s part (rows ``[r*n/size, (r+1)*n/size)``) of the sum of ``x`` over ranks."""
        if self.size == 1:
            return x
        out = x.new_empty((x.shape[0] // self.size, *x.shape[1:]))
        dist.reduce_scatter_tensor(out, x.contiguous(), group=self.group)
        self.counters["reduce_scatter"] += 1
        return out


_TP = TPGroup()


def tp() -> TPGroup:
    return _TP


def init_tp(rank: int, size: int, init_method: str, backend: str, timeout_s: float = 600.0) -> TPGroup:
    """Join the process group (``init_method`` e.g. ``tcp://host:port``) and make it this process's."""
    global _TP
    if size > 1:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        _TP = TPGroup(rank, size, dist.group.WORLD)
    return _TP


@contextlib.contextmanager
def single_rank():
    """Build modules at their full (unsharded) shapes, e.g. to learn what a checkpoint holds."""
    global _TP
    saved, _TP = _TP, TPGroup()
    try:
        yield _TP
    finally:
        _TP = saved


def split(total: int, what: str) -> tuple[int, int]:
    """``(start, count)`` of this rank's contiguous share of ``total`` items; ``what`` names them in the
    error when they do not divide evenly."""
    group = tp()
    if total % group.size:
        raise ValueError(f"--tp {group.size}: {what} ({total}) must divide evenly across ranks")
    count = total // group.size
    return group.rank * count, count
