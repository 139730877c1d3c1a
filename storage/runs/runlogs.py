"""What the agents send besides tasks, read back per run: log records, the values tasks
emitted (``hindsight.emit``) and the workers' comings and goings (docs/decisions/0017).

None of it is indexed at ingest (a run may log 100,000 records; ingest must not pay per
record). When a run has finished, the finisher :func:`finish` reads the batches around the
run once, decoding only those whose JSON names a ``log`` or ``custom`` event or a worker
``joined``/``left`` at all, and writes three small Parquet tables next to the run's
compacted copy, under ``compact/.../{run id}/extras/{n}-{max}/``: ``{n}-{max}`` is the
count and highest id of the batches read, so a late batch (or a rebuilt index) makes the
next read build them again. A running run is read from its batches and kept in this
process's cache until a batch arrives. Every answer is bounded: pages of at most
``MAX_LIMIT`` records, filters and aggregates run on the Arrow tables.

Which records are a run's: log records a task of the run wrote (``run`` set), and records
with no task (the scheduler's, a worker's own) stamped inside the run's time window, so
two runs at once in one session both show those; emitted values of the run's tasks
(outside a task: the session's ``default`` run); the worker events of the session's
batches around the run. The list of workers comes from the index (``workers``), the
details of a departure (why, what it took down) from those events.
"""

from __future__ import annotations

import io
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from hindsight.schema import CustomEvent, LogEvent, WorkerEvent, decode_batch
from storage import dask
from storage.core import models as m
from storage.core.batches import DEFAULT_RUN, stored_json
from storage.core.blobs import BlobStore
from storage.runs.context import FinishedRun
from storage.runs.runfile import RecentCache, _parquet, batch_keys, compact_prefix, prune_tags

logger = logging.getLogger(__name__)

MAX_LIMIT = 1000
#: Records with no task belong to a run if stamped within its window, give or take this
#: (worker times are already on the scheduler's clock; a wider margin would hand a run
#: the records of the next one started right after it).
WINDOW_SLACK_S = 0.01
#: How long after a run's end a departure that killed one of its tasks may come (Dask's
#: default worker-ttl: a hung worker is removed after 5 minutes).
KILLED_AFTER_S = 300.0
_CACHE_SIZE = 8
# A batch is decoded only if its JSON holds one of these (a cheap test on the raw bytes;
# a false positive costs one decode, nothing else).
_MARKERS = (b'"log"', b'"custom"', b'"left"', b'"joined"')
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
ALIASES = {"WARN": "WARNING", "FATAL": "CRITICAL"}  # Python's own


@dataclass
class Extras:
    """A run's logs, emitted values and worker events as Arrow tables; a stored table is
    read from the blob store when first used (a page of logs reads only ``logs``)."""

    tag: str
    tables: dict[str, Any]
    read: Callable[[str], Any] | None = None

    def _table(self, name: str) -> Any:
        table = self.tables.get(name)
        if table is None:
            assert self.read is not None
            table = self.tables[name] = self.read(name)
        return table

    @property
    def logs(self) -> Any:
        return self._table("logs")

    @property
    def streams(self) -> Any:
        return self._table("streams")

    @property
    def workers(self) -> Any:
        return self._table("workers")


def _schemas() -> dict[str, Any]:
    import pyarrow as pa

    s, f, ls = pa.string(), pa.float64(), pa.list_(pa.string())
    return {
        "logs": pa.schema(
            [("time", f), ("level", s), ("worker", s), ("logger", s), ("message", s), ("key", s)]
        ),
        "streams": pa.schema(
            [("stream", s), ("time", f), ("worker", s), ("key", s), ("value", s), ("number", f)]
        ),
        "workers": pa.schema(
            [
                ("event", s),
                ("address", s),
                ("time", f),
                ("name", s),
                ("reason", s),
                ("expected", pa.bool_()),
                ("status", s),
                ("processing", ls),
                ("erred", ls),
                ("lost", ls),
                ("counts", s),
            ]
        ),
    }


def window(run: m.Run) -> tuple[float | None, float | None]:
    """The run's time window: earliest evidence to latest (None: open)."""
    starts = [t for t in (run.started_at, run.task_start) if t is not None]
    ends = [t for t in (run.finished_at, run.task_stop) if t is not None]
    lo = min(starts) if starts else None
    hi = max(ends) if ends and run.status != "running" else None
    return lo, hi


