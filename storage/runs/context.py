"""What a finisher is handed: the finished run, and the blob store as its finishers see it.

Every finisher of ``storage/runs`` imports this module; it imports none of them."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.orm import Session

from hindsight.schema import Batch
from storage.analysis.rundata import RunData
from storage.core import models as m
from storage.core.batches import decode_stored
from storage.core.blobs import BlobStore, put_file


class ReadOnce:
    """The blob store as one run's finishers see it: each object is fetched once. The
    compacted copy, the profile and the run's logs are each built from the run's batches;
    without this every finisher fetched them all again. Holds at most ``limit`` bytes (as
    stored, compressed: ~120 KB a 5,000-task batch); past that, reads go to the store
    (a 10^7-task run's batches are ~240 MB: held, they were an eighth of the finish's
    memory budget)."""

    def __init__(self, blobs: BlobStore, limit: int = 64 << 20) -> None:
        self.blobs = blobs
        self.url = blobs.url
        self.limit = limit
        self._held: dict[str, bytes] = {}
        self._size = 0

    def get(self, key: str) -> bytes:
        data = self._held.get(key)
        if data is None:
            data = self.blobs.get(key)
            if self._size + len(data) <= self.limit:
                self._held[key] = data
                self._size += len(data)
        return data

    def _forget(self, key: str) -> None:
        data = self._held.pop(key, None)
        if data is not None:
            self._size -= len(data)

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> bool:
        self._forget(key)
        return self.blobs.put(key, data, if_absent=if_absent)

    def put_file(self, key: str, source: str, *, if_absent: bool = False) -> bool:
        self._forget(key)
        return put_file(self.blobs, key, source, if_absent=if_absent)

    def delete(self, key: str) -> None:
        self._forget(key)
        self.blobs.delete(key)

    def exists(self, key: str) -> bool:
        return self.blobs.exists(key)

    def list(self, prefix: str = "") -> Iterator[str]:
        return self.blobs.list(prefix)

    def listed(self, prefix: str = "") -> Iterator[tuple[str, float]]:
        return self.blobs.listed(prefix)

    def ping(self) -> None:
        self.blobs.ping()


@dataclass
class FinishedRun:
    """A finished run, handed to each finisher. The caller owns the transaction.

    ``load`` reads or builds the run's tables and ``batch_keys`` lists the blob keys of
    the batches around it: the caller passes them (``storage.jobs.finish`` passes
    ``runfile``'s), so this module, which every finisher imports, imports none of them."""

    db: Session
    blobs: BlobStore
    run: m.Run
    tenant: str
    cluster: str
    session: str
    load: Callable[..., RunData] = field(repr=False)
    batch_keys: Callable[[Session, m.Run], Iterable[tuple[int, str, bool]]] = field(repr=False)
    _data: RunData | None = field(default=None, repr=False)

    def data(self) -> RunData:
        """The run's Arrow tables (tasks, graph, metrics), written as the run's compacted
        copy if it had none; each table read from the copy when first used, and
        ``RunData.columns`` reads a few columns of one without the rest."""
        if self._data is None:
            self._data = self.load(self.db, self.blobs, self.run, cache=False, lazy=True)
        return self._data

    def release(self) -> None:
        """Let go of the tables read so far (``storage.jobs.finish`` calls this after each
        finisher): a 10^6-task run's tasks table is ~600 MB, and every later finisher held
        it though each reads what it needs again, a column at a time where it can. Arrow's
        allocator keeps freed pages for reuse: handed back here, so the service's memory
        falls back between finishers instead of staying at the largest one's peak."""
        import pyarrow as pa

        self._data = None
        pa.default_memory_pool().release_unused()
        trim_heap()

    def batches(self) -> Iterator[Batch]:
        """The decoded raw batches around the run: its own, and the session's batches
        received near it (metrics and worker-side events carry no run)."""
        for _, key, _mine in self.batch_keys(self.db, self.run):
            yield decode_stored(self.blobs.get(key))


def trim_heap() -> None:
    """Hand the C heap's free pages back to the system (glibc's ``malloc_trim``). Finishers
    run on a worker thread, whose malloc arena glibc does not shrink by itself: the Python
    objects one finisher freed kept the service's resident memory at its peak through the
    next (~600 MB of a 10^6-task run's compaction). A no-op where there is no glibc."""
    global _malloc_trim
    if _malloc_trim is None:
        import ctypes
        import ctypes.util

        try:
            _malloc_trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim: Any = None
