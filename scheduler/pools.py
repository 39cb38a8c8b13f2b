"""CPU-side accounting of the executor's pools: which KV pages and state slots are whose."""

from __future__ import annotations

from collections import deque


class SlotPool:
    """State slots ``[start, start + n)``: request slots, or prefix-cache checkpoint slots."""

    def __init__(self, num_slots: int, start: int = 0):
        self.total = num_slots
        self._free = deque(range(start, start + num_slots))
        self._held: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        if not self._free:
            return None
        slot = self._free.popleft()
        self._held.add(slot)
        return slot

    def free(self, slot: int) -> None:
        """Return a held slot; freeing one twice (two owners of one state) is a bug and raises."""
        if slot not in self._held:
            raise RuntimeError(f"state slot {slot} freed but not held")
        self._held.remove(slot)
        self._free.append(slot)


class PagePool:
    """KV pages ``[0, n)`` with reference counts: a page shared by a cached prefix and the
    requests reading it returns to the free list when the last holder lets go."""

    def __init__(self, num_pages: int):
        self.total = num_pages
        self._free = deque(range(num_pages))
        self.refs = [0] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, count: int) -> list[int] | None:
        if count > len(self._free):
            return None
        pages = [self._free.popleft() for _ in range(count)]
        for p in pages:
            self.refs[p] = 1
        return pages

    def incref(self, pages) -> None:
        for p in pages:
            self.refs[p] += 1

    def decref(self, pages) -> list[int]:
        """Drop one reference from each page; returns the pages that became free."""
        freed = []
        for p in pages:
            self.refs[p] -= 1
            if self.refs[p] == 0:
                self._free.append(p)
                freed.append(p)
            elif self.refs[p] < 0:
                raise RuntimeError(f"KV page {p} released more often than it was held")
        return freed