def _build(db: Session, blobs: BlobStore, run: m.Run, keys: list[str]) -> dict[str, Any]:
    import pyarrow as pa

    lo, hi = window(run)
    lo = None if lo is None else lo - WINDOW_SLACK_S
    hi = None if hi is None else hi + WINDOW_SLACK_S
    run_key = run.run_key
    enc = msgspec.json.Encoder()
    logs: list[tuple[Any, ...]] = []
    values: list[tuple[Any, ...]] = []
    workers: list[tuple[Any, ...]] = []
    for key in keys:
        raw = stored_json(blobs.get(key))
        if not any(marker in raw for marker in _MARKERS):
            continue
        for ev in decode_batch(raw).events:
            t = type(ev)
            if t is LogEvent:
                if ev.run is not None:
                    if ev.run != run_key:
                        continue
                elif (lo is not None and ev.time < lo) or (hi is not None and ev.time > hi):
                    continue
                logs.append((ev.time, ev.level, ev.worker, ev.logger, ev.message, ev.key))
            elif t is CustomEvent:
                if (ev.run or DEFAULT_RUN) != run_key:
                    continue
                v = ev.value
                number = (
                    float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None
                )
                values.append(
                    (ev.stream, ev.time, ev.worker, ev.key, enc.encode(v).decode(), number)
                )
            elif t is WorkerEvent:
                workers.append(
                    (
                        ev.event,
                        ev.address,
                        ev.time,
                        ev.name,
                        ev.reason,
                        ev.expected,
                        ev.status,
                        list(ev.processing),
                        list(ev.erred),
                        list(ev.lost),
                        enc.encode(ev.counts).decode() if ev.counts else None,
                    )
                )
    sch = _schemas()
    logs.sort(key=lambda r: (r[0], r[2] or "", r[4]))
    values.sort(key=lambda r: (r[0], r[1]))
    workers.sort(key=lambda r: (r[2], r[1], r[0]))
    out = {}
    for name, rows in (("logs", logs), ("streams", values), ("workers", workers)):
        schema = sch[name]
        cols = list(zip(*rows, strict=True)) if rows else [[] for _ in schema.names]
        out[name] = pa.table(
            {n: list(c) for n, c in zip(schema.names, cols, strict=True)}, schema=schema
        )
    return out


_cache = RecentCache(_CACHE_SIZE)


def load(db: Session, blobs: BlobStore, run: m.Run, *, write: bool = True) -> Extras:
    """The run's logs, emitted values and worker events: from this process's cache, the
    stored tables, or the batches (then stored, if the run has ended and ``write``)."""
    import pyarrow.parquet as pq

    found = batch_keys(db, run)
    tag = f"{len(found)}-{max((i for i, _, _ in found), default=0)}"
    extras_base = f"{compact_prefix(db, run)}/extras"
    base = f"{extras_base}/{tag}"
    hit = _cache.get(base)
    if hit is not None:
        return hit
    if blobs.exists(f"{base}/logs.parquet"):  # written last: the set is complete

        def read(name: str) -> Any:
            return pq.read_table(io.BytesIO(blobs.get(f"{base}/{name}.parquet")))

        extras = Extras(tag, {}, read)
    else:
        tables = _build(db, blobs, run, [k for _, k, _ in found])
        if write and run.status != "running":
            for n in ("streams", "workers", "logs"):
                blobs.put(f"{base}/{n}.parquet", _parquet(tables[n]), if_absent=True)
            prune_tags(blobs, extras_base, tag)
        extras = Extras(tag, tables)
    _cache.put(base, extras)
    return extras


def finish(fr: FinishedRun) -> None:
    """Finisher (``storage/jobs/finish.py``): store the run's tables once it has finished."""
    load(fr.db, fr.blobs, fr.run)


def clear_cache() -> None:
    _cache.clear()


# ---------------------------------------------------------------- logs


@dataclass(frozen=True)
class LogFilters:
    level: str | None = None  # this level and above (a custom level: exactly it)
    worker: str | None = None
    since: float | None = None
    until: float | None = None
    text: str | None = None  # case-insensitive, in the message or the logger's name


