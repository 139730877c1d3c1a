"""The bounded on-disk spool: batches wait here, in sequence order, while the collector is away.

One directory per agent instance holds one file per batch, named
``<seq:016d>-<events>.hsb``: the sequence number orders the drain, and the event count
lets a dropped or unreadable file be counted without reading it.  A file is
``MAGIC | crc32 | length | encoding | body`` and is written to a temporary name and
renamed, so a crash leaves either the whole file or none; a file that is truncated or
whose checksum does not match anyway is skipped and counted as ``spool_corrupt``.

If the directory cannot be used, the spool keeps the same bound in memory instead: the
agent logs and carries on rather than failing its host.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import zlib
from collections import Counter
from dataclasses import dataclass

logger = logging.getLogger(__name__)

MAGIC = b"HSB1"
_HEADER = struct.Struct(">4sIQ16s")  # magic, crc32(body), len(body), encoding
SUFFIX = ".hsb"


@dataclass
class SpooledBatch:
    """One batch body as it goes on the wire (already compressed with ``encoding``)."""

    seq: int
    body: bytes
    events: int
    encoding: str


def _file_name(seq: int, events: int) -> str:
    return f"{seq:016d}-{events}{SUFFIX}"


def _parse_name(name: str) -> tuple[int, int] | None:
    if not name.endswith(SUFFIX):
        return None
    try:
        seq, events = name[: -len(SUFFIX)].split("-")
        return int(seq), int(events)
    except ValueError:
        return None


def read_file(path: str) -> SpooledBatch | None:
    """One spool file, or ``None`` (logged) if it is unreadable, truncated or corrupted."""
    parsed = _parse_name(os.path.basename(path))
    if parsed is None:
        return None
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        logger.warning("hindsight: cannot read spool file %s: %s", path, exc)
        return None
    if len(data) < _HEADER.size:
        logger.warning("hindsight: skipping truncated spool file %s", path)
        return None
    magic, crc, length, encoding = _HEADER.unpack_from(data)
    body = data[_HEADER.size :]
    if magic != MAGIC or length != len(body) or zlib.crc32(body) != crc:
        logger.warning("hindsight: skipping corrupted spool file %s", path)
        return None
    return SpooledBatch(parsed[0], body, parsed[1], encoding.rstrip(b"\0").decode())


class Spool:
    """A FIFO of batch bodies bounded by ``max_bytes``, ordered by sequence number."""

    def __init__(self, directory: str | None, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.dropped: Counter[str] = Counter()
        #: Files skipped because they were truncated or failed their checksum.
        self.corrupt_files = 0
        self.directory: str | None = None
        self._index: dict[int, tuple[int, int]] = {}  # seq -> (events, size)
        self._memory: dict[int, SpooledBatch] = {}
        self.bytes = 0
        if directory is not None:
            try:
                os.makedirs(directory, exist_ok=True)
                self.directory = directory
                self._scan()
            except OSError as exc:
                logger.warning(
                    "hindsight: spool directory %s unusable (%s); spooling in memory",
                    directory,
                    exc,
                )
                self.directory = None

    def _scan(self) -> None:
        assert self.directory is not None
        for name in os.listdir(self.directory):
            parsed = _parse_name(name)
            if parsed is None:
                continue
            try:
                size = os.path.getsize(os.path.join(self.directory, name))
            except OSError:
                continue
            self._index[parsed[0]] = (parsed[1], size)
            self.bytes += size

    def __len__(self) -> int:
        return len(self._index)

    def events(self) -> int:
        """How many events the spooled batches hold."""
        return sum(events for events, _ in list(self._index.values()))

    def put(self, batch: SpooledBatch) -> None:
        """Store ``batch``; drops the oldest batches (counted ``spool_full``) to stay bounded."""
        size = _HEADER.size + len(batch.body)
        if size > self.max_bytes:
            self.dropped["spool_full"] += batch.events
            return
        while self._index and self.bytes + size > self.max_bytes:
            oldest = min(self._index)
            self.dropped["spool_full"] += self._index[oldest][0]
            self.remove(oldest)
        if self.directory is None:
            self._memory[batch.seq] = batch
        else:
            final = os.path.join(self.directory, _file_name(batch.seq, batch.events))
            tmp = final + ".tmp"
            header = _HEADER.pack(
                MAGIC, zlib.crc32(batch.body), len(batch.body), batch.encoding.encode()
            )
            try:
                with open(tmp, "wb") as f:
                    f.write(header)
                    f.write(batch.body)
                os.replace(tmp, final)
            except OSError as exc:
                logger.warning("hindsight: cannot write spool file %s: %s", final, exc)
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                self.dropped["spool_error"] += batch.events
                return
        if batch.seq in self._index:
            self.bytes -= self._index[batch.seq][1]
        self._index[batch.seq] = (batch.events, size)
        self.bytes += size

    def peek(self) -> SpooledBatch | None:
        """The oldest readable batch, or ``None``; unreadable files are removed and counted."""
        while self._index:
            seq = min(self._index)
            events = self._index[seq][0]
            if self.directory is None:
                return self._memory[seq]
            batch = self._read(seq, events)
            if batch is not None:
                return batch
            self.dropped["spool_corrupt"] += events
            self.corrupt_files += 1
            self.remove(seq)
        return None

    def _read(self, seq: int, events: int) -> SpooledBatch | None:
        assert self.directory is not None
        return read_file(os.path.join(self.directory, _file_name(seq, events)))

    def remove(self, seq: int) -> None:
        """Forget the batch ``seq`` (after delivery, or when dropping it)."""
        entry = self._index.pop(seq, None)
        if entry is None:
            return
        self.bytes -= entry[1]
        if self.directory is None:
            self._memory.pop(seq, None)
            return
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(self.directory, _file_name(seq, entry[0])))

    def remove_directory(self) -> None:
        """Delete the (empty) spool directory, e.g. on a clean close (with its lock and
        ``agent.json``: nothing is left for anyone to adopt)."""
        if self.directory is not None and not self._index:
            for name in os.listdir(self.directory):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(self.directory, name))
            with contextlib.suppress(OSError):
                os.rmdir(self.directory)
