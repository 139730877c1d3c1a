"""A run's replay samples (``state`` events) as ``run_states`` rows: inserted once per
(run, time), so any order of batches and any retry give the same rows (``storage.query.replay``
reads them)."""

from __future__ import annotations

import functools
from typing import Any

from sqlalchemy.orm import Session

from hindsight.schema import StateEvent
from storage.core import models as m
from storage.core.statements import dialect_functions


@functools.cache
def _insert(dialect: str) -> Any:
    insert = dialect_functions(dialect)[0]
    return insert(m.RunState.__table__).on_conflict_do_nothing(index_elements=["run_id", "time"])


def sample_row(run_id: int, ev: StateEvent) -> dict[str, Any]:
    """A ``state`` event as a ``run_states`` row (compact: a list of counts per name)."""
    return {
        "run_id": run_id,
        "time": ev.time,
        "prefixes": {
            p.prefix: [p.waiting, p.processing, p.memory, p.released, p.erred] for p in ev.prefixes
        },
        "workers": {
            w.worker: [w.managed, w.unmanaged, w.spilled, w.limit, w.processing] for w in ev.workers
        },
    }


def index_states(db: Session, run_ids: dict[str, int], events: list[StateEvent]) -> None:
    """Insert a batch's ``state`` events; ``run_ids`` maps run keys to run rows."""
    rows: dict[tuple[int, float], dict[str, Any]] = {}
    for ev in events:
        run_id = run_ids.get(ev.run)
        if run_id is not None:
            rows.setdefault((run_id, ev.time), sample_row(run_id, ev))
    if rows:
        db.execute(_insert(db.get_bind().dialect.name), [rows[k] for k in sorted(rows)])
