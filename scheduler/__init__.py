"""The scheduler: CPU-only admission, planning, continuous batching and pool accounting."""

from .scheduler import Scheduler

__all__ = ["Scheduler"]
