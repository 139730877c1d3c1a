"""A mergeable duration histogram: log-spaced buckets, counts that add.

Bucket ``b`` holds durations in ``[2**(b/8), 2**((b+1)/8))`` seconds: eight buckets per
doubling, so a bucket spans 9% and the representative value (the bucket's geometric
middle) is within 4.5% of any duration in it. Zero and negative durations (clock
granularity) go to :data:`ZERO`. Because a histogram is only counts per bucket, the
histograms of two batches, runs or clusters merge by adding counts: ingest stays
order-independent and quantiles over any set of runs come from the index alone.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

SUBDIV = 8
ZERO = -(2**20)  # below every real bucket (2**(-2**17) s)
_LOG2 = math.log2


def bucket(d: float) -> int:
    """The bucket of a duration in seconds."""
    if d <= 0.0:
        return ZERO
    return math.floor(_LOG2(d) * SUBDIV)


def buckets(d: Any) -> Any:
    """:func:`bucket` of every duration in a NumPy array, as an int64 array."""
    import numpy as np

    out = np.full(d.shape, ZERO, dtype=np.int64)
    pos = d > 0.0
    out[pos] = np.floor(np.log2(d[pos]) * SUBDIV)
    return out


def value(b: int) -> float:
    """A bucket's representative duration (its geometric middle)."""
    if b == ZERO:
        return 0.0
    return 2.0 ** ((b + 0.5) / SUBDIV)


def merge(hists: Iterable[Mapping[int, int]]) -> dict[int, int]:
    """The sum of several histograms."""
    out: dict[int, int] = {}
    for h in hists:
        for b, c in h.items():
            out[b] = out.get(b, 0) + c
    return out


def quantiles(
    hist: Mapping[int, int],
    qs: Iterable[float],
    lo: float | None = None,
    hi: float | None = None,
) -> list[float | None]:
    """Quantiles of a histogram (nearest rank), clamped to the exact ``lo``/``hi`` if known."""
    total = sum(hist.values())
    if total == 0:
        return [None for _ in qs]
    items = sorted(hist.items())
    out: list[float | None] = []
    for q in qs:
        rank = max(1, math.ceil(q * total))
        seen = 0
        for b, c in items:
            seen += c
            if seen >= rank:
                v = value(b)
                if lo is not None:
                    v = max(v, lo)
                if hi is not None:
                    v = min(v, hi)
                out.append(v)
                break
    return out
