"""Sorting a big run's lake rows through temporary files (``storage.lake.write`` writes
them): a 10^7-task run's rows do not fit the finish's memory as one table."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any


class SortedRows:
    """A big run's rows of one table, sorted by ``sort_keys`` (ascending) without being
    held: ``parts(columns)`` reads the rows' columns a part at a time, in a fixed order
    (a compacted copy's row groups). The sort keys alone are read and ordered first; then
    each part's rows go to temporary files by where they fall in that order (a bucket of
    ``bucket_rows`` sorted positions a file), and each bucket is read back and ordered
    in turn. Working memory is a part, a bucket and a few numbers a row (a 10^7-task run's
    tasks are gigabytes as Arrow tables)."""

    def __init__(
        self,
        sort_keys: list[tuple[str, str]],
        parts: Callable[[list[str] | None], Iterable[Any]],
        bucket_rows: int = 131_072,
    ) -> None:
        self.sort_keys = sort_keys
        self._parts = parts
        self.bucket_rows = bucket_rows
        self._dir: Any = None
        self.num_rows = 0
        self.schema: Any = None

    def __len__(self) -> int:
        return self.num_rows

    def _order(self) -> Any:
        """Each row's position in the sorted order (ties keep the rows' order, nulls last,
        as ``sort_by`` has them)."""
        import numpy as np
        import pyarrow as pa
        import pyarrow.compute as pc

        cols = [c for c, _ in self.sort_keys]
        keys: dict[str, list[Any]] = {c: [] for c in cols}
        values: dict[str, dict[Any, int]] = {c: {} for c in cols}
        for t in self._parts(cols):
            for c in cols:
                col = t[c]
                if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
                    enc = pc.dictionary_encode(col).combine_chunks()
                    seen = values[c]
                    local = np.fromiter(
                        (seen.setdefault(v, len(seen)) for v in enc.dictionary.to_pylist()),
                        "i8",
                        len(enc.dictionary),
                    )
                    idx = np.asarray(pc.fill_null(enc.indices, -1), dtype="i8")
                    coded = local[np.maximum(idx, 0)] if len(local) else np.zeros(len(idx), "i8")
                    keys[c].append(np.where(idx >= 0, coded, -1))
                else:
                    as_float = pc.fill_null(pc.cast(col, pa.float64()), np.nan)
                    keys[c].append(np.asarray(as_float, "f8"))
        arrays = []
        for c in cols:
            a = np.concatenate(keys.pop(c))
            if values[c]:  # codes to ranks of the values sorted, a null after every value
                ordered = sorted(values[c])
                rank = np.empty(len(ordered) + 1, "i8")
                rank[[values[c][v] for v in ordered]] = np.arange(len(ordered))
                rank[-1] = len(ordered)
                a = rank[a]  # -1 (null) indexes the last
            elif a.dtype != np.float64:
                a = np.zeros(len(a), "i8")  # only nulls
            arrays.append(a)
        order = np.lexsort(arrays[::-1]) if arrays and len(arrays[0]) else np.zeros(0, "i8")
        pos = np.empty(len(order), "i8")
        pos[order] = np.arange(len(order))
        return pos

    def spill(self) -> SortedRows:
        """Read the rows once and write them to their buckets' temporary files."""
        import tempfile

        import numpy as np
        import pyarrow as pa

        pos = self._order()
        self.num_rows = len(pos)
        self._dir = tempfile.TemporaryDirectory(prefix="hindsight-lake-sort-")
        bucket = (pos // self.bucket_rows).astype("i4")
        writers: dict[int, Any] = {}
        options = pa.ipc.IpcWriteOptions(compression="lz4")
        at = 0
        try:
            for t in self._parts(None):
                if self.schema is None:
                    self.schema = t.schema
                n = len(t)
                t = t.append_column("__pos", pa.array(pos[at : at + n]))
                b = bucket[at : at + n]
                at += n
                by = np.argsort(b, kind="stable")
                cuts = np.flatnonzero(np.diff(b[by])) + 1
                for rows in np.split(by, cuts) if n else []:
                    u = int(b[rows[0]])
                    if u not in writers:
                        path = f"{self._dir.name}/{u}.arrow"
                        writers[u] = pa.ipc.new_file(path, t.schema, options=options)
                    writers[u].write_table(t.take(pa.array(rows)))
                del t
        finally:
            for w in writers.values():
                w.close()
        self._buckets = sorted(writers)
        return self

    def groups(self) -> Iterable[Any]:
        """The rows in sorted order, ``bucket_rows`` at a time (each bucket's file read
        back, ordered and removed)."""
        import os

        import numpy as np
        import pyarrow as pa

        for u in self._buckets:
            path = f"{self._dir.name}/{u}.arrow"
            with pa.memory_map(path) as src:
                t = pa.ipc.open_file(src).read_all()
            order = np.argsort(np.asarray(t["__pos"]), kind="stable")
            yield t.drop_columns(["__pos"]).take(pa.array(order))
            del t
            os.unlink(path)

    def close(self) -> None:
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None
