"""Realistic Dask-like task batches for the benchmarks (not a benchmark itself).

Task events are shaped like the scheduler plugin's records (see
../shared/research/dask-internals.md, 1.4): tuple keys with a token, worker address and
thread id, compute startstops and a transfer on ~30% of tasks, result sizes and types.
Times are full-precision epoch floats, as Dask hands them to the agent. Array-like prefixes
have one chunk size; dataframe-like prefixes vary around a mean.
"""

from __future__ import annotations

import random
import uuid
from typing import Any

import msgspec
import zstandard

# prefix -> (typename, chunk bytes, varies?)
PREFIXES = {
    "read-parquet": ("pandas.core.frame.DataFrame", 12_000_000, True),
    "getitem": ("pandas.core.series.Series", 1_500_000, True),
    "add": ("numpy.ndarray", 8_000_000, False),
    "sum-chunk": ("numpy.ndarray", 80_000, False),
    "sum-aggregate": ("numpy.float64", 8, False),
    "shuffle-transfer": ("int", 28, False),
    "repartition": ("pandas.core.frame.DataFrame", 25_000_000, True),
    "astype": ("pandas.core.frame.DataFrame", 10_000_000, True),
    "mean_chunk": ("numpy.ndarray", 800_000, False),
    "finalize": ("pandas.core.frame.DataFrame", 4_000, True),
}
NAMES = list(PREFIXES)


def task_events(
    n: int, *, first: int, run: str, t0: float, rng: random.Random
) -> list[dict[str, Any]]:
    workers = [f"tcp://10.0.{i // 8}.{i % 8 + 10}:{40000 + i}" for i in range(16)]
    threads = [140270328174272 + 4096 * i for i in range(4)]
    tokens = {p: uuid.UUID(int=rng.getrandbits(128)).hex for p in NAMES}
    events = []
    for i in range(n):
        prefix = NAMES[(first + i) % len(NAMES)]
        typename, size, varies = PREFIXES[prefix]
        start = t0 + i * 0.0004 + rng.random() * 0.01
        stop = start + rng.expovariate(1 / 0.05)
        ss: list[dict[str, Any]] = [{"action": "compute", "start": start, "stop": stop}]
        if rng.random() < 0.3:
            tstop = start - rng.random() * 0.02
            ss.insert(
                0,
                {
                    "action": "transfer",
                    "start": tstop - rng.random() * 0.05,
                    "stop": tstop,
                    "source": rng.choice(workers),
                },
            )
        events.append(
            {
                "kind": "task",
                "key": f"('{prefix}-{tokens[prefix]}', {first + i})",
                "prefix": prefix,
                "group": f"{prefix}-{tokens[prefix]}",
                "run": run,
                "worker": rng.choice(workers),
                "thread": rng.choice(threads),
                "status": "memory",
                "nbytes": int(size * rng.uniform(0.75, 1.25)) if varies else size,
                "typename": typename,
                "startstops": ss,
            }
        )
    return events


def batch(
    cluster: str, session: str, agent: str, seq: int, events: list[dict[str, Any]]
) -> dict[str, Any]:
    return {
        "schema": 1,
        "cluster": cluster,
        "session": session,
        "agent": agent,
        "seq": seq,
        "dropped": {"buffer_full": 0},
        "events": events,
    }


def encoded_batches(
    count: int,
    n: int = 5000,
    *,
    agent: str = "scheduler-0",
    session: str = "Scheduler-bench",
    cluster: str = "bench",
    seed: int = 0,
    level: int = 3,
) -> list[bytes]:
    """``count`` zstd-compressed JSON batches of ``n`` task events each."""
    rng = random.Random(seed)
    enc = msgspec.json.Encoder()
    cctx = zstandard.ZstdCompressor(level=level)
    out = []
    for s in range(count):
        events = task_events(n, first=s * n, run=f"run-{s // 20}", t0=1.8e9 + s * 2, rng=rng)
        out.append(cctx.compress(enc.encode(batch(cluster, session, agent, s, events))))
    return out
