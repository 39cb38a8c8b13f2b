"""The Triton side of programmatic dependent launch (see ``kernels/pdl``): three helpers a kernel calls
with its ``PDL`` constexpr, so a launch without PDL (the CPU interpreter, older GPUs) compiles none of it."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def pdl_launch_next(PDL: tl.constexpr):
    """Let the next kernel (launched with PDL) start its programs now."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Wait until the previous kernel has finished and its writes are visible."""
    if PDL:
        gdc_wait()


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """Both, on entry to a kernel that reads nothing before the previous kernel's output."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