def filter_logs(logs: Any, f: LogFilters) -> Any:
    import pyarrow as pa
    import pyarrow.compute as pc

    mask = None

    def both(cond: Any) -> None:
        nonlocal mask
        mask = cond if mask is None else pc.and_(mask, cond)

    if f.level is not None:
        # Any case on both sides: structlog and zap write "warning", "error" (a lower-case
        # record was missed by every level filter).
        level = f.level.upper()
        level = ALIASES.get(level, level)
        allowed = LEVELS[LEVELS.index(level) :] if level in LEVELS else (level,)
        allowed += tuple(alias for alias, name in ALIASES.items() if name in allowed)
        stored = pc.utf8_upper(logs["level"])
        both(pc.is_in(stored, value_set=pa.array(allowed, pa.string())))
    if f.worker is not None:
        both(pc.equal(logs["worker"], f.worker))
    if f.since is not None:
        both(pc.greater_equal(logs["time"], f.since))
    if f.until is not None:
        both(pc.less(logs["time"], f.until))
    if f.text:
        both(
            pc.or_kleene(
                pc.match_substring(logs["message"], f.text, ignore_case=True),
                pc.match_substring(logs["logger"], f.text, ignore_case=True),
            )
        )
    return logs if mask is None else logs.filter(pc.fill_null(mask, False))


def log_page(logs: Any, f: LogFilters, offset: int, limit: int) -> dict[str, Any]:
    """One page of the run's matching records (oldest first), how many match, and the
    run's records per level (unfiltered)."""
    import pyarrow.compute as pc

    matching = filter_logs(logs, f)
    page = matching.slice(offset, limit).to_pylist()
    by_level = pc.value_counts(logs["level"]).to_pylist() if len(logs) else []
    return {
        "logs": [{k: v for k, v in r.items() if v is not None or k == "worker"} for r in page],
        "total": len(matching),
        "end": offset + len(page),
        "levels": {d["values"]: d["counts"] for d in by_level},
    }


# ---------------------------------------------------------------- streams


def stream_names(streams: Any) -> list[dict[str, Any]]:
    """Each stream's name, values, numeric values, workers and first and last times."""
    if not len(streams):
        return []
    g = streams.group_by("stream").aggregate(
        [
            ("time", "count"),
            ("number", "count"),
            ("time", "min"),
            ("time", "max"),
            ("worker", "count_distinct"),
        ]
    )
    rows = sorted(g.to_pylist(), key=lambda r: r["stream"])
    return [
        {
            "stream": r["stream"],
            "count": r["time_count"],
            "numeric": r["number_count"],
            "first": r["time_min"],
            "last": r["time_max"],
            "workers": r["worker_count_distinct"],
        }
        for r in rows
    ]


def one_stream(streams: Any, name: str) -> Any:
    import pyarrow.compute as pc

    return streams.filter(pc.equal(streams["stream"], name))


def stream_values(table: Any, offset: int, limit: int) -> list[dict[str, Any]]:
    dec = msgspec.json.decode
    return [
        {"time": r["time"], "worker": r["worker"], "key": r["key"], "value": dec(r["value"])}
        for r in table.slice(offset, limit).to_pylist()
    ]


#: The most points an aggregate answers: a shorter ``interval`` is widened to this many.
MAX_POINTS = 10_000


def aggregate(table: Any, buckets: int, interval: float | None = None) -> dict[str, Any] | None:
    """The stream's numeric values per interval: count, sum, mean, min, max (None: no
    numeric value). ``interval`` seconds (widened so that there are at most
    :data:`MAX_POINTS`; the answer says the interval used), else the stream's time span in
    ``buckets``."""
    import pyarrow.compute as pc

    nums = table.filter(pc.is_valid(table["number"]))
    if not len(nums):
        return None
    t0 = pc.min(nums["time"]).as_py()
    t1 = pc.max(nums["time"]).as_py()
    if interval:
        interval = max(interval, (t1 - t0) / MAX_POINTS)
    width = interval if interval else max((t1 - t0) / buckets, 1e-3)
    slot = pc.floor(pc.divide(pc.subtract(nums["time"], t0), width))
    if not interval:  # the last value closes the last bucket rather than opening one more
        slot = pc.min_element_wise(slot, float(buckets - 1))
    g = (
        nums.append_column("slot", slot)
        .group_by("slot")
        .aggregate(
            [
                ("number", "count"),
                ("number", "sum"),
                ("number", "mean"),
                ("number", "min"),
                ("number", "max"),
            ]
        )
    )
    points = [
        {
            "time": t0 + r["slot"] * width,
            "count": r["number_count"],
            "sum": r["number_sum"],
            "mean": r["number_mean"],
            "min": r["number_min"],
            "max": r["number_max"],
        }
        for r in sorted(g.to_pylist(), key=lambda r: r["slot"])
    ]
    return {"interval": width, "start": t0, "points": points}


