"""Which implementation a kernel-shaped operation runs: the Triton kernel or the torch reference.

Triton kernels run only for CUDA tensors, and only where ``triton`` imports; everything else (the
CPU serving path, a machine without triton) takes the torch reference. Setting the environment
variable ``TIDAL_KERNELS=torch`` forces the reference on a GPU too, to bisect a numerical
difference or to measure what a kernel buys. It is read on every call, so a test can flip it.

Triton is imported here only to check that it is there, and only once a CUDA tensor asks: the CPU
path never imports it.
"""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def _triton_importable() -> bool:
    """Whether ``import triton`` works; cached because a failing import is slow and never heals."""
    try:
        import triton  # noqa: F401
    except Exception:  # ImportError, or a broken install failing while it loads its driver
        return False
    return True


def use_triton(t: torch.Tensor) -> bool:
    """True when ``t`` is on CUDA, triton imports and ``TIDAL_KERNELS`` is not ``torch``."""
    if not t.is_cuda:
        return False
    if os.environ.get("TIDAL_KERNELS", "").strip().lower() == "torch":
        return False
    return _triton_importable()
