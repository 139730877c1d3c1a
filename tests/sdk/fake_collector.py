"""A scriptable collector stand-in: a real HTTP server in a thread.

The real collector is tested elsewhere; the agent's transport tests need a server that
answers exactly 202/400/413/429/500/503 when told to, and can go down and come back on
the same port.
"""

from __future__ import annotations

import gzip
import json
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import zstandard

from hindsight.schema import Batch, decode_batch

#: A scripted status that answers nothing: the connection is dropped mid-request, as when
#: the collector process serving it is killed.
DROP = 0


class FakeCollector:
    """Records accepted batches; answers from ``script`` (then 202), or ``rule(batch)``.
    An answer is ``(status, headers)`` or ``(status, headers, error message)``, or ``(DROP, {})``."""

    def __init__(self) -> None:
        self.accepted: list[Batch] = []
        self.requests: list[tuple[int, Batch | None]] = []
        self.script: deque[tuple[int, dict[str, str]]] = deque()
        self.rule: Callable[[Batch], tuple[Any, ...] | None] | None = None
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self.port = 0
        self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        collector = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                encoding = self.headers.get("Content-Encoding", "identity")
                if encoding == "zstd":
                    body = zstandard.ZstdDecompressor().decompressobj().decompress(body)
                elif encoding == "gzip":
                    body = gzip.decompress(body)
                batch = decode_batch(body)
                if self.path != "/v1/batches":  # as the collector: no such route
                    status, headers, message = 404, {}, "The requested URL was not found"
                    with collector._lock:
                        collector.requests.append((status, batch))
                else:
                    status, headers, message = collector._answer(batch)
                if status == DROP:
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                payload = b'{"batch_id": "x", "accepted": true, "duplicate": false}'
                if status != 202:
                    payload = json.dumps(
                        {"error": {"code": "scripted", "message": message}}
                    ).encode()
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        server.daemon_threads = True
        self.port = server.server_address[1]
        self._server = server
        threading.Thread(target=server.serve_forever, name="fake-collector", daemon=True).start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def _answer(self, batch: Batch) -> tuple[int, dict[str, str], str]:
        with self._lock:
            answer = None
            if self.script:
                answer = self.script.popleft()
            elif self.rule is not None:
                answer = self.rule(batch)
            status, headers, *message = answer or (202, {})
            self.requests.append((status, batch))
            if status == 202:
                self.accepted.append(batch)
            return status, headers, message[0] if message else "scripted answer"

    def events(self) -> list[Any]:
        with self._lock:
            return [e for b in sorted(self.accepted, key=lambda b: b.seq) for e in b.events]

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 10.0) -> None:
        """Poll ``predicate`` until true or fail after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError("condition not reached in time")
            time.sleep(0.02)
