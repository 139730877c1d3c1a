"""Per-tenant token buckets (events per second), one set per collector process."""

from __future__ import annotations

import math
import threading
import time


class RateLimiter:
    """``take(tenant, n)`` returns 0 if ``n`` events may pass now, else seconds to wait."""

    def __init__(self, rate: float, burst: float = 0.0) -> None:
        self.rate = rate
        self.burst = burst or rate * 2
        self._buckets: dict[str, tuple[float, float]] = {}
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.rate > 0

    def take(self, tenant: str, n: int) -> float:
        if not self.enabled:
            return 0.0
        now = time.monotonic()
        with self._lock:
            tokens, then = self._buckets.get(tenant, (self.burst, now))
            tokens = min(self.burst, tokens + (now - then) * self.rate)
            # A batch larger than the burst passes when the bucket is full (never starves).
            need = min(n, self.burst)
            if tokens >= need:
                self._buckets[tenant] = (tokens - n, now)
                return 0.0
            self._buckets[tenant] = (tokens, now)
            return (need - tokens) / self.rate

    def empty(self, tenant: str) -> float:
        """0 if ``tenant``'s bucket holds an event's worth, else seconds until it does: a
        request that cannot pass whatever it holds is refused before its body is read."""
        if not self.enabled:
            return 0.0
        with self._lock:
            tokens, then = self._buckets.get(tenant, (self.burst, time.monotonic()))
        tokens = min(self.burst, tokens + (time.monotonic() - then) * self.rate)
        return 0.0 if tokens >= 1 else (1 - tokens) / self.rate

    @staticmethod
    def retry_after(wait: float) -> str:
        return str(max(1, math.ceil(wait)))


def enforce(limiter: RateLimiter, tenant: str, events: int | None) -> None:
    """429 with ``Retry-After`` if ``tenant`` may not send ``events`` events now (``None``:
    before the body is read, if it may send none)."""
    from services.common.web import ApiError

    wait = limiter.empty(tenant) if events is None else limiter.take(tenant, events)
    if wait:
        raise ApiError(
            429,
            "rate_limited",
            f"tenant {tenant!r} is over its rate limit of {limiter.rate:g} events/s",
            {"Retry-After": limiter.retry_after(wait)},
        )
