"""A run's tables: what every analysis of one run reads."""

from __future__ import annotations

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
