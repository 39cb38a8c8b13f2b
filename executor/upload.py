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

    def send(self, device: torch.device, into: torch.Tensor | None = None) -> list[torch.Tensor]:
        """The arrays as views of one device buffer: a new one, or ``into`` (bytes on ``device``, at least
        :meth:`nbytes` of them), which a CUDA graph recorded over its views reads at every replay."""
        offsets, size = self._offsets()
        cuda = device.type == "cuda"
        host = torch.empty(size, dtype=torch.uint8, pin_memory=cuda)
        flat = host.numpy()
        for a, off in zip(self._arrays, offsets, strict=True):
            flat[off:off + a.nbytes] = a.reshape(-1).view(np.uint8)
        if into is not None:
            if into.numel() < size:
                raise ValueError(f"the upload needs {size} bytes; the buffer holds {into.numel()}")
            buf = into
            buf[:size].copy_(host, non_blocking=cuda)
        else:
            buf = host if device.type == "cpu" else host.to(device, non_blocking=cuda)
        return [buf[off:off + a.nbytes].view(_TORCH_DTYPES[a.dtype]).reshape(a.shape)
                for a, off in zip(self._arrays, offsets, strict=True)]

    def _offsets(self) -> tuple[list[int], int]:
        """Each array's offset in the device buffer (16-byte aligned) and the buffer's size (at least 16 bytes)."""
        offsets, size = [], 0
        for a in self._arrays:
            offsets.append(size)
            size += -(-a.nbytes // 16) * 16
        return offsets, max(size, 16)

    def nbytes(self) -> int:
        """The device buffer's size."""
        return self._offsets()[1]

    def layout(self) -> tuple:
        """Each array's dtype and shape, in order: two uploads of one layout give views at the same offsets."""
        return tuple((a.dtype.str, a.shape) for a in self._arrays)


_TORCH_DTYPES = {np.dtype(np.int64): torch.long, np.dtype(np.int32): torch.int32, np.dtype(np.bool_): torch.bool,
                 np.dtype(np.float32): torch.float32}


def device_ints(values, device: torch.device | str, dtype=np.int64) -> torch.Tensor:
    """``values`` as a device tensor, copied without a device sync (see :class:`Upload`); ``dtype``
    ``np.float32`` for floats."""
    up = Upload()
    up.add(values, dtype)
    return up.send(torch.device(device))[0]
