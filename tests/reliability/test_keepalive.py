"""A long-lived client's connection is closed after a number of responses, so that it
connects again and lands on whichever gunicorn worker accepts first (collector/keepalive.py)."""

from __future__ import annotations

import http.client

import pytest

from bench.lib_faults import Gunicorn, collector_env
from tests.conftest import make_bucket


def _served(port: int, n: int) -> list[tuple[str | None, int]]:
    """``n`` requests over one keep-alive client: each response's Connection header and the
    client's local port for it (a new port: a new connection)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    out = []
    try:
        for _ in range(n):
            conn.request("GET", "/readyz")
            local = conn.sock.getsockname()[1]
            resp = conn.getresponse()
            resp.read()
            assert resp.status == 200
            out.append((resp.getheader("Connection"), local))
    finally:
        conn.close()
    return out


@pytest.mark.postgres
@pytest.mark.parametrize("every", [3, 0])
def test_a_keep_alive_connection_is_closed_after_so_many_responses(pg_url, moto_endpoint, every):
    env = collector_env(pg_url, f"s3://{make_bucket(moto_endpoint)}/h", moto_endpoint,
                        HINDSIGHT_KEEPALIVE_REQUESTS=str(every))  # fmt: skip
    server = Gunicorn(env, workers=1, threads=2)
    try:
        got = _served(server.port, 7)
    finally:
        server.stop()
    headers = [h.lower() if h else h for h, _ in got]
    ports = [p for _, p in got]
    if every:
        assert headers == ["keep-alive", "keep-alive", "close"] * 2 + ["keep-alive"]
        assert ports[0] == ports[1] == ports[2] != ports[3] == ports[4] == ports[5] != ports[6]
    else:  # 0: never closed
        assert headers == ["keep-alive"] * 7
        assert len(set(ports)) == 1
