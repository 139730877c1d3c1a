"""A run's tables: what every analysis of one run reads."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RunData:
    """A run's tasks, graph and metrics as Arrow tables."""

    tasks: Any  # pyarrow.Table
    graph: Any
    metrics: Any
    tag: str
    source: str  # "compact" (read from the compacted copy), "raw" (decoded batches)
    #: What analyses derive from these tables once and read on every request (the tables
    #: are cached per run by their reader, and never change).
    derived: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def columns(self, name: str, columns: list[str]) -> Any:
        """Some columns of one of the tables (``tasks``, ``graph``, ``metrics``). A
        compacted run's reader overrides this to read just those columns from its copy,
        leaving the whole table unread: a finisher that needs a few columns of a large
        run's tasks then holds those, not every task's phases, tracebacks and attributes."""
        return getattr(self, name).select(columns)

    def parts(self, name: str, columns: list[str], rows: int = 65_536) -> Iterator[Any]:
        """Some columns of one of the tables, a slice of at most ``rows`` rows at a time, in
        order: a compacted run's reader reads its copy a row group at a time, so a finisher
        that folds a run's tasks part by part holds one part, whatever the run's size."""
        table = getattr(self, name).select(columns)
        if not table.num_rows:
            yield table
        for lo in range(0, table.num_rows, rows):
            yield table.slice(lo, rows)

    def take(self, name: str, rows: list[int], columns: list[str]) -> Any:
        """Rows ``rows`` (ascending positions) of some columns of one of the tables; a
        compacted run's reader reads only the row groups that hold them."""
        import pyarrow as pa

        return getattr(self, name).select(columns).take(pa.array(rows, type=pa.int64()))