# ---------------------------------------------------------------- lifecycle

#: What a worker's departure means, from the scheduler's stimulus and what it knew.
CAUSES = {
    "retired": "retired by the scheduler (expected)",
    "closed": "closed itself (it told the scheduler it was closing)",
    "lost": "connection lost while it was running: killed or crashed",
    "timed-out": "stopped sending heartbeats (worker-ttl)",
    "removed": "removed by the scheduler",
    "unknown": "left (an older agent did not say how)",
}
#: Said of a worker lost while Dask had it paused: its memory monitor pauses a worker past
#: 80% of its memory limit, and a nanny kills one past 95% (the OS's OOM killer may come
#: first). A worker killed so read "killed or crashed" alone, its memory line short of the
#: limit (the sample before the spike).
PAUSED_TEXT = (
    "connection lost while Dask had it paused for memory: likely killed at its memory limit"
    " (or crashed)"
)


#: A reason that is the worker's own exit as its runtime reported it: an upper-case exit
#: kind, alone or before its detail (``KIND: detail``). A scheduler's stimulus, which says
#: why the scheduler removed a worker, is lower-case; a worker that exited on its own while
#: running, neither expected nor closing, crashed or was killed.
EXIT_REPORTED = re.compile(r"[A-Z][A-Z0-9_]*(?::|$)")


def cause_of(reason: str | None, expected: bool | None, status: str | None) -> str:
    """A departure as one of :data:`CAUSES`, from what the agent said of it: whether it was
    expected, the worker's last status, and the reason (Dask's stimuli, ``storage.dask``;
    a worker's own exit, :data:`EXIT_REPORTED`)."""
    if expected:
        return "retired"
    if status in dask.CLOSING_STATUSES:
        return "closed"
    if reason == dask.TTL_REASON:
        return "timed-out"
    if expected is None and status is None:
        return "unknown"
    if reason in dask.LOST_REASONS or EXIT_REPORTED.match(reason or ""):
        return "lost"
    return "removed"


def session_facts(db: Session, run: m.Run) -> dict[str, Any] | None:
    """The session's facts (versions, config excerpt, scheduler address), as sent once."""
    return db.execute(select(m.Session.info).where(m.Session.id == run.session_id)).scalar()


