"""A compacted run's table row counts come from the Parquet footer, the table unread."""

from __future__ import annotations

import io
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from storage.core.blobs import LocalBlobStore
from storage.runs.context import ReadOnce
from storage.runs.runfile import CompactRun, table_rows


def test_row_counts_read_no_table_on_a_local_store_or_through_another(tmp_path: Any) -> None:
    local = LocalBlobStore(tmp_path)
    for name, n in (("tasks", 12_345), ("graph", 7)):
        buf = io.BytesIO()
        pq.write_table(pa.table({"key": [f"k-{i}" for i in range(n)]}), buf, row_group_size=1000)
        local.put(f"run/{name}.parquet", buf.getvalue())
    for blobs in (local, ReadOnce(local)):  # the footer read in place; else the blob fetched
        data = CompactRun(blobs, "run", "tag")
        assert table_rows(data, "tasks") == 12_345 and table_rows(data, "graph") == 7
        assert "tasks" not in data.__dict__ and "graph" not in data.__dict__
        assert data.tasks.num_rows == table_rows(data, "tasks") == 12_345
