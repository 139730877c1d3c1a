"""The bounded in-memory event buffer between the instrumented host and the agent thread."""

from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

#: A buffered item: either a ready protocol event, or a "deferred" event, a tuple
#: ``(make, *args)`` that the agent thread turns into an event with ``make(*args)``.
#: Deferring keeps struct building and string conversion off the producer's thread
#: (the Dask scheduler's event loop).
Item = Any


class EventBuffer:
    """A bounded FIFO that producers append to without blocking and the agent drains.

    ``deque.append`` and ``deque.popleft`` are atomic, so the hot path takes no lock: a
    producer pays a length check and an append.  Past ``capacity`` items are dropped
    and counted under ``"buffer_full"``; the count travels in the next batch.
    """

    def __init__(
        self, capacity: int, flush_events: int, on_threshold: Callable[[], None] | None = None
    ) -> None:
        self._items: deque[Item] = deque()
        self._capacity = capacity
        self._flush_events = flush_events
        self._on_threshold = on_threshold
        self._drop_lock = threading.Lock()
        self.dropped: Counter[str] = Counter()

    def add(self, item: Item) -> None:
        """Append ``item``; never blocks (beyond a lock on the drop path) and never raises."""
        items = self._items
        n = len(items)
        if n >= self._capacity:
            self.drop("buffer_full")
            return
        items.append(item)
        if n + 1 == self._flush_events and self._on_threshold is not None:
            self._on_threshold()

    def drop(self, reason: str, count: int = 1) -> None:
        """Count ``count`` events lost for ``reason``."""
        with self._drop_lock:
            self.dropped[reason] += count

    def take(self, limit: int) -> list[Item]:
        """Remove and return up to ``limit`` of the oldest items."""
        out: list[Item] = []
        popleft = self._items.popleft
        try:
            for _ in range(limit):
                out.append(popleft())
        except IndexError:
            pass
        return out

    def clear(self) -> int:
        """Forget everything buffered; returns how many items were discarded."""
        n = len(self._items)
        self._items.clear()
        return n

    def __len__(self) -> int:
        return len(self._items)
