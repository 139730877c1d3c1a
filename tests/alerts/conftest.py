"""A real HTTP receiver on loopback for webhooks, answering as a test tells it to."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest


class Receiver:
    """Records every POST (headers and body) and answers the statuses in ``answers`` in
    turn, then 200."""

    def __init__(self) -> None:
        self.posts: list[dict[str, Any]] = []
        self.answers: list[int] = []
        self.arrived = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with receiver.arrived:
                    status = receiver.answers.pop(0) if receiver.answers else 200
                    receiver.posts.append(
                        {"headers": dict(self.headers), "raw": raw, "body": json.loads(raw)}
                    )
                    receiver.arrived.notify_all()
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def wait_for(self, n: int, timeout: float = 30.0) -> list[dict[str, Any]]:
        with self.arrived:
            if not self.arrived.wait_for(lambda: len(self.posts) >= n, timeout):
                raise AssertionError(f"{len(self.posts)} posts arrived, not {n}")
            return list(self.posts)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


@pytest.fixture
def apps(stack: dict[str, Any]) -> tuple[Any, Any]:
    """The collector and the query service in process; webhooks on loopback allowed (the
    receiver is one)."""
    from collector.app import create_app as collector_app
    from services.query.app import create_app as query_app

    config = {**stack, "alerts_allow_private": True}
    return collector_app(config).test_client(), query_app(config).test_client()
