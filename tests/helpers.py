"""Test helpers: the example batch, request builders, and a TCP proxy for fault tests."""

from __future__ import annotations

import copy
import gzip
import json
import socket
import threading
from pathlib import Path
from typing import Any

import zstandard

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "docs" / "examples" / "batch.json"


def example_bytes() -> bytes:
    return EXAMPLE.read_bytes()


def example(**changes: Any) -> dict[str, Any]:
    batch = json.loads(example_bytes())
    batch.update(copy.deepcopy(changes))
    return batch


def encode(body: bytes | dict[str, Any], encoding: str = "zstd") -> bytes:
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    if encoding == "zstd":
        return zstandard.ZstdCompressor().compress(body)
    if encoding == "gzip":
        return gzip.compress(body)
    return body


def post(client: Any, body: bytes | dict[str, Any], *, token: str | None = None, encoding: str = "zstd",
         content_type: str = "application/json", raw: bool = False) -> Any:  # fmt: skip
    headers = {"Content-Type": content_type, "Content-Encoding": encoding}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    data = body if raw else encode(body, encoding)
    return client.post("/v1/batches", data=data, headers=headers)


def auth(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


class TcpProxy:
    """A loopback TCP forwarder that can be cut and restored: the index or blob store
    'goes away' for the service while the real server keeps running."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._up = threading.Event()
        self._up.set()
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True, name="tcp-proxy").start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if not self._up.is_set():
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def cut(self) -> None:
        """Refuse new connections and break the open ones."""
        self._up.clear()
        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def restore(self) -> None:
        self._up.set()

    def close(self) -> None:
        self.cut()
        self._listener.close()


def short_body_answer(
    url: str, route: str, headers: dict[str, str], body: bytes = b'{"events":', *,
    length: int = 1000, close: bool = False,
) -> tuple[int, dict[str, Any], bytes]:  # fmt: skip
    """POST ``body`` saying it is ``length`` bytes long, over a raw socket (``close``: then
    shut the sending side, as a connection cut mid-body does), and read the answer:
    (status, JSON body, the rest the server sent before closing)."""
    host, port = url.removeprefix("http://").split(":")
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(
            f"POST {route} HTTP/1.1\r\nHost: {host}\r\nContent-Length: {length}\r\n{head}\r\n".encode()
            + body
        )
        if close:
            sock.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := sock.recv(65536):  # the server answers, then closes
            data += chunk
    head_bytes, _, rest = data.partition(b"\r\n\r\n")
    status = int(head_bytes.split(b" ", 2)[1])
    length = int(next(line.split(b":")[1] for line in head_bytes.split(b"\r\n")
                      if line.lower().startswith(b"content-length:")))  # fmt: skip
    return status, json.loads(rest[:length]), rest[length:]
