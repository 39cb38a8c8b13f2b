"""Programmatic dependent launch (PDL, Hopper and later) for the decode step's Triton kernels.

A decode step is a chain of small kernels, each a few microseconds, and between two of them the GPU
drains one grid and starts the next. A kernel launched with PDL may start while the kernel before it
is still finishing: its programs run up to ``gdc_wait()`` (which returns once the previous grid has
completed and its writes are visible), so whatever they do first overlaps the previous kernel's tail.
The weight-streaming kernels load their weights before the wait (nothing in a step writes them, and
``StackedWeight`` synchronises once it has built a stack) and the activations after it. Each of these
kernels calls ``gdc_launch_dependents()`` on entry, so that the next PDL kernel may be scheduled as soon
as SMs free up; the decode MoE's gate_up kernel calls it after its wait instead, so that the down kernel
after it may read the router's expert ids (and load those experts' weights) before its own wait. The GDN
step kernel (``gdn_decode_triton._gdn_step_kernel``, generated-token decodes only) loads its recurrent
states before the wait: the slots are the forward's inputs, copied before its first kernel, and a slot's
state was last written by the same layer of an earlier forward, from which a kernel launched without PDL
(the graph replay's boundary, the sampling, or an eager forward's embedding gather) separates it. Any other
kernel that reads or writes anything the previous kernel may touch does so only after ``gdc_wait()``;
both calls are no-ops in a launch without PDL. Captured in a CUDA graph the launches become programmatic
edges.

``TIDAL_PDL=0`` turns it off (read at each launch: a graph keeps the launches it was captured with).
"""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def _supported(device: int) -> bool:
    """SM 9.0 or later (the kernels' modules import ``kernels/pdl_triton``, so triton has the calls)."""
    return torch.cuda.get_device_capability(device)[0] >= 9


def launch_args(t: torch.Tensor) -> dict[str, bool]:
    """A Triton launch's PDL arguments for kernels over ``t``: the kernel's ``PDL`` constexpr (which compiles
    the ``kernels/pdl_triton`` calls in) and the launch option, both :func:`enabled`."""
    on = enabled(t)
    return {"PDL": on, "launch_pdl": on}


def enabled(t: torch.Tensor) -> bool:
    """Whether kernels over ``t`` launch with PDL: a CUDA tensor on an SM 9.0+ device, ``TIDAL_PDL`` not 0."""
    if not t.is_cuda or os.environ.get("TIDAL_PDL", "1") == "0":
        return False
    return _supported(torch.cuda.current_device() if t.device.index is None else t.device.index)