def lifecycle(
    db: Session, blobs: BlobStore, run: m.Run, tasks: Callable[[], Any] | None = None
) -> list[dict[str, Any]]:
    """The session's workers that were there during the run (joined before its end, not
    gone before its start), oldest first, with how each left and, for one that left
    during the run, the run's tasks its leaving took down. ``tasks``: gives the run's task
    table (``runfile``), called only when a departure listed keys."""
    table: list[Any] = []

    def run_tasks() -> Any:
        if not table:
            table.append(tasks() if tasks is not None else None)
        return table[0]

    lo, hi = window(run)
    W = m.Worker
    q = select(W).where(W.session_id == run.session_id)
    if hi is not None:
        q = q.where(or_(W.joined_at.is_(None), W.joined_at <= hi + WINDOW_SLACK_S))
    if lo is not None:
        q = q.where(or_(W.left_at.is_(None), W.left_at >= lo - WINDOW_SLACK_S))
    rows = list(db.execute(q.order_by(W.joined_at, W.address)).scalars())
    departures: dict[str, dict[str, Any]] = {}
    for ev in load(db, blobs, run).workers.to_pylist():
        if ev["event"] == "left":
            departures[ev["address"]] = ev  # the latest, by time order
    out = []
    for w in rows:
        d = departures.get(w.address, {})
        during = (
            w.left_at is not None
            and (lo is None or w.left_at >= lo)
            and (hi is None or w.left_at <= hi)
        )
        entry: dict[str, Any] = {
            "address": w.address,
            "name": w.name,
            "nthreads": w.nthreads,
            "memory_limit": w.memory_limit,
            "joined_at": w.joined_at,
            "left_at": w.left_at,
            "joined_during_run": w.joined_at is not None and lo is not None and w.joined_at > lo,
            "left_during_run": during,
        }
        down = None
        if (
            not during
            and d
            and d["erred"]
            and lo is not None
            and hi is not None
            and w.left_at is not None
            and lo <= w.left_at <= hi + KILLED_AFTER_S
        ):
            # A departure that failed one of the run's tasks is the run's, even after the
            # run's window closed: Dask marks a run's last task KilledWorker when it removes
            # the worker, after the span ended, and that task has no times. Only a task the
            # run recorded so (erred, no phases): the same key may be another run's too.
            down = took_down(d, run_tasks())
            during = bool(_killed_here(run_tasks(), down["erred"]))
            entry["left_during_run"] = during
        if w.left_at is not None:
            cause = cause_of(w.left_reason, d.get("expected"), d.get("status"))
            entry.update(
                reason=w.left_reason,
                cause=cause,
                cause_text=PAUSED_TEXT
                if cause == "lost" and d.get("status") == dask.PAUSED_STATUS
                else CAUSES[cause],
                expected=d.get("expected"),
                last_status=d.get("status"),
            )
            if during and d:
                listed = d["processing"] or d["lost"]
                entry["took_down"] = down or took_down(d, run_tasks() if listed else None)
        out.append(entry)
    return out


def _killed_here(tasks: Any, keys: list[str]) -> list[str]:
    """Of ``keys``, those the run recorded as erred without phases (a KilledWorker)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if not keys or tasks is None or not len(tasks):
        return []
    rows = tasks.filter(pc.is_in(tasks["key"], value_set=pa.array(sorted(keys), pa.string())))
    return [
        r["key"]
        for r in rows.select(["key", "status", "stop"]).to_pylist()
        if r["status"] == "erred" and r["stop"] is None
    ]


def took_down(departure: dict[str, Any], tasks: Any) -> dict[str, Any]:
    """The run's tasks a departure took down, from the keys the agent listed: ``erred``
    (failed because of it: Dask's KilledWorker), ``rescheduled`` (it was running them;
    they ran again elsewhere) and ``recomputed`` (results only it held, computed again),
    each with the worker and time of the task's next record, if any; ``lost`` (results
    only it held that were never computed again)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    counts = msgspec.json.decode(departure["counts"]) if departure.get("counts") else {}
    listed = set(departure["processing"]) | set(departure["lost"])
    later: dict[str, dict[str, Any]] = {}
    mine: set[str] = set()
    if listed and tasks is not None and len(tasks):
        rows = tasks.filter(pc.is_in(tasks["key"], value_set=pa.array(sorted(listed), pa.string())))
        for r in rows.select(["key", "worker", "status", "stop"]).to_pylist():
            mine.add(r["key"])
            stop = r["stop"]
            if (
                stop is not None
                and stop >= departure["time"]
                and r["worker"] != departure["address"]
            ):
                prev = later.get(r["key"])
                if prev is None or stop < prev["stop"]:
                    later[r["key"]] = {
                        "key": r["key"],
                        "worker": r["worker"],
                        "status": r["status"],
                        "stop": stop,
                    }
    erred = [k for k in departure["erred"] if k in mine]
    gone = set(departure["erred"])
    rescheduled = [
        later.get(k, {"key": k}) for k in departure["processing"] if k in mine and k not in gone
    ]
    held = [k for k in departure["lost"] if k in mine]
    return {
        "erred": erred,
        "rescheduled": rescheduled,
        "recomputed": [later[k] for k in held if k in later],
        # results only it held that were not computed again (no longer needed)
        "lost": [k for k in held if k not in later],
        # totals over the whole cluster (every run) as the agent counted them; the lists
        # above hold the run's keys among the first keys listed
        "worker_totals": {k: counts.get(k, 0) for k in ("processing", "erred", "lost")},
    }
