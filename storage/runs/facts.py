"""The run page's facts (critical path, progress, errors, outcome), stored when a run finishes
so no page view walks a large run's graph."""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session

from storage.analysis.outcome import facts_of, graph_groups
from storage.analysis.rundata import RunData
from storage.core import models as m
from storage.runs.context import FinishedRun
from storage.runs.runfile import compact_prefix


def page_facts(db: Session, blobs: Any, run: m.Run, data: RunData) -> dict[str, Any]:
    """What the run page derives from a run's tables: its critical path, progress and
    errors. A finished run's are stored next to its compacted copy (by the finisher below,
    when the run finishes) and read back, so no page view walks a large run's graph."""
    return _stored(db, blobs, run, data, "page-v2", facts_of)  # v2: with outcome


def grouped_graph(db: Session, blobs: Any, run: m.Run, data: RunData) -> dict[str, Any]:
    """The run's task graph by prefix (``outcome.graph_groups``), what the run page draws of
    a graph past its node budget; a finished run's stored when it finishes (or on its first
    view, for a run finished before), so a view reads no graph table."""
    return _stored(db, blobs, run, data, "graph-groups-v1", graph_groups)


def _stored(
    db: Session, blobs: Any, run: m.Run, data: RunData, name: str, build: Any
) -> dict[str, Any]:
    """``build(data)``, kept next to a finished run's compacted copy as ``name`` and read
    back from there (a running run's is built each time)."""
    import msgspec
    import zstandard

    key = f"{compact_prefix(db, run)}/{data.tag}/{name}.json.zst"
    if run.status != "running":
        try:
            return msgspec.json.decode(zstandard.ZstdDecompressor().decompress(blobs.get(key)))
        except FileNotFoundError:
            pass
    out = build(data)
    if run.status != "running":
        body = zstandard.ZstdCompressor(level=3).compress(msgspec.json.encode(out))
        blobs.put(key, body, if_absent=True)
    return out


def finish(fr: FinishedRun) -> None:
    """Finisher (``storage.jobs.finish``): the run page's facts and its grouped graph,
    stored when the run finishes."""
    page_facts(fr.db, fr.blobs, fr.run, fr.data())
    grouped_graph(fr.db, fr.blobs, fr.run, fr.data())
