"""Page-locked host memory of exactly the size asked for.

torch's pinned allocations (``pin_memory=True``, ``Tensor.pin_memory()``) go through its caching host allocator,
which rounds every block up to the next power of two: host expert banks and a pinned n-gram table would lock up to
twice the memory the load plan counts (a 1.7 GB layer of FP8 experts takes 2 GiB), and a plan that fits the host
would be killed by the kernel's out-of-memory killer while it loads. :func:`pinned_empty` instead maps anonymous
memory of the exact size (in huge pages where the kernel allows), faults it in on torch's threads and locks it with
``cudaHostRegister``; the memory is unlocked and unmapped once the last tensor on it is gone.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import weakref

import torch


def _cudart():
    return torch.cuda.cudart()


def _failed(err) -> bool:
    return int(getattr(err, "value", err)) != 0


def _unregister(ptr: int, mapping: mmap.mmap) -> None:
    """Unlock ``ptr`` while ``mapping`` still maps it (the mapping is released when this returns)."""
    _cudart().cudaHostUnregister(ptr)


def pinned_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised host tensor of ``shape`` and ``dtype`` in page-locked memory of exactly its size."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    mapping = mmap.mmap(-1, nbytes)
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)  # 2 MiB pages where the kernel has them: fewer to fault and lock
    except (AttributeError, OSError):
        pass
    buffer = (ctypes.c_uint8 * nbytes).from_buffer(mapping)
    ptr = ctypes.addressof(buffer)
    # Fault the pages in on every core (a fill runs on torch's threads); registering alone faults them one at a time.
    torch.frombuffer(buffer, dtype=torch.uint8).zero_()
    err = _cudart().cudaHostRegister(ptr, nbytes, 0)
    if _failed(err):
        del buffer
        mapping.close()
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes of host memory failed ({err})")
    weakref.finalize(buffer, _unregister, ptr, mapping)
    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).view(shape)


def host_empty(shape: tuple[int, ...], dtype: torch.dtype, pinned: bool) -> torch.Tensor:
    """An uninitialised host tensor, page-locked (:func:`pinned_empty`) when ``pinned``."""
    return pinned_empty(tuple(shape), dtype) if pinned else torch.empty(shape, dtype=dtype)
