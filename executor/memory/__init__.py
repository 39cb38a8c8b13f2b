"""Device-side pools of per-request state. The scheduler allocates; the executor only indexes."""

from .kv_cache import KVPool
from .state_slots import StatePool

__all__ = ["KVPool", "StatePool"]
