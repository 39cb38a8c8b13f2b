"""Page-locked host memory of exactly the size asked for (torch's pinned allocator rounds to powers of two)."""

from __future__ import annotations

import gc

import pytest
import torch

from tidal.executor.memory import pinned


class FakeCudart:
    """Records what ``cudaHostRegister`` / ``cudaHostUnregister`` are asked (the CPU has no CUDA runtime)."""

    def __init__(self):
        self.registered: dict[int, int] = {}
        self.calls: list[tuple[str, int]] = []

    def cudaHostRegister(self, ptr, size, flags):  # noqa: N802 (the runtime's name)
        self.registered[ptr] = size
        self.calls.append(("register", size))
        return 0

    def cudaHostUnregister(self, ptr):  # noqa: N802
        size = self.registered.pop(ptr)
        self.calls.append(("unregister", size))
        return 0


def test_exact_size_locked_until_the_last_view_is_gone(monkeypatch):
    fake = FakeCudart()
    monkeypatch.setattr(pinned, "_cudart", lambda: fake)
    shape = (3, 1000, 7)  # 42,000 bytes in bf16: not a power of two
    t = pinned.pinned_empty(shape, torch.bfloat16)
    assert t.shape == shape and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert fake.calls == [("register", 3 * 1000 * 7 * 2)]
    assert list(fake.registered) == [t.data_ptr()]
    t.fill_(1.5)
    view = t[1, 10:20]
    del t
    gc.collect()
    assert fake.registered and torch.all(view == 1.5)  # a view keeps the memory locked and mapped
    del view
    gc.collect()
    assert not fake.registered and fake.calls[-1] == ("unregister", 42000)


def test_a_failed_lock_is_an_error_naming_the_size(monkeypatch):
    class Refusing(FakeCudart):
        def cudaHostRegister(self, ptr, size, flags):  # noqa: N802
            return 2  # cudaErrorMemoryAllocation

    monkeypatch.setattr(pinned, "_cudart", lambda: Refusing())
    with pytest.raises(RuntimeError, match="1024 bytes"):
        pinned.pinned_empty((256,), torch.float32)
    assert pinned.host_empty((4, 0), torch.float32, pinned=True).shape == (4, 0)  # nothing to lock
    assert not pinned.host_empty((8,), torch.float32, pinned=False).is_pinned()


@pytest.mark.gpu
def test_pinned_memory_of_exact_size_copies_asynchronously_gpu():
    """Registered memory counts as pinned (no second copy is made of it), takes nothing from torch's caching host
    allocator, and round-trips through the device with non-blocking copies."""
    before = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    t = pinned.pinned_empty((3, 1000, 7), torch.bfloat16)
    assert t.is_pinned()
    assert torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) == before
    src = torch.randn(3, 1000, 7, device="cuda").to(torch.bfloat16)
    t.copy_(src, non_blocking=True)
    back = t.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, src)
    del t
    gc.collect()
