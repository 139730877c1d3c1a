"""Keep-alive connections recycled, so that long-lived clients spread over the collector's
worker processes.

A Ray node's aggregator (or a Dask worker's agent) opens one connection and keeps it for
as long as it lives. gunicorn hands a connection to whichever worker process accepts it,
and keeps it there: with a few nodes, one process could end up with every connection while
the other idled (seen in bench/ray_ingest.py: six simulated nodes, all on one of two
workers, ~0.9 of a core busy on a two-core host where a split gave ~1.1). Closing a
connection after ``every`` responses makes the client connect again, and the process least
busy is the one that accepts first: load follows the free cores. This is nginx's
``keepalive_requests``, which gunicorn does not have.

The close rides on gunicorn's own response (it sends ``Connection: close`` and then closes);
under another server the middleware does nothing.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any


class RecycleConnections:
    """WSGI middleware: the ``every``-th response on a connection closes it (0: never)."""

    def __init__(self, app: Any, every: int) -> None:
        self.app = app
        self.every = every
        self._served: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def _last(self, environ: dict[str, Any]) -> bool:
        """Whether this request is the last of its connection."""
        sock = environ.get("gunicorn.socket")
        if sock is None or self.every <= 0:
            return False
        with self._lock:
            n = self._served.get(sock, 0) + 1
            if n >= self.every:
                self._served.pop(sock, None)
                return True
            self._served[sock] = n
        return False

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Any:
        if self._last(environ):
            # gunicorn passes its Response's bound start_response: close through it.
            close = getattr(getattr(start_response, "__self__", None), "force_close", None)
            if close is not None:
                close()
        return self.app(environ, start_response)
