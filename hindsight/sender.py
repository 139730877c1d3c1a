"""A small synchronous sender for protocol-v1 batches (tests, benchmarks, scripts).

The Dask agent has its own transport with batching, retries and a spool; this is
the minimal piece both use to talk HTTP to a collector: one keep-alive connection,
zstd or gzip encoding, and the response decoded as JSON.
"""

from __future__ import annotations

import gzip
import http.client
import json
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

import zstandard

from hindsight.schema import Batch, encode_batch

# Compress at the edge: level 9 makes Dask task batches ~20% smaller at rest than level 3
# (23.6 vs 30.2 bytes per task event, bench/ingest.py's workload) for ~30 ms of CPU per
# 5,000 events on the agent's background thread, where zstd runs without the GIL. The
# collector stores zstd bodies as received, so this is also the size at rest.
ZSTD_LEVEL = 9


@dataclass
class Response:
    status: int
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)


def compress(data: bytes, encoding: str, level: int = ZSTD_LEVEL) -> bytes:
    """Encode a request body for ``Content-Encoding: encoding``."""
    if encoding == "zstd":
        return zstandard.ZstdCompressor(level=level).compress(data)
    if encoding == "gzip":
        return gzip.compress(data, compresslevel=6)
    if encoding == "identity":
        return data
    raise ValueError(f"unknown encoding {encoding!r}")


ENDPOINT = "/v1/batches"


class Sender:
    """POST batches to ``{url}/v1/batches`` over one keep-alive HTTP connection (``url``
    may name the endpoint itself: the server's banner prints it)."""

    def __init__(
        self, url: str, token: str | None = None, encoding: str = "zstd", timeout: float = 30.0
    ) -> None:
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("http", "https"):
            raise ValueError(f"collector URL must be http(s)://, got {url!r}")
        self._scheme = parsed.scheme
        self._netloc = parsed.netloc
        path = parsed.path.rstrip("/")
        if path.endswith(ENDPOINT):  # the endpoint's URL given for the collector's
            path = path[: -len(ENDPOINT)]
        self._path = path + ENDPOINT
        self.token = token
        self.encoding = encoding
        self.timeout = timeout
        self._conn: http.client.HTTPConnection | None = None

    def _connection(self) -> http.client.HTTPConnection:
        if self._conn is None:
            cls = (
                http.client.HTTPSConnection
                if self._scheme == "https"
                else http.client.HTTPConnection
            )
            self._conn = cls(self._netloc, timeout=self.timeout)
        return self._conn

    def send(
        self, batch: Batch | bytes, *, encoding: str | None = None, compressed: bool = False
    ) -> Response:
        """Send one batch. ``batch`` may be a :class:`Batch`, JSON bytes, or (with
        ``compressed=True``) a body already encoded with ``encoding``."""
        encoding = encoding or self.encoding
        if isinstance(batch, Batch):
            batch = encode_batch(batch)
        body = batch if compressed else compress(batch, encoding)
        headers = {"Content-Type": "application/json", "Content-Encoding": encoding}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        return self.request("POST", self._path, body, headers)

    def request(
        self, method: str, path: str, body: bytes | None, headers: dict[str, str]
    ) -> Response:
        """One request on the kept-alive connection; reconnects once if it went stale."""
        for attempt in (0, 1):
            conn = self._connection()
            try:
                conn.request(method, path, body=body, headers=headers)
                resp = conn.getresponse()
                raw = resp.read()
            except (ConnectionError, http.client.HTTPException, OSError):
                self.close()
                if attempt:
                    raise
                continue
            try:
                parsed = json.loads(raw) if raw else {}
            except ValueError:
                parsed = {
                    "error": {"code": "not_json", "message": raw[:200].decode(errors="replace")}
                }
            return Response(resp.status, parsed, {k.lower(): v for k, v in resp.getheaders()})
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __enter__(self) -> Sender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
