"""Tensor parallelism: the process's TP group, its collectives, and how weights split across ranks."""

from .group import TPGroup, init_tp, single_rank, split, tp

__all__ = ["TPGroup", "init_tp", "single_rank", "split", "tp"]
