"""Index a batch's ``activity`` and ``code`` events (Dask's fine performance metrics and
the submitting code of a run), and hand its ``state`` events to ``storage.query.replay``.

Both commute, like the rest of the index: an activity value is cumulative, so of two
samples of one (run, context, prefix, activity, unit) the later one wins (ties: the larger
value), whichever arrives first; a code submission is stored once under the digest of its
frames. Only scheduler batches carry these events, one per run per sample interval at
most, so this costs ingest nothing for task batches and one or two statements otherwise.
"""

from __future__ import annotations

import functools
import hashlib
from types import SimpleNamespace
from typing import Any

import msgspec
from sqlalchemy import case, func
from sqlalchemy.orm import Session

from hindsight.schema import ActivityEvent, CodeEvent, StateEvent
from storage.core import models as m
from storage.ingest.states import index_states

_encoder = msgspec.json.Encoder()
_ACTIVITY_KEY = ("run_id", "context", "prefix", "activity", "unit")


@functools.cache
def _statements(dialect: str) -> SimpleNamespace:
    if dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert

        greatest, least = func.greatest, func.least
    else:
        from sqlalchemy.dialects.sqlite import insert

        greatest, least = func.max, func.min
    A, C = m.RunActivity.__table__, m.RunCode.__table__
    ins = insert(A)
    ex = ins.excluded
    newer = (ex.time > A.c.time) | ((ex.time == A.c.time) & (ex.value > A.c.value))
    st = SimpleNamespace()
    st.activity = ins.on_conflict_do_update(
        index_elements=["run_id", "context", "prefix", "activity", "unit"],
        set_={
            "value": case((newer, ex.value), else_=A.c.value),
            "time": greatest(A.c.time, ex.time),
        },
    )
    ins = insert(C)
    st.code = ins.on_conflict_do_update(
        index_elements=["run_id", "digest"], set_={"time": least(C.c.time, ins.excluded.time)}
    )
    return st


def index_perf(db: Session, run_ids: dict[str, int], events: list[Any]) -> None:
    """Apply a batch's activity, code and state events; ``run_ids`` maps run keys to run rows."""
    st = _statements(db.get_bind().dialect.name)
    states = [ev for ev in events if type(ev) is StateEvent]
    if states:
        index_states(db, run_ids, states)
    # One row per key per statement: Postgres refuses to upsert a row twice in one INSERT.
    latest: dict[tuple[int, str, str, str, str], tuple[float, float]] = {}
    code: dict[tuple[int, str], dict[str, Any]] = {}
    for ev in events:
        run_id = run_ids.get(ev.run)
        if run_id is None:
            continue
        if type(ev) is ActivityEvent:
            t = ev.time
            for x in ev.metrics:
                key = (run_id, x.context, x.prefix, x.activity, x.unit)
                seen = latest.get(key)
                if seen is None or (t, x.value) > seen:
                    latest[key] = (t, x.value)
        elif type(ev) is CodeEvent:
            frames = msgspec.to_builtins(ev.frames)
            digest = hashlib.sha256(_encoder.encode(frames)).hexdigest()
            prior = code.get((run_id, digest))
            if prior is None or ev.time < prior["time"]:
                code[(run_id, digest)] = {
                    "run_id": run_id,
                    "digest": digest,
                    "time": ev.time,
                    "frames": frames,
                }
    if latest:
        db.execute(
            st.activity,
            [
                dict(zip(_ACTIVITY_KEY, k, strict=True), value=v, time=t)
                for k, (t, v) in sorted(latest.items())
            ],
        )
    if code:
        db.execute(st.code, [code[k] for k in sorted(code)])
