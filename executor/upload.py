"""Host numbers to the device without a device sync: one pinned buffer, one non-blocking copy."""

from __future__ import annotations

import numpy as np
import torch


class Ref(int):
    """What :meth:`Upload.add` returns: the array's index into :meth:`Upload.send`'s views (an int that
    says it is one, so a record may mix references with plain host ints)."""


class Upload:
    """Host-side arrays (a forward's metadata, sampling parameters), sent to the device in one copy.

    ``add`` takes an array and returns its :class:`Ref`; ``send`` packs them into one pinned buffer, each at a
    16-byte aligned offset (as a separate allocation would be: Triton specialises its kernels on
    16-byte pointer alignment), copies it without blocking the host (on CUDA) and returns each array as
    a typed view of the device copy. A forward's metadata so costs one transfer and no device sync, and
    the host goes on launching kernels while the copy is in flight.
    """

    def __init__(self) -> None:
        self._arrays: list[np.ndarray] = []

    def add(self, values, dtype=np.int64) -> Ref:
        self._arrays.append(np.ascontiguousarray(values, dtype=dtype))
        return Ref(len(self._arrays) - 1)

    def send(self, device: torch.device) -> list[torch.Tensor]:
        offsets, size = [], 0
        for a in self._arrays:
            offsets.append(size)
            size += -(-a.nbytes // 16) * 16
        cuda = device.type == "cuda"
        host = torch.empty(max(size, 16), dtype=torch.uint8, pin_memory=cuda)
        flat = host.numpy()
        for a, off in zip(self._arrays, offsets, strict=True):
            flat[off:off + a.nbytes] = a.reshape(-1).view(np.uint8)
        buf = host if device.type == "cpu" else host.to(device, non_blocking=cuda)
        return [buf[off:off + a.nbytes].view(_TORCH_DTYPES[a.dtype]).reshape(a.shape)
                for a, off in zip(self._arrays, offsets, strict=True)]


_TORCH_DTYPES = {np.dtype(np.int64): torch.long, np.dtype(np.int32): torch.int32, np.dtype(np.bool_): torch.bool,
                 np.dtype(np.float32): torch.float32}


def device_ints(values, device: torch.device | str, dtype=np.int64) -> torch.Tensor:
    """``values`` as a device tensor, copied without a device sync (see :class:`Upload`); ``dtype``
    ``np.float32`` for floats."""
    up = Upload()
    up.add(values, dtype)
    return up.send(torch.device(device))[0]
