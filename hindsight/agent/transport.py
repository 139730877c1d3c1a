"""HTTP delivery of one batch body, with the collector's answer classified for the agent."""

from __future__ import annotations

import email.utils
import http.client
import logging
import random
import time
from dataclasses import dataclass
from typing import Literal

from hindsight.sender import Sender

logger = logging.getLogger(__name__)

#: Statuses worth another try: the collector is overloaded, a proxy could not reach it, or
#: the body stopped arriving before its end (408).
RETRYABLE = frozenset({408, 429, 502, 503, 504})
#: Statuses that say the URL is not a collector's (a query service, a proxy's page, a typo
#: in the path): nothing about the batch, so it is kept, as when nothing answers, and
#: ``hindsight spool push --url`` can deliver it once the URL is fixed.
MISADDRESSED = frozenset({404, 405})

Verdict = Literal["ok", "retry", "too_large", "reject"]

BACKOFF_BASE = 0.5
BACKOFF_MAX = 30.0
RETRY_AFTER_MAX = 300.0


@dataclass
class Outcome:
    """What to do with a batch after one POST."""

    verdict: Verdict
    status: int | None = None  # None: no HTTP answer (connection error, timeout)
    retry_after: float | None = None
    message: str = ""


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (delta-seconds or an HTTP date)."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError, IndexError):
        return None
    return max(0.0, when - (time.time() if now is None else now))


def retry_delay(outcome: Outcome, attempts: int) -> float:
    """Seconds to wait before attempt ``attempts + 1``: the collector's ``Retry-After``
    (capped), else exponential backoff with jitter so agents do not retry in step."""
    if outcome.retry_after is not None:
        return min(outcome.retry_after, RETRY_AFTER_MAX)
    cap = min(BACKOFF_MAX, BACKOFF_BASE * 2 ** min(max(attempts, 1) - 1, 16))
    return random.uniform(cap / 2, cap)


class Transport:
    """POSTs batch bodies over one keep-alive connection (see :class:`hindsight.sender.Sender`)."""

    def __init__(self, url: str, token: str | None, timeout: float) -> None:
        self.url = url
        self._sender = Sender(url, token, timeout=timeout)

    def limit_timeout(self, seconds: float) -> None:
        """Wait at most ``seconds`` for any answer from now on (an open connection too)."""
        if seconds < self._sender.timeout:
            self._sender.timeout = seconds
            self._sender.close()  # the next request connects with the new timeout

    def post(self, body: bytes, encoding: str) -> Outcome:
        """Send one compressed body; never raises."""
        try:
            resp = self._sender.send(body, encoding=encoding, compressed=True)
        except (OSError, http.client.HTTPException) as exc:
            self._sender.close()
            return Outcome("retry", None, None, f"{type(exc).__name__}: {exc}")
        except Exception as exc:  # a bug here must not kill the agent thread
            self._sender.close()
            logger.debug("hindsight: unexpected transport error", exc_info=True)
            return Outcome("retry", None, None, f"{type(exc).__name__}: {exc}")
        error = resp.body.get("error") if isinstance(resp.body, dict) else None
        message = error.get("message", "") if isinstance(error, dict) else ""
        if 200 <= resp.status < 300:
            return Outcome("ok", resp.status)
        if resp.status in RETRYABLE:
            retry_after = parse_retry_after(resp.headers.get("retry-after"))
            return Outcome("retry", resp.status, retry_after, message)
        if resp.status in MISADDRESSED:
            return Outcome(
                "retry",
                resp.status,
                None,
                f"no collector at {self.url}: point the agent at the collector's "
                f"base URL, e.g. http://HOST:8700 (answered: {message})",
            )
        if resp.status == 413:
            return Outcome("too_large", resp.status, None, message)
        return Outcome("reject", resp.status, None, message)

    def close(self) -> None:
        self._sender.close()
