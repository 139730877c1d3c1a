"""A history of runs for bench/scale.py (not a benchmark itself): one day of one group of
clusters (a "unit") generated as the agents would send it, ingested through the real
writer, and copied at the SQL level to build 10^3 .. 10^6 runs.

A unit is ``UNIT_RUNS`` runs: ``CLUSTERS`` clusters of one group, each with one
scheduler session that day (``Scheduler-dayNNNN``) and ``WORKERS`` workers, running
``RUNS_PER_CLUSTER`` runs spread over the day. Unit ``u`` is group ``u % GROUPS`` on day
``u // GROUPS``; group ``g`` belongs to tenant ``tenant_of(g)`` (50/25/12.5/12.5%), so
history grows by days over 40 groups (160 clusters) of four tenants.

Every unit sends the same workload, shifted: names carry the group and day
(``g007-k2``, ``Scheduler-day0031``, ``day0031-k2-r07``) and every time is the template's
time plus whole days. Times are multiples of 2^-10 s, so shifting them by whole days is
exact and durations computed from shifted times are bit-identical: a unit ingested for
real and a unit copied in SQL must give the same rows (``bench/scale.py`` checks it).

What a run sends (what ``hindsight.dask`` sends, see docs/dask.md): the scheduler agent
flushes every second (``flush_interval``) while the run works, with the run's task
records, one metric sample per worker and the scheduler per second, a replay sample a
second (task states by prefix, workers), run started and finished (1% never finish, 3%
err), the submitting code and the run's fine performance metrics; each worker agent ships
a profile cycle batch every 5 s (one ``profile`` event per prefix it ran, a tree of
~40-120 frames out of a shared code base). 70% of runs are interactive computes of 0.5-5 s,
the rest jobs of 5-120 s (log-uniform), 20-150 tasks/s, a job template of 3-6 prefixes (20
named jobs): 846 tasks and 29 batches a run on average. Idle clusters send nothing here:
a long-lived idle cluster adds a manifest row per second to its session, not to any run
(see docs/decisions/0011-the-cost-curve-as-history-grows.md).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any

import msgspec
import numpy as np
import zstandard
from psycopg2.extras import execute_values
from sqlalchemy import inspect, text

from bench.lib_workload import NAMES, PREFIXES
from hindsight.schema import decode_batch

DAY = 86_400
T0 = 20_600 * DAY  # a UTC midnight: day numbers and hours are whole
GROUPS = 40
CLUSTERS = 4
RUNS_PER_CLUSTER = 25
UNIT_RUNS = CLUSTERS * RUNS_PER_CLUSTER
WORKERS = 4
TENANTS = ("acme", "globex", "initech", "umbrella")
JOBS = 20
Q = 1024.0  # times are multiples of 1/Q s

ACTIVITIES = [
    ("execute", "thread-cpu", "seconds"),
    ("execute", "thread-noncpu", "seconds"),
    ("execute", "deserialize", "seconds"),
    ("execute", "memory-read", "bytes"),
    ("gather-dep", "network", "seconds"),
    ("gather-dep", "decompress", "seconds"),
]


def tenant_of(group: int) -> str:
    if group % 2 == 0:
        return TENANTS[0]
    return TENANTS[1] if group % 4 == 1 else TENANTS[2] if group % 8 == 3 else TENANTS[3]


def place(unit: int) -> tuple[int, int]:
    """(group, day) of a unit."""
    return unit % GROUPS, unit // GROUPS


def unit_order(n_units: int) -> list[int]:
    """The order units are added in: by day then group, except that the second unit is
    (group 1, day 1), so the real-versus-copied check covers another tenant, other
    clusters and another day at once."""
    check = GROUPS + 1
    return [0, check, *(u for u in range(1, max(n_units, check + 1)) if u != check)][:n_units]


def cluster_name(group: int, k: int) -> str:
    return f"g{group:03d}-k{k}"


def session_name(day: int) -> str:
    return f"Scheduler-day{day:04d}"


def run_key(day: int, k: int, i: int) -> str:
    return f"day{day:04d}-k{k}-r{i:02d}"


def _q(t: float) -> float:
    return math.floor(t * Q) / Q


@dataclass
class Sent:
    """One batch as an agent sends it."""

    tenant: str
    cluster: str
    session: str
    agent: str
    seq: int
    body: dict[str, Any]

    @property
    def key(self) -> str:
        return (
            f"v1/{self.tenant}/{self.cluster}/{self.session}/{self.agent}/{self.seq:012d}.json.zst"
        )

    def raw(self) -> bytes:
        return msgspec.json.encode(self.body)


def _code_base(rng: random.Random) -> dict[str, tuple[list[dict[str, Any]], list[int]]]:
    """Per prefix: frames and a parent array of a call tree (shared by every run)."""
    out = {}
    for p in NAMES:
        n = rng.randint(40, 120)
        frames = [
            {
                "name": f"{p.replace('-', '_')}_fn{i}",
                "filename": f"/opt/venv/lib/python3.11/site-packages/lib{i % 9}/mod{i % 31}.py",
                "first_line": 10 + i,
                "line_number": 12 + i,
                "line": f"out = step_{i}(part, **kwargs)",
            }
            for i in range(n)
        ]
        parents = [-1] + [rng.randrange(i) for i in range(1, n)]
        out[p] = (frames, parents)
    return out


def _tree(
    rng: random.Random, base: tuple[list[dict[str, Any]], list[int]], samples: int
) -> tuple[list[dict[str, Any]], list[list[int]]]:
    frames, parents = base
    keep, kept = [0], {0}
    for i in range(1, len(frames)):
        if parents[i] in kept and rng.random() < 0.7:
            keep.append(i)
            kept.add(i)
    index = {f: n for n, f in enumerate(keep)}
    counts = dict.fromkeys(keep, 0)
    for i in reversed(keep):
        counts[i] += rng.randint(1, max(1, samples // len(keep)))
        if parents[i] >= 0:
            counts[parents[i]] += counts[i]
    nodes = [
        [index[parents[i]] if parents[i] >= 0 else -1, n, counts[i]] for n, i in enumerate(keep)
    ]
    return [frames[i] for i in keep], nodes


class _Agent:
    def __init__(self, out: list[tuple[float, str, list[Any]]], name: str) -> None:
        self.out, self.name = out, name

    def flush(self, t: float, events: list[Any]) -> None:
        for i in range(0, len(events), 5000):
            self.out.append((t, self.name, events[i : i + 5000]))


def template(seed: int = 11) -> list[tuple[int, str, float, list[dict[str, Any]]]]:
    """The template workload: per cluster index k, (k, agent, flush time, events), times
    of day 0 in flush order per agent. ``unit_batches`` names and shifts it."""
    rng = random.Random(seed)
    code = _code_base(rng)
    jobs = [["read-parquet", *rng.sample(NAMES[1:], rng.randint(2, 5))] for _ in range(JOBS)]
    workers = [f"tcp://10.0.0.{w + 10}:40{w:03d}" for w in range(WORKERS)]
    threads = [140270328174272 + 4096 * i for i in range(4)]
    out: list[tuple[int, str, float, list[dict[str, Any]]]] = []
    for k in range(CLUSTERS):
        flushed: list[tuple[float, str, list[Any]]] = []
        sched = _Agent(flushed, "scheduler")
        day_t = T0 + 300 + 60 * k
        sched.flush(
            _q(day_t),
            [
                {
                    "kind": "session",
                    "time": _q(day_t),
                    "address": "tcp://10.0.0.2:8786",
                    "versions": {
                        "python": "3.11.2",
                        "dask": "2024.12.1",
                        "distributed": "2024.12.1",
                        "hindsight": "0.1",
                    },
                    "config": {"distributed.scheduler.work-stealing": True},
                },
                *(
                    {
                        "kind": "worker",
                        "event": "joined",
                        "address": w,
                        "time": _q(day_t + 1),
                        "name": f"w{i}",
                        "nthreads": 4,
                        "memory_limit": 16 * 2**30,
                    }
                    for i, w in enumerate(workers)
                ),
            ],
        )
        for i in range(RUNS_PER_CLUSTER):
            rk = run_key(0, k, i)
            st = _q(T0 + 900 + i * (DAY - 3600) / RUNS_PER_CLUSTER + rng.random() * 600 + 60 * k)
            short = rng.random() < 0.7  # interactive computes of a few seconds, and jobs
            makespan = math.exp(
                rng.uniform(math.log(0.5), math.log(5))
                if short
                else rng.uniform(math.log(5), math.log(120))
            )
            end = _q(st + makespan)
            job = rng.randrange(JOBS)
            prefixes = jobs[job]
            n_tasks = max(10, int(makespan * rng.uniform(20, 150)))
            erred = rng.random() < 0.03
            by_second: dict[int, list[Any]] = {}
            tokens = {p: f"{rng.getrandbits(64):016x}" for p in prefixes}
            for n in range(n_tasks):
                p = prefixes[n * len(prefixes) // n_tasks]
                typename, size, varies = PREFIXES[p]
                start = _q(st + (makespan - 0.2) * n / n_tasks + rng.random() * 0.1)
                stop = _q(min(end, start + rng.expovariate(1 / 0.05)) + 1 / Q)
                ss: list[dict[str, Any]] = [{"action": "compute", "start": start, "stop": stop}]
                if rng.random() < 0.3:
                    ts = _q(start - rng.random() * 0.02)
                    ss.insert(
                        0,
                        {
                            "action": "transfer",
                            "start": _q(ts - rng.random() * 0.05),
                            "stop": ts,
                            "source": rng.choice(workers),
                        },
                    )
                failed = erred and n == n_tasks - 1
                ev = {
                    "kind": "task",
                    "key": f"('{p}-{tokens[p]}', {n})",
                    "prefix": p,
                    "group": f"{p}-{tokens[p]}",
                    "run": rk,
                    "worker": rng.choice(workers),
                    "thread": rng.choice(threads),
                    "status": "erred" if failed else "memory",
                    "startstops": ss,
                }
                if failed:
                    ev["exception"] = "ValueError('bad partition')"
                    ev["traceback"] = '  File "job.py", line 12, in part\n    raise ValueError'
                else:
                    ev["nbytes"] = int(size * rng.uniform(0.75, 1.25)) if varies else size
                    ev["typename"] = typename
                by_second.setdefault(int(stop - T0), []).append(ev)
            first = int(st - T0)
            by_second.setdefault(first, []).insert(
                0,
                {
                    "kind": "run",
                    "event": "started",
                    "id": rk,
                    "name": f"job-{job:02d}",
                    "time": st,
                    "span": [rk],
                    "client": "Client-6f1c",
                },
            )
            by_second[first].append(
                {
                    "kind": "code",
                    "run": rk,
                    "time": st,
                    "frames": [
                        {
                            "code": "df = dd.read_parquet(path)\n"
                            f"result = job_{job:02d}(df).compute()\n",
                            "filename": f"/home/user/jobs/job_{job:02d}.py",
                            "lineno_frame": 40 + job,
                            "lineno_relative": 1,
                        }
                    ],
                }
            )
            last = int(end - T0) + 1
            if rng.random() >= 0.01:
                by_second.setdefault(last, []).append(
                    {
                        "kind": "run",
                        "event": "erred" if erred else "finished",
                        "id": rk,
                        "time": _q(end + 0.25),
                    }
                )
            by_second.setdefault(last + 1, []).append(
                {
                    "kind": "activity",
                    "run": rk,
                    "time": _q(end + 1),
                    "metrics": [
                        {
                            "context": c,
                            "prefix": p,
                            "activity": a,
                            "unit": u,
                            "value": round(
                                rng.uniform(0.1, 50) * (2**20 if u == "bytes" else 1), 3
                            ),
                        }
                        for p in prefixes
                        for c, a, u in ACTIVITIES
                    ],
                }
            )
            for s in range(first, last + 2):
                metrics = [
                    {
                        "kind": "metric",
                        "worker": w,
                        "time": _q(T0 + s + 0.5),
                        "values": {
                            "memory": float(rng.randint(2**28, 2**32)),
                            "cpu": round(rng.uniform(0, 400), 1),
                            "processing": float(rng.randint(0, 16)),
                            "spilled_bytes": 0.0,
                            "transfer_incoming": 0.0,
                            "event_loop_interval": 0.02,
                        },
                    }
                    for w in ["scheduler", *workers]
                ]
                if s <= last:  # a replay sample a second while the run lasts, and at its end
                    done = min(1.0, (s - first + 1) / max(1, last - first))
                    metrics.append(
                        {
                            "kind": "state",
                            "run": rk,
                            "time": _q(T0 + s + 0.5),
                            "prefixes": [
                                {
                                    "prefix": p,
                                    "waiting": int(n_tasks / len(prefixes) * (1 - done)),
                                    "processing": 0 if done == 1 else rng.randint(1, 16),
                                    "memory": int(n_tasks / len(prefixes) * done),
                                }
                                for p in prefixes
                            ],
                            "workers": [
                                {
                                    "worker": w,
                                    "managed": rng.randint(2**26, 2**32),
                                    "unmanaged": rng.randint(2**27, 2**29),
                                    "limit": 16 * 2**30,
                                    "processing": rng.randint(0, 4),
                                }
                                for w in workers
                            ],
                        }
                    )
                sched.flush(_q(T0 + s + 1), by_second.get(s, []) + metrics)
            for wi, w in enumerate(workers):
                agent = _Agent(flushed, f"worker-{wi}")
                for c in range(first, last, 5):
                    cycle = [
                        {
                            "kind": "profile",
                            "worker": w,
                            "prefix": p,
                            "start": _q(T0 + c),
                            "stop": _q(T0 + min(c + 5, last)),
                            "interval": 0.01,
                            **dict(zip(("frames", "nodes"), _tree(rng, code[p], 400), strict=True)),
                        }
                        for p in prefixes
                    ]
                    agent.flush(_q(T0 + c + 5), cycle)
        for t, agent, events in sorted(flushed, key=lambda f: f[0]):
            out.append((k, agent, t, events))
    return out


def _shift(ev: dict[str, Any], by: float, day: int) -> dict[str, Any]:
    ev = dict(ev)
    for f in ("time", "start", "stop"):
        if f in ev:
            ev[f] = ev[f] + by
    if "startstops" in ev:
        ev["startstops"] = [
            {**s, "start": s["start"] + by, "stop": s["stop"] + by} for s in ev["startstops"]
        ]
    for f in ("run", "id"):
        if f in ev and ev[f].startswith("day0000-"):
            ev[f] = f"day{day:04d}-" + ev[f][8:]
    if ev.get("kind") == "run" and ev.get("span"):
        ev["span"] = [ev["id"]]
    return ev


def unit_batches(
    unit: int, tmpl: list[tuple[int, str, float, list[dict[str, Any]]]]
) -> Iterator[tuple[Sent, float]]:
    """The batches of one unit, as (batch, receive time) in the order agents send them."""
    group, day = place(unit)
    tenant, by = tenant_of(group), float(day * DAY)
    seqs: dict[tuple[int, str], int] = {}
    last = {}
    for k, agent, _t, _ in tmpl:
        last[(k, agent)] = seqs[(k, agent)] = seqs.get((k, agent), -1) + 1
    seqs.clear()
    for k, agent, t, events in tmpl:
        seq = seqs[(k, agent)] = seqs.get((k, agent), -1) + 1
        body = {
            "schema": 1,
            "cluster": cluster_name(group, k),
            "session": session_name(day),
            "agent": agent,
            "seq": seq,
            "sent_at": t + by,
            "final": seq == last[(k, agent)],
            "events": [_shift(e, by, day) for e in events],
        }
        yield Sent(tenant, body["cluster"], body["session"], agent, seq, body), t + by + 0.25


def ingest_units(
    sessions: Any,
    blobs: Any,
    tenant_ids: dict[str, int],
    units: list[int],
    tmpl: list[tuple[int, str, float, list[dict[str, Any]]]],
    log: Any = print,
) -> None:
    """Units through the real path: each batch compressed and stored in the blob store,
    indexed by ``storage.ingest.writer.index_batch`` at its receive time, the runs that
    never finished closed ``lost`` once their session has been silent for the default
    ``HINDSIGHT_SILENT_CLOSE_SECONDS`` (as the collectors' finish workers do; a history is
    days old), then every ended run's finished-run work (``storage.jobs.finish``: fold,
    compacted copy, profile, lake), and last the manifest rows collapsed once they are
    ``HINDSIGHT_MANIFEST_COLLAPSE_SECONDS`` old (as the finish workers do)."""
    from storage.core.config import ENVIRONMENT
    from storage.core.manifest import collapse_due
    from storage.ingest.writer import index_batch
    from storage.jobs.finish import drain
    from storage.jobs.silent import close_silent

    silence = ENVIRONMENT["HINDSIGHT_SILENT_CLOSE_SECONDS"][2]  # the defaults
    collapse = ENVIRONMENT["HINDSIGHT_MANIFEST_COLLAPSE_SECONDS"][2]

    cctx = zstandard.ZstdCompressor(level=9)
    for unit in units:
        last = 0.0  # the unit's latest receive time (its batches go by agent, not by time)
        for n, (sent, now) in enumerate(unit_batches(unit, tmpl)):
            last = max(last, now)
            raw = sent.raw()
            body = cctx.compress(raw)
            blobs.put(sent.key, body, if_absent=True)
            with sessions.begin() as db:
                index_batch(
                    db,
                    tenant_id=tenant_ids[sent.tenant],
                    tenant=sent.tenant,
                    batch=decode_batch(raw),
                    blob_key=sent.key,
                    size=len(body),
                    now=now,
                )
            if (n + 1) % 1000 == 0:
                log(f"  unit {unit}: {n + 1} batches indexed")
        lost = close_silent(sessions, silence=silence, now=last + silence + 1)
        log(f"  unit {unit}: {lost} runs closed lost; finished-run work ...")
        drain(sessions, blobs)
        moved = collapse_due(sessions, age=collapse, now=last + collapse + 1)
        log(f"  unit {unit}: {moved} manifest rows collapsed")


# ------------------------------------------------------------------ the bulk path
#: Tables with their own ids, copied with fresh ids (in this order: parents first).
ID_TABLES = ("sessions", "agents", "batches", "runs", "workers", "lake_partitions", "lake_files")
#: Tables copied in bulk; everything else must be empty or not per unit (checked).
COPIED = {
    *ID_TABLES,
    "clusters",
    "profile_frames",
    "run_status_counts",
    "run_batches",
    "run_prefixes",
    "run_prefix_actions",
    "run_prefix_hist",
    "run_workers",
    "prefix_days",
    "cluster_hours",
    "run_activity",
    "run_metrics",
    "run_batch_lists",
    "run_worker_lists",
    "run_code",
    "run_profiles",
    "lake_runs",
    "finish_jobs",
    "run_states",
    "manifest_chunks",
}
#: The lake's Iceberg catalog (pyiceberg's tables in the index database): one row per lake
#: table, naming its newest metadata file, not rows per unit.
ICEBERG_CATALOG = {"iceberg_tables", "iceberg_namespace_properties"}
NOT_PER_UNIT = {"tenants", "tokens", "alembic_version", *ICEBERG_CATALOG}
RUN_NS = "6f0e4a52-3c9e-4f5b-9a43-1d2f8b7c6e10"  # storage.core.batches._RUN_NS


@dataclass
class Template:
    """Id ranges (lo, hi) of the template unit's rows, taken right after it was ingested."""

    ranges: dict[str, tuple[int, int]]
    tenant_id: int
    tenant: str = TENANTS[0]
    #: per other tenant: the template's profile trees in that tenant's frame ids
    trees: dict[int, list[tuple[Any, ...]]] = field(default_factory=dict)
    #: the template runs' packed fine metrics, decoded
    metrics: dict[int, Any] | None = None
    #: the template runs' packed batch lists, decoded
    batch_lists: dict[int, list[tuple[int, int]]] | None = None
    #: the template runs' packed workers, decoded
    workers: dict[int, list[Any]] | None = None

    @classmethod
    def read(cls, conn: Any, tenant_id: int) -> Template:
        ranges = {}
        with conn.cursor() as cur:
            for t in (*ID_TABLES, "clusters", "profile_frames"):
                cur.execute(_ID_RANGE.get(t, f"SELECT min(id), max(id) FROM {t}"))
                ranges[t] = tuple(cur.fetchone())
        return cls(ranges, tenant_id)


