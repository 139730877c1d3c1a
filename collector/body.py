"""Reading a request body: content type, encoding, and a cap that holds after decompression.

Decompression streams and stops one byte past the cap, so a small zstd or gzip bomb
costs at most ``cap`` bytes of memory before it is refused with 413.
"""

from __future__ import annotations

import io
import zlib

import zstandard
from flask import request
from werkzeug.exceptions import ClientDisconnected

from services.common.errors import ApiError

ENCODINGS = ("zstd", "gzip", "identity")
_CHUNK = 1 << 20


def too_large(cap: int) -> ApiError:
    return ApiError(413, "batch_too_large", f"batch exceeds {cap} bytes after decompression")


def normalise_encoding(header: str | None) -> str:
    value = (header or "identity").strip().lower()
    if value in ("", "identity"):
        return "identity"
    if value in ("gzip", "x-gzip"):
        return "gzip"
    if value == "zstd":
        return "zstd"
    raise ApiError(
        415,
        "unsupported_encoding",
        f"Content-Encoding {header!r} is not one of zstd, gzip, identity",
    )


def read_body(cap: int, timeout: float) -> tuple[bytes, bytes, str]:
    """The request's body as sent, decoded, and its encoding.

    Each read of the socket waits at most ``timeout`` seconds for the next bytes: a client
    gone quiet mid-body is answered 408 and its connection closed, rather than holding one
    of the process's threads until it hangs up. gunicorn hands the app its socket; the
    embedded server sets the same timeout on its connections. A body that ends before its
    Content-Length (the connection closed mid-body) is 408 too, and nothing of it is
    stored: gunicorn hands over what arrived, and a cut that happened to be valid JSON
    was stored as a batch."""
    encoding = normalise_encoding(request.headers.get("Content-Encoding"))
    sock = request.environ.get("gunicorn.socket")
    if sock is not None and timeout > 0:
        sock.settimeout(timeout)  # gthread sets its connections blocking again on reuse
    try:
        raw = request.get_data(cache=False)
    except (ClientDisconnected, TimeoutError) as exc:
        if isinstance(exc, TimeoutError) or isinstance(exc.__context__, TimeoutError):
            raise _incomplete(
                "body_timeout",
                f"no bytes of the request body for {timeout:g} s "
                "(is Content-Length larger than the body?)",
            ) from None
        raise _incomplete("body_incomplete", "the request body ended early") from None
    expected = request.content_length
    if expected is not None and len(raw) < expected:
        raise _incomplete(
            "body_incomplete",
            f"the request body ended after {len(raw)} of its {expected} bytes (Content-Length)",
        )
    return raw, decompress(raw, encoding, cap), encoding


def _incomplete(code: str, message: str) -> ApiError:
    """408: the client may send the request again; its connection is closed."""
    return ApiError(408, code, message, {"Connection": "close"})


def decompress(data: bytes, encoding: str, cap: int) -> bytes:
    """The decoded body; 413 past ``cap`` bytes, 400 if the compressed stream is corrupt.
    A body over the cap as sent is 413 too: a chunked one is read to ``cap + 1`` bytes
    (``MAX_CONTENT_LENGTH``), and cut there it would otherwise read as truncated (a 400)."""
    if len(data) > cap:
        raise too_large(cap)
    if encoding == "identity":
        return data
    if encoding == "zstd":
        return _unzstd(data, cap)
    return _gunzip(data, cap)


def _unzstd(data: bytes, cap: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(
            io.BytesIO(data), read_across_frames=True
        )
        while True:
            chunk = reader.read(min(_CHUNK, cap + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
            if size > cap:
                raise too_large(cap)
    except zstandard.ZstdError as exc:
        raise ApiError(400, "bad_encoding", f"body is not valid zstd: {exc}") from None
    if not size and data:
        raise ApiError(400, "bad_encoding", "body is not valid zstd")
    # one copy at the end (a growing bytearray copied on every resize and once more here)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _gunzip(data: bytes, cap: int) -> bytes:
    """Every member of a gzip stream (RFC 1952 allows several, as ``cat a.gz b.gz`` makes)."""
    out = bytearray()
    buf = data
    try:
        while True:
            d = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
            while buf:
                out += d.decompress(buf, cap + 1 - len(out))
                if len(out) > cap:
                    raise too_large(cap)
                buf = d.unconsumed_tail
                if d.eof:
                    break
            if not d.eof:
                raise ApiError(400, "bad_encoding", "gzip body is truncated")
            buf = d.unused_data
            if not buf:
                return bytes(out)
            if not buf.startswith(b"\x1f\x8b"):
                raise ApiError(400, "bad_encoding", "gzip body has trailing data")
    except zlib.error as exc:
        raise ApiError(400, "bad_encoding", f"body is not valid gzip: {exc}") from None
