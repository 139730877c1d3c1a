"""Overload: measure the collector's capacity, then flood it at twice that for DURATION
seconds. The collector must answer 429 (per-tenant rate limit) or 503 (in-flight bound)
instead of failing, and its memory must stay bounded (no growth over the run).

The real collector under gunicorn (2 gthread workers), Postgres (a fresh database) and
moto's S3 server, all on one machine with the senders.

    .venv/bin/python -m bench.flood [--duration 300] [--measure 15]

Prints the figures and a JSON line; exits non-zero if memory grew (the last minute's RSS
over 1.25 x the first's) or a request failed with anything but 202/429/503.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from collections import Counter
from typing import Any

from bench.ingest import EVENTS_PER_BATCH, Frames
from bench.lib_faults import (
    Gunicorn,
    collector_env,
    fresh_database,
    make_bucket,
    make_token,
    moto_server,
)
from bench.lib_results import report
from hindsight.sender import Sender

TARGETS = {
    "rss_last_minute_mb": "<= 1.25 x rss_first_minute_mb",
    "answers": "202, 429 or 503 only",
}
ADMIN_URL = os.environ.get(
    "TEST_DATABASE_URL", "postgresql+psycopg2://postgres@127.0.0.1:5432/test"
)


def drive(
    url: str,
    token: str,
    frames: Frames,
    *,
    senders: int,
    seconds: float,
    rate: float | None,
    prefix: str,
) -> tuple[Counter[Any], list[float]]:
    """Send for ``seconds``: as fast as ``senders`` can (``rate`` None) or paced at ``rate``
    requests/s over all senders. Returns answers by status and the 202 latencies."""
    statuses: Counter[Any] = Counter()
    latencies: list[float] = []
    lock = threading.Lock()
    t0 = time.monotonic()
    stop_at = t0 + seconds
    slot = [0]

    def sender(i: int) -> None:
        seq = 0
        with Sender(url, token, timeout=30) as s:
            while True:
                if rate:
                    with lock:
                        k = slot[0]
                        slot[0] += 1
                    due = t0 + k / rate
                    # A sender that fell behind does not catch up after the end: the run
                    # lasts ``seconds``, whatever was left of the offered load is not sent.
                    if due > stop_at or time.monotonic() > stop_at:
                        return
                    # Pacing the offered load (open loop), not waiting for a condition.
                    time.sleep(max(0.0, due - time.monotonic()))
                elif time.monotonic() > stop_at:
                    return
                body = frames.body(f"{prefix}-{i}", seq)
                t = time.perf_counter()
                try:
                    resp = s.send(body, compressed=True)
                    status: Any = resp.status
                except OSError as exc:
                    status = type(exc).__name__
                with lock:
                    statuses[status] += 1
                    if status == 202:
                        latencies.append(time.perf_counter() - t)
                if status == 202:
                    seq += 1

    threads = [threading.Thread(target=sender, args=(i,)) for i in range(senders)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 120)
    return statuses, latencies


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=float, default=300.0)
    ap.add_argument("--measure", type=float, default=15.0)
    ap.add_argument("--senders", type=int, default=64)
    ap.add_argument(
        "--limit-fraction",
        type=float,
        default=0.5,
        help="per-tenant rate limit as a fraction of the measured capacity",
    )
    args = ap.parse_args()

    frames = Frames(pool=8)
    with moto_server() as s3, fresh_database(ADMIN_URL) as db_url:
        blob_url = f"s3://{make_bucket(s3)}/h"
        token = make_token(db_url, "flood")
        env = collector_env(db_url, blob_url, s3)

        server = Gunicorn(env)
        try:
            statuses, _ = drive(
                server.url,
                token,
                frames,
                senders=3,
                seconds=args.measure,
                rate=None,
                prefix="measure",
            )
        finally:
            server.stop()
        capacity_rps = statuses[202] / args.measure
        capacity = capacity_rps * EVENTS_PER_BATCH
        print(
            f"capacity: {capacity:,.0f} events/s ({capacity_rps:.1f} batches/s of "
            f"{EVENTS_PER_BATCH})"
        )

        # The per-tenant limit below the measured capacity (what an operator sets so that
        # excess load is answered 429 at once instead of queueing), split over 2 workers.
        limit = capacity * args.limit_fraction
        print(f"rate limit: {limit:,.0f} events/s for the tenant ({limit / 2:,.0f} per worker)")
        limited = {
            **env,
            "HINDSIGHT_RATE_LIMIT_EVENTS": str(int(limit / 2)),
            "HINDSIGHT_RATE_LIMIT_BURST": str(EVENTS_PER_BATCH * 2),
        }
        server = Gunicorn(limited)
        rss: list[tuple[float, int]] = []
        done = threading.Event()

        def sample() -> None:
            while not done.wait(1.0):
                rss.append((time.monotonic(), server.rss()))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            print(
                f"flooding at {2 * capacity_rps:.1f} batches/s for {args.duration:.0f} s ...",
                flush=True,
            )
            statuses, lat = drive(
                server.url,
                token,
                frames,
                senders=args.senders,
                seconds=args.duration,
                rate=2 * capacity_rps,
                prefix="flood",
            )
        finally:
            done.set()
            sampler.join(5)
            server.stop()

    t_first = rss[0][0]
    first = [r for t, r in rss if t - t_first < 60] or [rss[0][1]]
    last = [r for t, r in rss if t > rss[-1][0] - 60] or [rss[-1][1]]
    total = sum(statuses.values())
    failed = {k: v for k, v in statuses.items() if k not in (202, 429, 503)}
    lat.sort()
    figures = {
        "capacity_events_per_s": round(capacity),
        "rate_limit_events_per_s": round(capacity * args.limit_fraction),
        "offered_batches_per_s": round(2 * capacity_rps, 1),
        "sent_batches_per_s": round(sum(statuses.values()) / args.duration, 1),
        "seconds": args.duration,
        "requests": total,
        "answers": {str(k): v for k, v in statuses.items()},
        "accepted_events_per_s": round(statuses[202] * EVENTS_PER_BATCH / args.duration),
        "ack_p50_ms": round(statistics.median(lat) * 1000, 1) if lat else None,
        "ack_p99_ms": round(lat[int(len(lat) * 0.99)] * 1000, 1) if lat else None,
        "rss_first_minute_mb": round(statistics.mean(first) / 2**20, 1),
        "rss_last_minute_mb": round(statistics.mean(last) / 2**20, 1),
        "rss_peak_mb": round(max(r for _, r in rss) / 2**20, 1),
    }
    bounded = figures["rss_last_minute_mb"] <= 1.25 * figures["rss_first_minute_mb"]
    for k, v in figures.items():
        print(f"  {k}: {v}")
    print(
        f"memory bounded (last minute <= 1.25 x first): {bounded}; "
        f"answers other than 202/429/503: {failed or 'none'}"
    )
    report("flood", figures, TARGETS, bounded and not failed)
    return 0 if bounded and not failed else 1


if __name__ == "__main__":
    raise SystemExit(main())
