"""Percentiles and the summaries ``tidal bench`` reports for each latency or rate."""

from __future__ import annotations

import math
from collections.abc import Iterable

QUANTILES = (50, 90, 99)


def percentile(values: Iterable[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation between the closest ranks, the
    definition numpy's ``percentile`` uses by default; ``nan`` for no values."""
    xs = sorted(values)
    if not xs:
        return math.nan
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is outside 0-100")
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(values: Iterable[float | None]) -> dict[str, float | int | None]:
    """``count``, ``mean``, ``p50``, ``p90``, ``p99``, ``min`` and ``max`` of the values that are not
    ``None`` (the statistics are ``None`` when there are none)."""
    xs = [float(v) for v in values if v is not None]
    out: dict[str, float | int | None] = {"count": len(xs)}
    if not xs:
        return out | {"mean": None, **{f"p{q}": None for q in QUANTILES}, "min": None, "max": None}
    out["mean"] = sum(xs) / len(xs)
    for q in QUANTILES:
        out[f"p{q}"] = percentile(xs, q)
    out["min"], out["max"] = min(xs), max(xs)
    return out


def gaps(events: list[float], lo: float, hi: float) -> list[float]:
    """Gaps between consecutive event times of one stream whose later event falls in ``[lo, hi]``."""
    return [b - a for a, b in zip(events, events[1:], strict=False) if lo <= b <= hi]