#: Batch ids live on in the manifest's chunks once their rows are collapsed.
_ID_RANGE = {
    "batches": "SELECT least((SELECT min(id) FROM batches), (SELECT min(id_lo) FROM "
    "manifest_chunks)), greatest((SELECT max(id) FROM batches), (SELECT max(id_hi) FROM "
    "manifest_chunks))"
}


def _tree_data(data: bytes, ids: dict[int, int]) -> bytes:
    """A stored profile tree with its frame ids renumbered (``storage.runs.profiles.encode``'s
    format: header, int32 parents, int64 frame ids, int64 counts; zstd)."""
    from storage.analysis.profile import _HEAD, ZSTD_LEVEL

    raw = bytearray(zstandard.ZstdDecompressor().decompress(data))
    _, _, n = _HEAD.unpack_from(raw)
    at = _HEAD.size + 4 * n
    frames = np.frombuffer(bytes(raw[at : at + 8 * n]), dtype="<i8")
    raw[at : at + 8 * n] = np.asarray([ids[int(f)] for f in frames], dtype="<i8").tobytes()
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(bytes(raw))


def _frames_for(cur: Any, tm: Template, tenant_id: int) -> list[tuple[Any, ...]]:
    """The template's profile trees with their frame ids renumbered to ``tenant_id``'s
    frames, which are first copied from the template tenant's where missing (same
    relative order, as the same workload ingested for real assigns them)."""
    if tenant_id in tm.trees:
        return tm.trees[tenant_id]
    lo, hi = tm.ranges["profile_frames"]
    cur.execute("SELECT coalesce(max(id), 0) FROM profile_frames")
    base = cur.fetchone()[0]
    cur.execute(
        "INSERT INTO profile_frames (id, tenant_id, digest, name, filename, first_line, "
        "line_number, line) "
        "SELECT %s + id - %s + 1, %s, digest, name, filename, first_line, line_number, line "
        "FROM profile_frames f WHERE id BETWEEN %s AND %s AND NOT EXISTS "
        "(SELECT 1 FROM profile_frames g WHERE g.tenant_id = %s AND g.digest = f.digest)",
        (base, lo, tenant_id, lo, hi, tenant_id),
    )
    cur.execute(
        "SELECT setval(pg_get_serial_sequence('profile_frames', 'id'), (SELECT max(id) FROM "
        "profile_frames))"
    )
    cur.execute(
        "SELECT f.id, g.id FROM profile_frames f JOIN profile_frames g ON g.digest = f.digest "
        "AND g.tenant_id = %s WHERE f.id BETWEEN %s AND %s",
        (tenant_id, lo, hi),
    )
    ids = dict(cur.fetchall())
    lo_r, hi_r = tm.ranges["runs"]
    cur.execute(
        "SELECT run_id, prefix, worker, data FROM run_profiles WHERE run_id BETWEEN %s AND %s",
        (lo_r, hi_r),
    )
    rows = [(tenant_id, r, p, w, _tree_data(bytes(d), ids)) for r, p, w, d in cur.fetchall()]
    tm.trees[tenant_id] = rows
    return rows


