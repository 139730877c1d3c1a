"""Reading a request body: content type, encoding, and a cap that holds after decompression.

Decompression streams and stops one byte past the cap, so a small zstd or gzip bomb
costs at most ``cap`` bytes of memory before it is refused with 413.
"""

from __future__ import annotations

import io
import zlib

import zstandard

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
