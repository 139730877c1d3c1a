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

import msgspec

SUBDIV = 8
ZERO = -(2**20)  # below every real bucket (2**(-2**17) s)
_LOG2 = math.log2
_msgpack = msgspec.msgpack.Encoder()


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


# ------------------------------------------------------------------ packed
def pack_hist(buckets: dict[int, int]) -> bytes:
    """A histogram as msgpack integers: the first bucket, its count, then per further
    bucket the step from the previous one and its count. Durations fill neighbouring
    buckets, so steps and most counts are one byte each: ~2 bytes a bucket."""
    out: list[int] = []
    prev = None
    for b in sorted(buckets):
        c = int(buckets[b])
        if not c:
            continue
        out += (b if prev is None else b - prev, c)
        prev = b
    return _msgpack.encode(out)


def unpack_hist(data: bytes | None) -> dict[int, int]:
    if not data:
        return {}
    out: dict[int, int] = {}
    add_packed(out, data)
    return out


def add_packed(into: dict[int, int], data: bytes | None) -> None:
    """Add a packed histogram into ``into`` (no dictionary of its own: a prefix history
    adds thousands)."""
    if not data:
        return
    seq = msgspec.msgpack.decode(data)
    b = 0
    get = into.get
    for i in range(0, len(seq), 2):
        b += seq[i]
        into[b] = get(b, 0) + seq[i + 1]


def add_hist(into: dict[int, int], buckets: dict[Any, int] | None) -> None:
    for b, c in (buckets or {}).items():
        into[int(b)] = into.get(int(b), 0) + int(c)