def copy_units(conn: Any, tm: Template, tenant_ids: dict[str, int], units: list[int]) -> None:
    """Add ``units`` as copies of the template's rows, in one transaction: fresh ids,
    names of the unit's tenant, group and day, times shifted by whole days (so hour and
    day rollup keys shift with them), public ids recomputed as the writer computes them."""
    cur = conn.cursor()
    cur.execute(
        "DROP TABLE IF EXISTS _pdata; CREATE TEMP TABLE _pdata (tenant_id bigint, run_id bigint, "
        "prefix text, worker text, data bytea, PRIMARY KEY (tenant_id, run_id, prefix, worker))"
    )
    cur.execute(
        "DROP TABLE IF EXISTS _u; CREATE TEMP TABLE _u (unit int, rank int, g int, d int, "
        "tenant_id bigint, tenant text, gname text, dd text, day text, shift float8)"
    )
    rows = []
    for rank, u in enumerate(units):
        g, d = place(u)
        t = tenant_of(g)
        rows.append(
            (u, rank, g, d, tenant_ids[t], t, f"g{g:03d}", f"{d:04d}", None, float(d * DAY))
        )
    cur.executemany("INSERT INTO _u VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)", rows)
    cur.execute(
        "UPDATE _u SET day = to_char(date '1970-01-01' + (%s + d), 'YYYY-MM-DD')", (T0 // DAY,)
    )
    for t in sorted({r[5] for r in rows} - {tm.tenant}):
        execute_values(cur, "INSERT INTO _pdata VALUES %s", _frames_for(cur, tm, tenant_ids[t]))
    base, span, lo = {}, {}, {}
    ranges = {}
    for t in ID_TABLES:
        cur.execute(_ID_RANGE.get(t, f"SELECT min(id), max(id) FROM {t}"))
        base[t] = cur.fetchone()[1] or 0
        # a table the template holds no rows of (lake_files, since the lake is Iceberg's):
        # an empty range, nothing copied
        ranges[t] = tm.ranges[t] if tm.ranges[t][0] is not None else (1, 0)
        lo[t], hi = ranges[t]
        span[t] = hi - lo[t] + 1

    def nid(t: str, col: str) -> str:
        return f"({base[t]} + _u.rank * {span[t]} + ({col} - {lo[t]}) + 1)"

    def bid(col: str) -> str:
        return f"CASE WHEN {col} = 0 THEN 0 ELSE {nid('batches', col)} END"

    def rng(t: str, col: str) -> str:
        lo_, hi_ = ranges.get(t, tm.ranges[t])
        return f"{col} BETWEEN {lo_} AND {hi_}"

    S = "_u.shift"
    acme = f"'{tm.tenant}'"
    newc = "replace(c.name, 'g000-', _u.gname || '-')"

    def marks(col: str) -> str:  # tenant, cluster group and day in keys and paths
        return (
            f"replace(replace(replace(replace({col}, '/{tm.tenant}/', '/' || _u.tenant || '/'), "
            f"'tenant={tm.tenant}/', 'tenant=' || _u.tenant || '/'), 'g000-', _u.gname || '-'), "
            f"'day0000', 'day' || _u.dd)"
        )

    sql = [
        # clusters of the units' groups, created on first use; first/last seen widen
        f"""INSERT INTO clusters (tenant_id, name, first_seen, last_seen)
            SELECT _u.tenant_id, {newc}, min(c.first_seen + {S}), max(c.last_seen + {S})
            FROM clusters c CROSS JOIN _u WHERE {rng("clusters", "c.id")} GROUP BY 1, 2
            ON CONFLICT (tenant_id, name) DO UPDATE SET
              first_seen = least(clusters.first_seen, excluded.first_seen),
              last_seen = greatest(clusters.last_seen, excluded.last_seen)""",
        "DROP TABLE IF EXISTS _c",
        f"""CREATE TEMP TABLE _c AS SELECT _u.unit, c.id AS old, n.id AS new, {newc} AS name
            FROM clusters c CROSS JOIN _u
              JOIN clusters n ON n.tenant_id = _u.tenant_id AND n.name = {newc}
            WHERE {rng("clusters", "c.id")}""",
        f"""INSERT INTO sessions (id, cluster_id, name, first_seen, last_seen, info)
            SELECT {nid("sessions", "s.id")}, _c.new, replace(s.name, 'day0000', 'day' || _u.dd),
              s.first_seen + {S}, s.last_seen + {S},
              CASE WHEN s.info IS NULL THEN NULL ELSE jsonb_set(s.info::jsonb, '{{time}}',
                to_jsonb((s.info->>'time')::float8 + {S}))::json END
            FROM sessions s JOIN _c ON _c.old = s.cluster_id JOIN _u ON _u.unit = _c.unit
            WHERE {rng("sessions", "s.id")}""",
        f"""INSERT INTO agents (id, session_id, name, batches, events, max_seq, final_seq,
              dropped, dropped_seq, collapsed_lo, collapsed_hi)
            SELECT {nid("agents", "a.id")}, {nid("sessions", "a.session_id")}, a.name,
              a.batches, a.events, a.max_seq, a.final_seq, a.dropped, a.dropped_seq,
              a.collapsed_lo, a.collapsed_hi
            FROM agents a CROSS JOIN _u WHERE {rng("agents", "a.id")}""",
        f"""INSERT INTO batches (id, agent_id, seq, blob_key, events, bytes, received_at,
              t_min, t_max)
            SELECT {nid("batches", "b.id")}, {nid("agents", "b.agent_id")}, b.seq,
              {marks("b.blob_key")}, b.events, b.bytes, b.received_at + {S}, b.t_min + {S},
              b.t_max + {S}
            FROM batches b CROSS JOIN _u WHERE {rng("batches", "b.id")}""",
        # a chunk's batch ids and times are steps from its columns: those shift
        f"""INSERT INTO manifest_chunks (agent_id, seq_lo, seq_hi, id_lo, id_hi, batches,
              events, bytes, received_lo, received_hi, t_min, t_max, data)
            SELECT {nid("agents", "x.agent_id")}, x.seq_lo, x.seq_hi, {nid("batches", "x.id_lo")},
              {nid("batches", "x.id_hi")}, x.batches, x.events, x.bytes, x.received_lo + {S},
              x.received_hi + {S}, x.t_min + {S}, x.t_max + {S}, x.data
            FROM manifest_chunks x CROSS JOIN _u WHERE {rng("agents", "x.agent_id")}""",
        "DROP TABLE IF EXISTS _r",
        f"""CREATE TEMP TABLE _r AS SELECT _u.unit, r.id AS old, {nid("runs", "r.id")} AS new,
              r.public_id AS old_pub, uuid_generate_v5('{RUN_NS}', _u.tenant || '/'
                || _c.name || '/'
                || replace(s.name, 'day0000', 'day' || _u.dd) || '/'
                || replace(r.run_key, 'day0000-', 'day' || _u.dd || '-'))::text AS new_pub
            FROM runs r JOIN sessions s ON s.id = r.session_id
              JOIN _c ON _c.old = r.cluster_id JOIN _u ON _u.unit = _c.unit
            WHERE {rng("runs", "r.id")}""",
        "CREATE INDEX ON _r (old, unit)",
        f"""INSERT INTO runs (id, public_id, tenant_id, cluster_id, session_id, run_key, name,
              span, client, status, started_at, finished_at, task_start, task_stop, task_count,
              error_count, graph_count, nbytes, first_seen, last_seen, finished_work_at,
              detail_digest)
            SELECT _r.new, _r.new_pub, _u.tenant_id, _c.new, {nid("sessions", "r.session_id")},
              replace(r.run_key, 'day0000-', 'day' || _u.dd || '-'), r.name,
              replace(r.span::text, 'day0000-', 'day' || _u.dd || '-')::json, r.client, r.status,
              r.started_at + {S}, r.finished_at + {S}, r.task_start + {S}, r.task_stop + {S},
              r.task_count, r.error_count, r.graph_count, r.nbytes, r.first_seen + {S},
              r.last_seen + {S}, r.finished_work_at, r.detail_digest
            FROM runs r JOIN _r ON _r.old = r.id JOIN _u ON _u.unit = _r.unit
              JOIN _c ON _c.old = r.cluster_id AND _c.unit = _u.unit""",
        f"""INSERT INTO workers (id, session_id, address, name, nthreads, memory_limit,
              joined_at, left_at, left_reason)
            SELECT {nid("workers", "w.id")}, {nid("sessions", "w.session_id")}, w.address,
              w.name, w.nthreads, w.memory_limit, w.joined_at + {S}, w.left_at + {S}, w.left_reason
            FROM workers w CROSS JOIN _u WHERE {rng("workers", "w.id")}""",
    ]
    per_run = {
        "run_status_counts": ("status, count", ""),
        "run_batches": ("batch_id, tasks", "{batch}"),
        "run_prefixes": ("prefix, count, errors, nbytes", ""),
        "run_prefix_actions": ("prefix, action, count, total, min, max, hist", ""),
        "run_prefix_hist": ("prefix, action, batch_id, buckets", "{bid}"),
        "run_workers": (
            "worker, tasks, errors, compute, transfer, disk_read, disk_write, other, first_start, "
            "last_stop",
            "{times}",
        ),
        "run_activity": ("context, prefix, activity, unit, value, time", "{times}"),
        "run_code": ("digest, time, frames", "{times}"),
        "run_states": ("time, prefixes, workers", "{times}"),
        "finish_jobs": ("due_at, claimed_until, attempts, error", "{times}"),
    }
    timed = {"first_start", "last_stop", "time", "due_at", "claimed_until"}
    for table, (cols, how) in per_run.items():
        exprs = []
        for col in (c.strip() for c in cols.split(",")):
            if col == "batch_id":
                exprs.append(
                    nid("batches", "x.batch_id") if how == "{batch}" else bid("x.batch_id")
                )
            elif col in timed:
                exprs.append(f"x.{col} + {S}")
            else:
                exprs.append(f"x.{col}")
        sql.append(f"""INSERT INTO {table} (run_id, {cols}) SELECT _r.new, {", ".join(exprs)}
            FROM {table} x JOIN _r ON _r.old = x.run_id JOIN _u ON _u.unit = _r.unit""")
    sql += [
        f"""INSERT INTO run_profiles (run_id, prefix, worker, samples, nodes, interval, tag, data)
            SELECT _r.new, x.prefix, x.worker, x.samples, x.nodes, x.interval, x.tag,
              CASE WHEN _u.tenant = {acme} THEN x.data ELSE p.data END
            FROM run_profiles x JOIN _r ON _r.old = x.run_id JOIN _u ON _u.unit = _r.unit
              LEFT JOIN _pdata p ON p.tenant_id = _u.tenant_id AND p.run_id = x.run_id
                AND p.prefix = x.prefix AND p.worker = x.worker""",
        f"""INSERT INTO prefix_days (cluster_id, prefix, action, day, batch_id, count, total,
              max, buckets, hist)
            SELECT _c.new, x.prefix, x.action, x.day + _u.d, {bid("x.batch_id")}, x.count,
              x.total, x.max, x.buckets, x.hist
            FROM prefix_days x JOIN _c ON _c.old = x.cluster_id JOIN _u ON _u.unit = _c.unit
            WHERE x.day = {T0 // DAY}""",
        f"""INSERT INTO cluster_hours (cluster_id, hour, batch_id, tasks, errors, compute,
              transfer, disk, nbytes)
            SELECT _c.new, x.hour + 24 * _u.d, {bid("x.batch_id")}, x.tasks, x.errors,
              x.compute, x.transfer, x.disk, x.nbytes
            FROM cluster_hours x JOIN _c ON _c.old = x.cluster_id JOIN _u ON _u.unit = _c.unit
            WHERE x.hour BETWEEN {T0 // 3600} AND {T0 // 3600 + 23}""",
        f"""INSERT INTO lake_partitions (id, tenant_id, cluster_id, day, seq, vacuum_at)
            SELECT {nid("lake_partitions", "x.id")}, _u.tenant_id, _c.new, _u.day, x.seq,
              x.vacuum_at
            FROM lake_partitions x JOIN _c ON _c.old = x.cluster_id JOIN _u ON _u.unit = _c.unit
            WHERE {rng("lake_partitions", "x.id")}""",
        f"""INSERT INTO lake_files (id, partition_id, tbl, key, rows, bytes, t_min, t_max,
              runs, stats)
            SELECT {nid("lake_files", "x.id")}, {nid("lake_partitions", "x.partition_id")}, x.tbl,
              replace({marks("x.key")},
                (SELECT day FROM lake_partitions WHERE id = x.partition_id), _u.day),
              x.rows, x.bytes, x.t_min + {S}, x.t_max + {S},
              (SELECT json_agg(_r.new_pub ORDER BY _r.new_pub)
                 FROM json_array_elements_text(x.runs) o
                 JOIN _r ON _r.old_pub = o.value AND _r.unit = _u.unit), x.stats
            FROM lake_files x CROSS JOIN _u WHERE {rng("lake_files", "x.id")}""",
        f"""INSERT INTO lake_runs (run_id, partition_id, tag)
            SELECT _r.new, {nid("lake_partitions", "x.partition_id")}, x.tag
            FROM lake_runs x JOIN _r ON _r.old = x.run_id JOIN _u ON _u.unit = _r.unit""",
    ]
    for q in sql:
        cur.execute(q)
    for t in ID_TABLES:
        cur.execute(_ID_RANGE.get(t, f"SELECT min(id), max(id) FROM {t}"))
        cur.execute(f"SELECT setval(pg_get_serial_sequence('{t}', 'id'), %s)", (cur.fetchone()[1],))
    from storage.runs.packed import (
        pack_activity,
        pack_batch_list,
        pack_worker_list,
        unpack_activity,
        unpack_batch_list,
        unpack_worker_list,
    )

    # a finished run's packed values hold times (fine metrics, workers: shifted per unit)
    # and batch ids (its batch list: renumbered as ``nid`` renumbers them, one offset a unit)
    _copy_packed(
        cur, tm, "metrics", "run_metrics", unpack_activity, "shift",
        lambda m, shift: pack_activity({k: (t + shift, v) for k, (t, v) in m.items()}),
    )  # fmt: skip
    _copy_packed(
        cur, tm, "workers", "run_worker_lists", unpack_worker_list, "shift",
        lambda ws, shift: pack_worker_list([_shifted(w, shift) for w in ws]),
    )  # fmt: skip

    def renumbered(batches: list[tuple[int, int]], rank: int) -> bytes:
        off = base["batches"] + rank * span["batches"] - lo["batches"] + 1
        return pack_batch_list([(b + off, t) for b, t in batches])

    _copy_packed(cur, tm, "batch_lists", "run_batch_lists", unpack_batch_list, "rank", renumbered)
    cur.execute("DROP TABLE _u, _c, _r, _pdata")
    conn.commit()


def _copy_packed(
    cur: Any, tm: Template, attr: str, table: str, unpack: Any, column: str, repack: Any
) -> None:
    """Copy the template runs' packed ``table`` rows to the new runs: each value decoded
    once (kept as ``tm.<attr>``) and packed again by ``repack(value, x)``, ``x`` the new
    run's unit's ``column`` (its time shift or its rank)."""
    if getattr(tm, attr) is None:
        lo_r, hi_r = tm.ranges["runs"]
        cur.execute(
            f"SELECT run_id, data FROM {table} WHERE run_id BETWEEN %s AND %s", (lo_r, hi_r)
        )
        setattr(tm, attr, {r: unpack(bytes(d)) for r, d in cur.fetchall()})
    have = getattr(tm, attr)
    cur.execute(f"SELECT _r.new, _r.old, _u.{column} FROM _r JOIN _u ON _u.unit = _r.unit")
    rows = [(new, repack(have[old], x)) for new, old, x in cur.fetchall() if old in have]
    execute_values(cur, f"INSERT INTO {table} (run_id, data) VALUES %s", rows)


def _shifted(w: Any, shift: float) -> Any:
    """A packed worker row with its times moved by ``shift``."""
    return replace(
        w,
        first_start=None if w.first_start is None else w.first_start + shift,
        last_stop=None if w.last_stop is None else w.last_stop + shift,
    )


# ------------------------------------------------------------------ real = bulk?
#: Columns that differ between a real ingest and a copy by design, with why.
UNCOMPARED = {
    "runs.finished_work_at": "wall-clock time the finishers ran",
    "lake_partitions.vacuum_at": "wall-clock time plus an hour",
    "lake_runs.tag": "a hash over the run's blob keys and summary (names differ per unit)",
    "run_profiles.tag": "a hash over the run's input batches (as above)",
    "runs.detail_digest": "a hash over the run's detail object, whose times shift per unit "
    "(the bulk path writes no objects: the bench measures the index)",
    "tenants.created_at": "wall clock",
    "manifest_chunks.id_lo": "batch ids (the chunk's batches are compared by what they name)",
    "manifest_chunks.id_hi": "as id_lo",
}
#: Compared as table totals within 2%: compressed sizes of bodies and files that differ
#: only in names (the bulk path cannot recompress).
APPROX = {"batches.bytes", "manifest_chunks.bytes", "lake_files.bytes"}


def snapshot(engine: Any) -> dict[str, list[tuple[Any, ...]]]:
    """Every indexed table's rows with ids replaced by what they name (a cluster's tenant
    and name, a batch's blob key, a run's public id ...), so two indexes built with
    different ids compare equal when they hold the same facts. Lake file keys lose their
    content hash; profile trees are compared decoded, frames by digest."""
    from storage.analysis.profile import _arrays
    from storage.core.manifest import unpack as unpack_chunk
    from storage.runs.packed import unpack_batch_list

    out: dict[str, list[tuple[Any, ...]]] = {}
    with engine.connect() as conn:
        q = lambda s: conn.execute(text(s)).all()  # noqa: E731
        tenants = dict(q("SELECT id, name FROM tenants"))
        clusters = {i: (tenants[t], n) for i, t, n in q("SELECT id, tenant_id, name FROM clusters")}
        sessions = {
            i: (*clusters[c], n) for i, c, n in q("SELECT id, cluster_id, name FROM sessions")
        }
        agents = {i: (*sessions[s], n) for i, s, n in q("SELECT id, session_id, name FROM agents")}
        batches = {i: (*agents[a], n) for i, a, n in q("SELECT id, agent_id, seq FROM batches")}
        chunks = conn.execute(text("SELECT * FROM manifest_chunks")).all()
        for chunk in chunks:
            batches.update((e.id, (*agents[e.agent_id], e.seq)) for e in unpack_chunk(chunk))
        batches[0] = 0
        runs = dict(q("SELECT id, public_id FROM runs"))
        parts = {
            i: (*clusters[c], d) for i, c, d in q("SELECT id, cluster_id, day FROM lake_partitions")
        }
        frames = dict(q("SELECT id, digest FROM profile_frames"))
        refs = {
            "tenant_id": tenants,
            "cluster_id": clusters,
            "session_id": sessions,
            "agent_id": agents,
            "batch_id": batches,
            "run_id": runs,
            "partition_id": parts,
        }
        for table in sorted(inspect(conn).get_table_names(schema="public")):
            if table in ("tokens", "alembic_version", *ICEBERG_CATALOG):
                continue
            rows = conn.execute(text(f"SELECT * FROM {table}")).mappings().all()
            norm = []
            for row in rows:
                r = {}
                for col, v in row.items():
                    if col == "id" or f"{table}.{col}" in UNCOMPARED:
                        continue
                    if f"{table}.{col}" in APPROX:
                        total = out.setdefault(f"~{table}.{col}", [0])
                        total[0] += v
                        continue
                    if col in refs:
                        v = refs[col][v]
                    elif table == "lake_files" and col == "key":
                        v = v.rsplit("-", 1)[0]
                    elif table == "run_profiles" and col == "data":
                        interval, parents, fids, counts = _arrays(bytes(v))
                        v = (
                            interval,
                            tuple(parents.tolist()),
                            tuple(frames[int(f)] for f in fids),
                            tuple(counts.tolist()),
                        )
                    elif table == "manifest_chunks" and col == "data":
                        # the bytes of each batch as batches.bytes: approximately
                        v = tuple(
                            e._replace(id=0, agent_id=0, bytes=0)
                            for e in unpack_chunk(SimpleNamespace(**row))
                        )
                    elif table == "run_batch_lists" and col == "data":
                        v = tuple((batches[b], t) for b, t in unpack_batch_list(bytes(v)))
                    elif isinstance(v, dict | list):
                        v = repr(_canon(v))
                    elif isinstance(v, memoryview):  # packed values: sorted by content
                        v = bytes(v)
                    r[col] = v
                norm.append(tuple(sorted(r.items())))
            out[table] = sorted(norm, key=repr)
    return out


def _canon(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _canon(x) for k, x in sorted(v.items())}
    if isinstance(v, list):
        return [_canon(x) for x in v]
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else v


def differences(a: dict[str, list[Any]], b: dict[str, list[Any]], limit: int = 3) -> list[str]:
    """What differs between two snapshots, table by table (empty: the same rows)."""
    out = []
    for table in sorted(set(a) | set(b)):
        ra, rb = a.get(table, []), b.get(table, [])
        if table.startswith("~"):
            if abs(ra[0] - rb[0]) > 0.02 * max(ra[0], rb[0]):
                out.append(f"{table}: total {ra[0]} vs {rb[0]}")
        elif ra != rb:
            sa, sb = set(ra), set(rb)
            only_a, only_b = sorted(sa - sb, key=repr)[:limit], sorted(sb - sa, key=repr)[:limit]
            out.append(
                f"{table}: {len(ra)} vs {len(rb)} rows; only in real: {only_a}; only in bulk: "
                f"{only_b}"
            )
    return out
