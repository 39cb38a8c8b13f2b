"""The last program of a group to arrive: a kernel's programs each write their share, and the one that
finishes last reads every share and does the group's epilogue, in place of a second launch.

``arrive_last(count_ptr, group_size)`` is called by every program of a group once its share is
stored: a CTA barrier (so each thread's stores precede the arrival), then a GPU-scope acquire-release
atomic increment of the group's counter. The program that sees ``group_size - 1`` arrived last: the
release of every earlier arrival and its own acquire make their shares visible to it, and it reads
them at L2 (``cache_modifier=".cg"``), never from a possibly stale L1 line. It then stores 0 to the
counter, which is how the counters stay zero between launches (a CUDA graph replays the kernels
without any reset of its own); the next kernel that uses them does so only after its PDL wait, which
orders it after this launch's end.

Counters come from :func:`counters`, one zeroed int32 workspace per device and use, allocated on
first use: a decode graph's warm-up step runs before its capture, so capture never allocates one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_WORKSPACES: dict[tuple[torch.device, str], torch.Tensor] = {}
# Workspaces outgrown by a larger launch: a CUDA graph captured earlier still points at them.
_OUTGROWN: list[torch.Tensor] = []
# Counters a workspace holds at least (256 KB of int32).
MIN_COUNTERS = 1 << 16


def counters(device: torch.device, use: str, size: int) -> torch.Tensor:
    """At least ``size`` zeroed int32 counters on ``device`` for one kind of kernel (``use``), kept for the
    process; kernels of different kinds never share one."""
    key = (torch.device(device), use)
    buf = _WORKSPACES.get(key)
    if buf is None or buf.numel() < size:
        if key[0].type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{use}: {size} arrival counters first asked for inside a CUDA graph capture; "
                               f"run the step once before capturing it")
        if buf is not None:
            _OUTGROWN.append(buf)
        buf = torch.zeros(max(size, MIN_COUNTERS), dtype=torch.int32, device=device)
        _WORKSPACES[key] = buf
    return buf


@triton.jit
def arrive_last(count_ptr, group_size):
    """Whether this program is the last of ``group_size`` to arrive at ``count_ptr`` (call once a program's
    share is stored; the last must :func:`rearm` the counter when done)."""
    tl.debug_barrier()
    seen = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
    return seen == group_size - 1


@triton.jit
def rearm(count_ptr):
    """The last program sets its group's counter back to zero for the next launch."""
    tl.store(count_ptr, 0)
