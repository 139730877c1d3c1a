"""Event kinds on the agent's side: naming an event's kind, and reading which kind a
collector refused (an older collector answers 400 to kinds newer than it)."""

from __future__ import annotations

import re
from typing import Any

#: How the collector's 400 names a kind it does not know (msgspec's tag validation error).
UNKNOWN_KIND = re.compile(r"Invalid value '([^']+)' - at `\$\.events\[\d+\]\.kind`")


def kind_of(event: Any) -> Any:
    """The ``kind`` tag of a protocol event."""
    return type(event).__struct_config__.tag


def decompress(body: bytes, encoding: str) -> bytes:
    """A batch body as sent (``zstd``, ``gzip`` or identity), decompressed."""
    if encoding == "zstd":
        import zstandard

        return zstandard.ZstdDecompressor().decompressobj().decompress(body)
    if encoding == "gzip":
        import gzip

        return gzip.decompress(body)
    return body
