"""The agent: a bounded buffer drained by one daemon thread that batches, compresses,
POSTs, retries and spools.

Producers (Dask hooks, log handlers, ``hindsight.emit``) only call :meth:`Agent.add`.
Everything slow happens on the thread named ``hindsight-agent``: cutting batches,
encoding, zstd, HTTP, backoff sleeps and disk I/O.  Delivery is strictly in sequence
order: batches that cannot be sent right away go to the spool, and once anything is
spooled every newer batch queues behind it, so the collector sees ``seq`` in order.
A second thread, ``hindsight-adopt``, delivers the spools that agents which are gone left
behind (``hindsight/agent/adopt.py``).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import uuid
import weakref
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

import msgspec

from hindsight.agent.adopt import Adoption, DirLock, agent_meta, create_owned
from hindsight.agent.buffer import EventBuffer, Item
from hindsight.agent.kinds import UNKNOWN_KIND, decompress, kind_of
from hindsight.agent.spool import Spool, SpooledBatch
from hindsight.agent.transport import MISADDRESSED, Outcome, Transport, retry_delay
from hindsight.config import Settings
from hindsight.schema import (
    LATER_KINDS,
    SCHEMA_VERSION,
    Batch,
    agent_name_prefix,
    decode_batch,
    replace_nul,
)
from hindsight.sender import compress

logger = logging.getLogger(__name__)

#: Batches kept in memory before the queue spills to the spool.
OUTBOX_BATCHES = 4
#: Seconds between two warnings about the same delivery problem.
WARN_EVERY = 60.0
#: The longest backoff while closing (the close budget is seconds; a nanny kills its
#: worker 4 s into closing).
CLOSING_BACKOFF_MAX = 1.0
#: The longest one request may wait for an answer while closing.
CLOSE_REQUEST_S = 1.0
#: While closing, a request that failed without an answer this quickly (a reset connection,
#: a refused one) is tried again, at most this many times in a row: a collector replica that
#: died mid-request has a sibling behind the same address, and a collector that is down
#: costs a few milliseconds per try. A request that timed out is not tried again.
CLOSE_QUICK_FAILURE_S = 0.5
CLOSE_QUICK_RETRIES = 2

_encoder = msgspec.json.Encoder()
# How a collector that predates an event kind names it in its 400 answer.
_agents: weakref.WeakSet[Agent] = weakref.WeakSet()


def _event_of(item: Item) -> Any:
    if isinstance(item, tuple):
        return item[0](*item[1:])
    return item


def new_agent_name(prefix: str) -> str:
    """A name unique to one agent instance (``seq`` restarts at 0 with each instance)."""
    return f"{agent_name_prefix(prefix)}{uuid.uuid4().hex[:12]}"


class Agent:
    """Ships events for one ``(cluster, session, agent)`` identity to the collector.

    ``add()`` is the only method meant for hot paths: it never blocks and never raises.
    ``flush()`` and ``close()`` wait at most their timeout.  After ``os.fork()`` the
    child's agent becomes a new instance (new name, ``seq`` from 0, empty buffer) and
    starts its thread on the next ``add()``.
    """

    def __init__(self, settings: Settings, *, session: str, name: str) -> None:
        self.settings = settings
        self.session = session
        self._name_prefix = name
        self._closed = False
        self._lock = threading.Lock()  # guards thread start/stop, not the hot path
        #: Called (never raising) before the interpreter's exit closes this agent: its owner
        #: records what it still knows (Python runs exit handlers last-registered first, so
        #: this one runs before those of the libraries its owner lives in).
        self.before_exit: list[Callable[[], None]] = []
        self._reset(new_agent_name(name))
        _agents.add(self)
        _ensure_atexit()

    # -- state ---------------------------------------------------------------------
    def _reset(self, name: str) -> None:
        self.name = name
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._flush_now = False
        self._thread: threading.Thread | None = None
        self._buffer = EventBuffer(
            self.settings.buffer_events, self.settings.flush_events, self._wake.set
        )
        self._seq = 0
        self._dropped: Counter[str] = Counter()
        self._reported_dropped: dict[str, int] = {}
        self._outbox: deque[SpooledBatch] = deque()
        self._spool: Spool | None = None
        self._spool_lock: DirLock | None = None
        self.adoption: Adoption | None = None
        self._transport: Transport | None = None
        self._attempts = 0
        self._retry_at = 0.0
        self._quick_failures = 0  # in a row, while closing (see CLOSE_QUICK_RETRIES)
        self._warned: dict[str, float] = {}
        # Event kinds the collector turned down as unknown (it predates them).
        self._unsupported: set[str] = set()
        self.stats: Counter[str] = Counter()

    def _after_fork(self) -> None:
        # The parent keeps delivering what it buffered; the child starts clean under a
        # new identity so the two never send different batches with the same seq.
        self._lock = threading.Lock()
        self.before_exit = []  # the parent's owners are not the child's
        if self._closed:
            return
        self._reset(new_agent_name(self._name_prefix))

    # -- producer side -------------------------------------------------------------
    def add(self, item: Item) -> None:
        """Queue one event (or deferred event tuple); never blocks, never raises."""
        try:
            if self._thread is None or self._closed:
                if self._closed:
                    return
                self._start()
            self._buffer.add(item)
        except Exception:  # never into the host
            pass

    def drop(self, reason: str, count: int = 1) -> None:
        """Count events the caller could not record (they travel in the next batch)."""
        self._buffer.drop(reason, count)

    def _start(self) -> None:
        with self._lock:
            if self._thread is not None or self._closed:
                return
            thread = threading.Thread(target=self._run, name="hindsight-agent", daemon=True)
            self._thread = thread
            thread.start()
            if self.settings.url and self.settings.adopt_spools:
                self.adoption = Adoption(self.settings, own=self.name)
                self.adoption.start()

    # -- control -------------------------------------------------------------------
    def flush(self, timeout: float = 10.0) -> bool:
        """Deliver everything added so far; True if nothing is left pending in time."""
        if self._thread is None:
            if self._closed or not len(self._buffer):
                return not len(self._buffer)
            self._start()
        deadline = time.monotonic() + timeout
        self._idle.clear()
        self._flush_now = True
        self._wake.set()
        while time.monotonic() < deadline:
            if self._idle.wait(min(0.05, max(0.0, deadline - time.monotonic()))):
                if not self.pending():
                    return True
                self._idle.clear()
                self._flush_now = True
                self._wake.set()
        return not self.pending()

    @property
    def closed(self) -> bool:
        return self._closed

    def pending(self) -> int:
        """Events not yet acknowledged by the collector (buffered, queued or spooled)."""
        spooled = self._spool.events() if self._spool is not None else 0
        # list() copies atomically under the GIL while the agent thread mutates the deque.
        return len(self._buffer) + sum(b.events for b in list(self._outbox)) + spooled

    def close(self, timeout: float | None = None) -> None:
        """Send what is left, ending with a ``final`` batch, within ``timeout`` seconds.

        Whatever cannot be delivered in time stays in the spool directory.
        """
        timeout = self.settings.close_timeout if timeout is None else timeout
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._close_deadline = time.monotonic() + timeout
            if self.adoption is not None:
                self.adoption.stop()  # what it has not delivered waits for the next agent
            thread = self._thread
            if thread is None:
                thread = threading.Thread(target=self._run, name="hindsight-agent", daemon=True)
                self._thread = thread
                thread.start()
        self._stop.set()
        self._wake.set()
        thread.join(timeout + 0.5)
        if thread.is_alive():
            logger.warning("hindsight: agent %s did not finish within %.1fs", self.name, timeout)

    # -- agent thread --------------------------------------------------------------
    def _run(self) -> None:
        interval = self.settings.flush_interval
        next_flush = time.monotonic() + interval
        while True:
            try:
                now = time.monotonic()
                wait_until = next_flush
                if self._has_backlog() and self.settings.url:
                    wait_until = min(wait_until, max(self._retry_at, now + 0.01))
                self._wake.wait(max(0.0, wait_until - now))
                self._wake.clear()
                if self._stop.is_set():
                    break
                now = time.monotonic()
                forced = self._flush_now or now >= next_flush
                self._flush_now = False
                self._cut(force=forced)
                if forced:
                    next_flush = now + interval
                self._deliver(deadline=None)
                if not self._has_backlog() and not len(self._buffer):
                    self._idle.set()
            except Exception:  # keep the thread alive whatever happens
                logger.exception("hindsight: agent loop error")
                time.sleep(0.1)
        try:
            # Try at once, whatever backoff an outage left (up to 30 s, or a Retry-After):
            # the collector may be back, and waiting it out outlived the close budget (a
            # nanny kills its worker 4 s into closing): after a collector restart, closing
            # workers' agents would never try, and their batches would wait in the spool
            # for a later agent.
            self._retry_at = 0.0
            self._attempts = 0
            # Deliver first, then cut the final batch: drops counted during this last
            # delivery (rejections, splits) still make it into the final batch.
            self._cut(force=True)
            self._deliver(deadline=self._close_deadline)
            self._cut(force=True, final=True)
            self._deliver(deadline=self._close_deadline)
            self._park_outbox()
            if self._spool is not None and not len(self._spool):
                self._spool.remove_directory()
            elif self._spool is not None and self.settings.url:
                self._warn_left_in_spool()
        except Exception:
            logger.exception("hindsight: agent close error")
        finally:
            if self._transport is not None:
                self._transport.close()
            if self._spool_lock is not None:
                # Closed with batches left: they are another agent's to adopt from now on.
                self._spool_lock.release()
            self._idle.set()

    def _warn_left_in_spool(self) -> None:
        """Say once, at close, where the batches that did not get through are and how to
        send them."""
        assert self._spool is not None
        where = self._spool.directory
        if where is None:
            logger.warning(
                "hindsight: agent %s closed with %d batches (%d events) not delivered to %s;"
                " its spool directory was unusable, so they are lost with this process",
                self.name,
                len(self._spool),
                self._spool.events(),
                self.settings.url,
            )
            return
        logger.warning(
            "hindsight: agent %s closed with %d batches (%d events) not delivered to %s;"
            " they are kept in %s. Send them with: hindsight spool push %s --url %s"
            " (an agent started later with this spool directory sends them by itself)",
            self.name,
            len(self._spool),
            self._spool.events(),
            self.settings.url,
            where,
            self.settings.spool_dir,
            self.settings.url,
        )

    def _has_backlog(self) -> bool:
        return bool(self._outbox) or (self._spool is not None and len(self._spool) > 0)

    def _cut(self, force: bool, final: bool = False) -> None:
        """Turn buffered events into encoded batches: full ones, the rest too if forced.

        A forced cut with nothing buffered still sends an empty batch when drop counts
        changed, so drops are reported even when events stop; ``final`` always ends with
        one batch marked final.
        """
        limit = self.settings.flush_events
        while True:
            n = len(self._buffer)
            if n == 0:
                dropped = self._all_dropped()
                if final or (force and dropped != self._reported_dropped):
                    self._emit_batch([], dropped, final)
                return
            if n < limit and not force:
                return
            items = self._buffer.take(limit)
            events = []
            for item in items:
                try:
                    events.append(_event_of(item))
                except Exception:
                    self._dropped["invalid"] += 1
                    logger.debug("hindsight: cannot build event from %r", item, exc_info=True)
            if self._unsupported:
                events = self._without_unsupported(events)
            last = final and not len(self._buffer)
            self._emit_batch(events, self._all_dropped(), last)
            if last:
                return

    def _all_dropped(self) -> dict[str, int]:
        total: Counter[str] = Counter(self._dropped)
        total.update(self._buffer.dropped)
        if self._spool is not None:
            total.update(self._spool.dropped)
        return {k: v for k, v in total.items() if v}

    def _emit_batch(self, events: list[Any], dropped: dict[str, int], final: bool) -> None:
        seq = self._seq
        self._seq += 1
        body = self._encode(seq, events, dropped, final)
        self._reported_dropped = dropped
        self._enqueue(SpooledBatch(seq, body, len(events), self.settings.encoding))
        self.stats["batches"] += 1

    def _encode(self, seq: int, events: list[Any], dropped: dict[str, int], final: bool) -> bytes:
        batch = Batch(
            schema=SCHEMA_VERSION,
            cluster=self.settings.cluster,
            session=self.session,
            agent=self.name,
            seq=seq,
            events=events,
            sent_at=time.time(),
            final=final,
            dropped=dropped,
        )
        # A NUL in a key, a log message or a value (Dask takes them) would have the collector
        # refuse the whole batch: U+FFFD in its place.
        try:
            body = replace_nul(_encoder.encode(batch))
        except UnicodeEncodeError:
            # A lone surrogate (a file name Python decoded with surrogateescape, logged or
            # emitted) is no UTF-8: the batch's events were lost, its sequence number with
            # them. U+FFFD in its place, as for NUL.
            body = replace_nul(msgspec.json.encode(_scrub(msgspec.to_builtins(batch))))
        return compress(body, self.settings.encoding, self.settings.zstd_level)

    def _spool_or_memory(self) -> Spool:
        if self._spool is None:
            directory = None
            meta = agent_meta(self.settings, self.session, self.name)
            try:
                directory, self._spool_lock = create_owned(self.settings.spool_dir, self.name, meta)
            except OSError as exc:
                logger.warning(
                    "hindsight: spool directory %s unusable (%s); spooling in memory",
                    os.path.join(self.settings.spool_dir, self.name),
                    exc,
                )
            self._spool = Spool(directory, self.settings.spool_max_bytes)
        return self._spool

    def _enqueue(self, batch: SpooledBatch) -> None:
        spool = self._spool
        if (spool is None or not len(spool)) and len(self._outbox) < OUTBOX_BATCHES:
            self._outbox.append(batch)
            return
        # Keep every spooled seq older than every in-memory one: drain order is seq order.
        self._park_outbox()
        self._spool_or_memory().put(batch)

    def _park_outbox(self) -> None:
        if self._outbox:
            spool = self._spool_or_memory()
            while self._outbox:
                spool.put(self._outbox.popleft())
                self.stats["spooled"] += 1

    def _head(self) -> tuple[SpooledBatch, bool] | None:
        if self._spool is not None and len(self._spool):
            batch = self._spool.peek()
            if batch is not None:
                return batch, True
        if self._outbox:
            return self._outbox[0], False
        return None

    def _pop_head(self, batch: SpooledBatch, spooled: bool) -> None:
        if spooled:
            assert self._spool is not None
            self._spool.remove(batch.seq)
        else:
            self._outbox.popleft()

    def _deliver(self, deadline: float | None) -> None:
        """Send queued batches in order until done, backing off, or past ``deadline``."""
        if not self.settings.url:
            return
        while True:
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return
            if now < self._retry_at:
                if deadline is None:
                    return
                # Closing: sleep out the backoff if the budget allows, interruptibly.
                if self._retry_at >= deadline:
                    return
                time.sleep(self._retry_at - now)
                continue
            head = self._head()
            if head is None:
                return
            batch, spooled = head
            if self._transport is None:
                self._transport = Transport(
                    self.settings.url, self.settings.token, self.settings.request_timeout
                )
            if deadline is not None:
                # Closing: a collector that does not answer (a host that drops packets) must
                # not hold up the cluster's close; what it does not take waits in the spool.
                self._transport.limit_timeout(max(0.1, min(CLOSE_REQUEST_S, deadline - now)))
            started = time.monotonic()
            outcome = self._transport.post(batch.body, batch.encoding)
            self.stats["posts"] += 1
            if outcome.verdict == "ok":
                self._pop_head(batch, spooled)
                self._attempts = 0
                self._quick_failures = 0
                self.stats["sent_batches"] += 1
                self.stats["sent_events"] += batch.events
                continue
            if outcome.verdict == "retry":
                self._backoff(outcome)
                if not spooled:
                    # The collector is away: let the backlog wait on disk, not in memory.
                    self._park_outbox()
                if deadline is None:
                    return
                if outcome.status is None and time.monotonic() - started < CLOSE_QUICK_FAILURE_S:
                    self._quick_failures += 1
                    self._retry_at = time.monotonic() + 0.05 * min(self._quick_failures, 4)
                    if self._quick_failures <= CLOSE_QUICK_RETRIES:
                        continue
                if outcome.status is None or outcome.status in MISADDRESSED:
                    # Closing, and no collector answers at that URL: what is left waits in
                    # the spool now. Retrying would hold up the cluster's close (a nanny
                    # kills its worker 4 s into closing) for nothing.
                    return
                # Closing, and the collector answered but is busy (429, 503): keep
                # retrying after the backoff until the close budget is spent.
                continue
            if outcome.verdict == "too_large":
                self._pop_head(batch, spooled)
                self._split(batch, spooled)
                continue
            if outcome.status == 400 and self._resend_without_unknown_kind(
                batch, spooled, outcome.message
            ):
                continue
            self._pop_head(batch, spooled)
            reason = f"http_{outcome.status}"
            self._dropped[reason] += batch.events
            self.stats["rejected_batches"] += 1
            self._warn(
                reason,
                "hindsight: collector rejected batch %s/%s (HTTP %s: %s); %d events dropped",
                self.name,
                batch.seq,
                outcome.status,
                outcome.message,
                batch.events,
            )

    def _without_unsupported(self, events: list[Any]) -> list[Any]:
        kept = [e for e in events if kind_of(e) not in self._unsupported]
        if len(kept) < len(events):
            self._dropped["unsupported_kind"] += len(events) - len(kept)
        return kept

    def _resend_without_unknown_kind(
        self, batch: SpooledBatch, spooled: bool, message: str
    ) -> bool:
        """An older collector refused a kind added to the protocol later: send the batch
        again, same ``seq``, without events of that kind, and stop sending it."""
        match = UNKNOWN_KIND.search(message or "")
        if match is None or match.group(1) not in LATER_KINDS:
            return False
        kind = match.group(1)
        if kind in self._unsupported:
            return False  # already stripped: the 400 is about something else
        self._unsupported.add(kind)
        self._warn(
            f"unsupported_{kind}",
            "hindsight: the collector does not know %r events (it is older than this agent); "
            "they are no longer sent",
            kind,
        )
        try:
            decoded = decode_batch(decompress(batch.body, batch.encoding))
        except Exception:
            return False
        events = self._without_unsupported(decoded.events)
        dropped = {**decoded.dropped, **self._all_dropped()}
        again = SpooledBatch(
            batch.seq,
            self._encode(batch.seq, events, dropped, decoded.final),
            len(events),
            self.settings.encoding,
        )
        self._pop_head(batch, spooled)
        if spooled:
            assert self._spool is not None
            self._spool.put(again)
        else:
            self._outbox.appendleft(again)
        return True

    def _backoff(self, outcome: Outcome) -> None:
        self._attempts += 1
        self.stats["retries"] += 1
        delay = retry_delay(outcome, self._attempts)
        if self._closed and outcome.retry_after is None:
            delay = min(delay, CLOSING_BACKOFF_MAX)  # few seconds are left: try often
        self._retry_at = time.monotonic() + delay
        where = self._spool.directory if self._spool is not None else None
        self._warn(
            f"retry_{outcome.status}",
            "hindsight: collector unavailable (%s %s); retrying in %.1fs; batches meanwhile"
            " wait in %s",
            outcome.status or "no answer",
            outcome.message,
            delay,
            where or "memory (then the spool directory)",
        )

    def _split(self, batch: SpooledBatch, spooled: bool) -> None:
        """Re-send a batch the collector found too large as two halves."""
        try:
            decoded = decode_batch(decompress(batch.body, batch.encoding))
        except Exception:
            self._dropped["too_large"] += batch.events
            logger.warning("hindsight: cannot split batch %s/%s", self.name, batch.seq)
            return
        events = decoded.events
        if len(events) <= 1:
            self._dropped["too_large"] += len(events)
            self._warn("too_large", "hindsight: an event is too large for the collector; dropped")
            return
        half = len(events) // 2
        # The first half keeps the sequence number, the second takes the next free one,
        # so sequence numbers stay gapless; "final" moves to the later half.
        first = SpooledBatch(
            batch.seq,
            self._encode(batch.seq, events[:half], decoded.dropped, False),
            half,
            self.settings.encoding,
        )
        seq = self._seq
        self._seq += 1
        second = SpooledBatch(
            seq,
            self._encode(seq, events[half:], decoded.dropped, decoded.final),
            len(events) - half,
            self.settings.encoding,
        )
        self.stats["splits"] += 1
        if spooled:
            assert self._spool is not None
            self._spool.put(first)
            self._spool.put(second)
        else:
            self._outbox.appendleft(second)
            self._outbox.appendleft(first)

    def _warn(self, key: str, msg: str, *args: Any) -> None:
        now = time.monotonic()
        last = self._warned.get(key)
        if last is None or now - last >= WARN_EVERY:
            self._warned[key] = now
            logger.warning(msg, *args)
        else:
            logger.debug(msg, *args)


def _reinit_after_fork() -> None:
    for agent in list(_agents):
        try:
            agent._after_fork()
        except Exception:
            pass


def _close_all_at_exit() -> None:
    for agent in list(_agents):
        for hook in list(agent.before_exit):
            try:
                hook()
            except Exception:
                pass
        try:
            agent.close()
        except Exception:
            pass


_atexit_registered = False


def _ensure_atexit() -> None:
    global _atexit_registered
    if not _atexit_registered:
        _atexit_registered = True
        atexit.register(_close_all_at_exit)
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=_reinit_after_fork)


def _scrub(value: Any) -> Any:
    """``value`` (JSON-like) with every lone surrogate in its strings as U+FFFD."""
    if isinstance(value, str):
        return value.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    if isinstance(value, list):
        return [_scrub(v) for v in value]
    if isinstance(value, dict):
        return {_scrub(k): _scrub(v) for k, v in value.items()}
    return value
