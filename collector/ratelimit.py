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

    def _level(self, tenant: str, now: float) -> float:
        """The tenant's tokens now (call with the lock held)."""
        tokens, then = self._buckets.get(tenant, (self.burst, now))
        return min(self.burst, tokens + (now - then) * self.rate)

    def take(self, tenant: str, n: int) -> float:
        if not self.enabled:
            return 0.0
        now = time.monotonic()
        with self._lock:
            tokens = self._level(tenant, now)
            # A batch larger than the burst passes when the bucket is full (never starves).
            need = min(n, self.burst)
            if tokens >= need:
                self._buckets[tenant] = (tokens - n, now)
                return 0.0
            self._buckets[tenant] = (tokens, now)
            return (need - tokens) / self.rate

    def empty(self, tenant: str) -> float:
        """0 if ``tenant``'s bucket holds an event's worth, else seconds until it does."""
        if not self.enabled:
            return 0.0
        with self._lock:
            tokens = self._level(tenant, time.monotonic())
        return 0.0 if tokens >= 1 else (1 - tokens) / self.rate

    @staticmethod
    def retry_after(wait: float) -> str:
        return str(max(1, math.ceil(wait)))


#: Bodies up to this size are read even from a tenant with an empty bucket: an agent's
#: last batch (often no events) costs nothing to read and passes with none.
SMALL_BODY = 4096


def enforce(
    limiter: RateLimiter, tenant: str, events: int | None, body_bytes: int | None = None
) -> None:
    """429 with ``Retry-After`` if ``tenant`` may not send ``events`` events now. With
    ``events`` None, before the body is read: 429 if the tenant's bucket is empty, unless
    the body is small (``body_bytes``, the request's Content-Length)."""
    from services.common.web import ApiError

    if events is None:
        wait = 0.0 if body_bytes is not None and body_bytes <= SMALL_BODY else limiter.empty(tenant)
    else:
        wait = limiter.take(tenant, events)
    if wait:
        raise ApiError(
            429,
            "rate_limited",
            f"tenant {tenant!r} is over its rate limit of {limiter.rate:g} events/s",
            {"Retry-After": limiter.retry_after(wait)},
        )
