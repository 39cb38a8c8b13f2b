"""Fault injection for the reliability tests: ``TIDAL_FAULTS`` names points and when they fire.

``TIDAL_FAULTS="executor.error@2,scheduler.result@3"`` raises :class:`InjectedFault` the 2nd time
the executor reaches ``executor.error`` and the 3rd time the scheduler reaches ``scheduler.result``
(once each). The points:

- ``executor.error``: a batch fails with an exception (the process lives on); ``executor<R>.error``
  does the same on rank ``R`` only;
- ``executor.fatal``: a batch fails and the device counts as unusable (as after a sticky CUDA error);
- ``executor.hang``: a batch never finishes (the executor sleeps);
- ``executor.load.hang``: the executor never finishes loading (it sleeps before reading its weights);
- ``scheduler.result``: the scheduler's handling of a batch result raises.

``TIDAL_SCRIPTED_OUTPUT="151657,4913,..."`` makes every sampled request emit those token ids, one
per output position, before the model's own choices resume (:func:`scripted_output`): how the tests
get a tool call or a reasoning block out of random weights.

Unset (every production run), :func:`fault` is one dictionary lookup that finds nothing.
"""

from __future__ import annotations

import os
import time


class InjectedFault(RuntimeError):
    pass


def _parse(spec: str) -> dict[str, int]:
    points = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, at = item.partition("@")
        points[name] = int(at or 1)
    return points


_POINTS = _parse(os.environ.get("TIDAL_FAULTS", ""))
_SCRIPT = [int(x) for x in os.environ.get("TIDAL_SCRIPTED_OUTPUT", "").split(",") if x.strip()]
SCRIPTED = bool(_SCRIPT)  # checked once per batch: unset, sampling never looks further


def scripted_output(index: int) -> int | None:
    """The scripted token id of output position ``index``, or ``None``."""
    return _SCRIPT[index] if index < len(_SCRIPT) else None
_SEEN: dict[str, int] = {}


def fault(point: str) -> bool:
    """Whether ``point`` fires now (counting this visit)."""
    if point not in _POINTS:
        return False
    _SEEN[point] = _SEEN.get(point, 0) + 1
    return _SEEN[point] == _POINTS[point]


def check(point: str) -> None:
    """Raise :class:`InjectedFault` (or, for a ``hang`` point, never return) when ``point`` fires."""
    if fault(point):
        if point.endswith(".hang"):
            while True:
                time.sleep(3600)
        raise InjectedFault(f"injected fault at {point}")
