"""Task keys as 64-bit hashes: what per-key work over a big run's records groups by.

A run's keys as strings are most of its tasks' columns (~50 bytes a key: 0.5 GB at 10^7
tasks, and twice that once encoded or sorted); their hashes are 8 bytes a record, taken a
row group at a time. Two distinct keys share a hash with probability ~n^2 / 2^65 (3e-6 at
10^7 keys), and would then be counted as one: a fact of the run page off by one task, not
a wrong record. Python's string hash is per process, so hashes are compared only within
one computation, never stored."""

from __future__ import annotations

from typing import Any


def hashes(values: Any) -> Any:
    """The 64-bit hash of each string of an Arrow array (nulls hash as ``None``)."""
    import numpy as np

    return np.fromiter(map(hash, values.to_pylist()), dtype=np.int64, count=len(values))
