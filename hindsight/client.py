"""Query a Hindsight server from Python: ``hindsight.Client(url, token=None)``.

Every method maps to one REST endpoint and returns a pandas DataFrame (or a dict where the
answer is one object). A DataFrame's moments (``started_at``, ``time``, ``start``...) are
UTC datetimes; durations stay seconds. The lake's tables keep their columns as stored.
pandas and pyarrow are imported when first needed, so the SDK that runs inside Dask workers
stays light: ``pip install 'hindsight[client]'`` for them.
"""

from __future__ import annotations

import io
import json
import logging
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from datetime import date
from typing import Any

logger = logging.getLogger(__name__)


class HindsightError(Exception):
    """An error answer from the server: its HTTP status, code and message (status 0, code
    ``unreachable``: no answer came; a bad lake filter is refused before asking)."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message


def _pd() -> Any:
    import pandas as pd

    return pd


# The columns of a frame with no rows, so ``c.runs(cluster="x").id`` works on an empty
# answer too (a frame without columns has none). A frame with rows has the answer's.
RUN_COLUMNS = (
    "id",
    "name",
    "cluster",
    "session",
    "run_key",
    "status",
    "started_at",
    "finished_at",
    "makespan",
    "task_count",
    "error_count",
    "nbytes",
    "span",
    "client",
)
CLUSTER_COLUMNS = ("name", "first_seen", "last_seen", "sessions", "runs", "last_run_started_at")
SUMMARY_COLUMNS = (
    "prefix",
    "action",
    "tasks",
    "errors",
    "count",
    "total",
    "mean",
    "min",
    "p50",
    "p90",
    "p99",
    "max",
)
ERROR_COLUMNS = (
    "exception",
    "count",
    "retried",
    "messages",
    "prefixes",
    "workers",
    "keys",
    "traceback",
)
SEGMENT_COLUMNS = ("kind", "key", "prefix", "worker", "start", "stop", "seconds")
TIME_COLUMNS = (
    "worker",
    "capacity",
    "compute",
    "transfer",
    "spill",
    "other",
    "tasks",
    "nthreads",
    "idle",
)
PREFIX_HISTORY_COLUMNS = ("time", "count", "mean", "p50", "p90", "p99", "max")
CLUSTER_HISTORY_COLUMNS = (
    "cluster",
    "time",
    "runs",
    "tasks",
    "errors",
    "compute_seconds",
    "transfer_seconds",
    "disk_seconds",
    "nbytes",
)


#: Columns that hold a moment (epoch seconds on the wire): a DataFrame gives them as UTC
#: datetimes, which plot, filter and resample as times. Durations stay seconds.
TIME_COLUMN_NAMES = frozenset(
    {
        "started_at",
        "finished_at",
        "first_seen",
        "last_seen",
        "last_run_started_at",
        "time",
        "start",
        "stop",
        "compute_start",
        "compute_stop",
        "joined_at",
        "left_at",
        "first",
        "last",
    }
)


def _times(df: Any) -> Any:
    """``df`` with its moments (:data:`TIME_COLUMN_NAMES`) as UTC datetimes."""
    pd = _pd()
    for column in TIME_COLUMN_NAMES & set(df.columns):
        df[column] = pd.to_datetime(df[column], unit="s", utc=True)
    return df


def _frame(rows: list[dict[str, Any]], columns: tuple[str, ...]) -> Any:
    """``rows`` as a DataFrame, moments as UTC datetimes; with no rows, one with
    ``columns`` (and none)."""
    pd = _pd()
    return _times(pd.DataFrame(rows) if rows else pd.DataFrame(columns=list(columns)))


class Explanation(dict):  # type: ignore[type-arg]
    """``GET /v1/runs/{id}/explain``'s answer (a dict), drawn as HTML in Jupyter: the
    paragraph, then the findings with the seconds of makespan each explains."""

    def _repr_html_(self) -> str:
        from html import escape

        rows = "".join(
            f"<tr><td>{escape(str(f.get('kind')))}</td><td>{escape(str(f.get('text')))}</td>"
            f"<td style='text-align:right'>"
            f"{'' if f.get('seconds') is None else format(f['seconds'], '.2f')}</td></tr>"
            for f in self.get("findings", [])
        )
        table = (
            "<table><tr><th>kind</th><th>finding</th><th>seconds</th></tr>" + rows + "</table>"
            if rows
            else ""
        )
        return (
            f"<div class='hindsight-explain'><p><b>{escape(str(self.get('verdict')))}</b>: "
            f"{escape(str(self.get('text', '')))}</p>{table}</div>"
        )

    def __str__(self) -> str:
        lines = [f"{self.get('verdict')}: {self.get('text', '')}"]
        for f in self.get("findings", []):
            sec = "" if f.get("seconds") is None else f"{f['seconds']:+.2f} s  "
            lines.append(f"  - [{f.get('kind')}] {sec}{f.get('text')}")
        return "\n".join(lines)


class Client:
    """A client of the query API. ``token`` needs the ``read`` scope (an embedded server
    on loopback may run without tokens)."""

    def __init__(self, url: str, token: str | None = None, timeout: float = 60.0) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, not {url!r}")
        self.url = url.rstrip("/")
        self.token = token
        self.timeout = timeout

    # ------------------------------------------------------------ transport

    def _open(
        self,
        path: str,
        params: dict[str, Any] | None = None,
        *,
        method: str = "GET",
        body: Any = None,
    ) -> Any:
        query = {
            k: [_param(x) for x in v] if isinstance(v, list | tuple) else _param(v, k == "until")
            for k, v in (params or {}).items()
            if v is not None
        }
        url = f"{self.url}{path}" + (
            f"?{urllib.parse.urlencode(query, doseq=True)}" if query else ""
        )
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(url, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            return urllib.request.urlopen(req, timeout=self.timeout)  # noqa: S310
        except urllib.error.HTTPError as exc:
            body = exc.read()
            try:
                err = json.loads(body)["error"]
                raise HindsightError(exc.code, err["code"], err["message"]) from None
            except (ValueError, KeyError, TypeError):
                raise HindsightError(
                    exc.code, "http_error", body[:200].decode(errors="replace")
                ) from None
        except (urllib.error.URLError, OSError) as exc:  # no answer: status 0
            reason = getattr(exc, "reason", exc)
            raise HindsightError(0, "unreachable", f"{self.url}: {reason}") from None

    def get(self, path: str, **params: Any) -> Any:
        """GET ``path`` and decode its JSON answer."""
        with self._open(path, params) as resp:
            return json.loads(resp.read())

    def _send(self, method: str, path: str, body: Any = None) -> Any:
        with self._open(path, method=method, body=body) as resp:
            return json.loads(resp.read())

    # ------------------------------------------------------------ alerts (docs/alerts.md)

    def alert_rules(self) -> list[dict[str, Any]]:
        """The tenant's alert rules."""
        return list(self.get("/v1/alerts/rules")["rules"])

    def add_alert_rule(self, name: str, url: str, **spec: Any) -> dict[str, Any]:
        """Make an alert rule (a token with the ``admin`` scope): ``job``, ``cluster``,
        ``on_slower``, ``min_change``, ``on_failures``, ``format``. The answer's ``secret``
        (the key of the signature) is shown this once."""
        return dict(self._send("POST", "/v1/alerts/rules", {"name": name, "url": url, **spec}))

    def remove_alert_rule(self, rule_id: int) -> None:
        self._send("DELETE", f"/v1/alerts/rules/{int(rule_id)}")

    def alert_deliveries(self, **filters: Any) -> list[dict[str, Any]]:
        """Alerts posted or being retried, newest first (``rule``, ``run``, ``status``,
        ``limit``)."""
        return list(self.get("/v1/alerts/deliveries", **filters)["deliveries"])

    def _pages(
        self,
        path: str,
        key: str,
        params: dict[str, Any],
        limit: int | None,
        first: list[dict[str, Any]] | None = None,
    ) -> Iterator[dict[str, Any]]:
        """Every ``key`` item of every page (at most ``limit``); ``first`` gets the first
        page's whole body (what it says besides the items)."""
        cursor = None
        n = 0
        if limit is not None and limit <= 0:
            return
        while True:
            body = self.get(path, **params, cursor=cursor)
            if first is not None and not first:
                first.append(body)
            for item in body[key]:
                yield item
                n += 1
                if limit is not None and n >= limit:
                    return
            cursor = body.get("next_cursor")
            if not cursor:
                return

    # ------------------------------------------------------------ runs

    def clusters(self) -> Any:
        """The tenant's clusters: name, sessions, runs, first/last seen."""
        return _frame(self.get("/v1/clusters")["clusters"], CLUSTER_COLUMNS)

    def runs(self, limit: int | None = None, **filters: Any) -> Any:
        """Runs matching ``filters`` (cluster, status, name, since, until, min_duration,
        has_errors, sort), following cursors up to ``limit`` runs."""
        page = min(limit or 1000, 1000)
        rows = list(self._pages("/v1/runs", "runs", {**filters, "limit": page}, limit))
        return _frame(rows, RUN_COLUMNS)

    def run(self, run_id: str) -> dict[str, Any]:
        """One run's detail (a dict: it is one object with nested parts)."""
        return self.get(f"/v1/runs/{run_id}")

    def tasks(self, run_id: str, limit: int | None = None, **filters: Any) -> Any:
        """A run's tasks (at most ``limit``) as one DataFrame, with or without filters
        (prefix, worker, status, since, until, sort): the run's Parquet copy, or the
        matching rows of it in the same columns. With a filter they were the NDJSON
        records, in other columns (``c.tasks(r)["compute"]`` failed with one)."""
        if limit is not None:  # the server cuts the answer (a 1M-task run is not fetched)
            limit = max(limit, 0)
            filters = {**filters, "limit": max(limit, 1)}
        with self._open(f"/v1/runs/{run_id}/tasks.parquet", filters) as resp:
            frame = _times(_pd().read_parquet(io.BytesIO(resp.read())))
        return frame if limit is None else frame.head(limit)

    def summary(self, run_id: str) -> Any:
        """Per prefix and action: count, total, mean, min, p50, p90, p99, max."""
        rows = []
        for p in self.get(f"/v1/runs/{run_id}/summary")["prefixes"]:
            for action, stats in p["actions"].items():
                rows.append(
                    {
                        "prefix": p["prefix"],
                        "action": action,
                        "tasks": p["count"],
                        "errors": p["errors"],
                        **stats,
                    }
                )
        return _frame(rows, SUMMARY_COLUMNS)

    def metrics(self, run_id: str, points: int = 500, **filters: Any) -> Any:
        """Worker metric samples (downsampled): worker, name, time, value, max."""
        body = self.get(f"/v1/runs/{run_id}/metrics", points=points, **filters)
        rows = [
            {"worker": s["worker"], "name": s["name"], **p}
            for s in body["series"]
            for p in s["points"]
        ]
        return _times(_pd().DataFrame(rows, columns=["worker", "name", "time", "value", "max"]))

    def progress(self, run_id: str, buckets: int = 50) -> Any:
        """Completed tasks per prefix (columns) per time bucket (index: bucket end)."""
        body = self.get(f"/v1/runs/{run_id}/progress", buckets=buckets)
        pd = _pd()
        return pd.DataFrame(
            body["prefixes"], index=pd.to_datetime(body["times"], unit="s", utc=True)
        )

    def graph(self, run_id: str) -> tuple[Any, Any]:
        """(nodes, edges) DataFrames of the run's task graph."""
        body = self.get(f"/v1/runs/{run_id}/graph")
        pd = _pd()
        return pd.DataFrame(body["nodes"]), pd.DataFrame(
            body["edges"], columns=["source", "target"]
        )

    def errors(self, run_id: str) -> Any:
        """Erred tasks grouped by exception."""
        return _frame(self.get(f"/v1/runs/{run_id}/errors")["groups"], ERROR_COLUMNS)

    def critical_path(self, run_id: str) -> Any:
        """The critical path's segments in time order (kind, key, worker, start, stop, seconds)."""
        return _frame(self.get(f"/v1/runs/{run_id}/critical-path")["segments"], SEGMENT_COLUMNS)

    def time(self, run_id: str) -> Any:
        """Where the time went, per worker: compute, spill, other and idle thread-seconds, and
        transfer seconds (on the worker's event loop, not taken from its threads)."""
        return _frame(self.get(f"/v1/runs/{run_id}/time")["workers"], TIME_COLUMNS)

    def cluster_time(self, cluster: str, **window: Any) -> Any:
        """Where the time went on a cluster, per worker, over runs in ``since``/``until``."""
        return _frame(self.get(f"/v1/clusters/{cluster}/time", **window)["workers"], TIME_COLUMNS)

    def regressions(self, run_id: str, **params: Any) -> Any:
        """Prefixes whose p90 moved beyond ``threshold`` % against ``baseline`` earlier runs.
        ``.attrs["baseline_runs"]``: the ids of the runs compared against (none: nothing
        to compare with, which an empty frame alone does not tell from no regression)."""
        body = self.get(f"/v1/runs/{run_id}/regressions", **params)
        df = _pd().DataFrame(
            body["regressions"],
            columns=["prefix", "baseline_p90", "p90", "change_pct", "direction"],
        )
        df.attrs["baseline_runs"] = body.get("baseline_runs", [])
        return df

    def explain(self, run_id: str, baseline: str | None = None) -> Explanation:
        """Why the run was slower or faster than its job's usual runs (or than run
        ``baseline``): the verdict, the findings ranked by seconds of makespan explained,
        a paragraph (docs/explain.md). Shown as HTML in Jupyter."""
        return Explanation(self.get(f"/v1/runs/{run_id}/explain", baseline=baseline))

    def compare(self, a: str, b: str, action: str = "compute") -> Any:
        """Per-prefix deltas of run ``b`` against run ``a`` (tasks, mean, p90, total)."""
        body = self.get("/v1/compare", a=a, b=b, action=action)
        rows = []
        for p in body["prefixes"]:
            row: dict[str, Any] = {
                "prefix": p["prefix"],
                "status": "both",
                "seconds": p.get("seconds"),  # of makespan its change explains
            }
            for k in ("tasks", "mean", "p90", "total"):
                row |= {f"{k}_a": p[k]["a"], f"{k}_b": p[k]["b"], f"{k}_delta": p[k]["delta"]}
            rows.append(row)
        rows += [{"prefix": p, "status": "new"} for p in body["new_prefixes"]]
        rows += [{"prefix": p, "status": "missing"} for p in body["missing_prefixes"]]
        df = _pd().DataFrame(rows)
        df.attrs["makespan"] = body["makespan"]
        return df

    def prefix_history(self, prefix: str, **params: Any) -> Any:
        """A prefix's duration quantiles per hour or day across clusters."""
        points = self.get("/v1/history/prefixes", prefix=prefix, **params)["points"]
        return _frame(points, PREFIX_HISTORY_COLUMNS)

    def cluster_history(self, **params: Any) -> Any:
        """Per cluster per hour or day: runs, tasks, errors, seconds."""
        return _frame(self.get("/v1/history/clusters", **params)["points"], CLUSTER_HISTORY_COLUMNS)

    # ------------------------------------------------------------ why slow

    def profile(
        self,
        run_id: str,
        prefix: str | None = None,
        worker: str | None = None,
        format: str = "json",
    ) -> Any:
        """A run's statistical profile (of one prefix and/or worker). ``format="json"``
        gives a dict: ``samples``, ``interval`` (seconds per sample), ``top`` (the hottest
        functions) and ``tree`` (nested frames: ``name``, ``filename``, ``samples``,
        ``self``, ``children``); ``"collapsed"`` folded-stack text for flamegraph.pl,
        speedscope or inferno; ``"speedscope"`` speedscope's JSON."""
        return self._profile(f"/v1/runs/{run_id}/profile", format, prefix=prefix, worker=worker)

    def profiles(
        self,
        prefix: str | None = None,
        name: str | None = None,
        format: str = "json",
        **window: Any,
    ) -> Any:
        """The merged profile of a prefix and/or of a job's runs over runs started in
        ``since``/``until`` (also ``cluster``, ``runs``), in the formats of :meth:`profile`."""
        return self._profile("/v1/profiles", format, prefix=prefix, name=name, **window)

    def profile_diff(self, a: str, b: str, prefix: str | None = None) -> dict[str, Any]:
        """Run ``b``'s profile against run ``a``'s: a tree of frames with samples and
        share of each run (``a``, ``b``, ``share_a``, ``share_b``, ``delta``)."""
        return self.get("/v1/compare/profile", a=a, b=b, prefix=prefix)

    def _profile(self, path: str, format: str, **params: Any) -> Any:
        if format == "collapsed":
            with self._open(path, {**params, "format": format}) as resp:
                return resp.read().decode()
        return self.get(path, **params, format=format)

    def activity(self, run_id: str) -> Any:
        """Dask's fine performance metrics of a run: context, prefix, activity, unit,
        value (e.g. seconds of ``thread-cpu`` of prefix ``read-parquet``). Totals by
        activity are in ``df.attrs["totals"]``; pivot for seconds by activity and prefix:
        ``df[df.unit == "seconds"].pivot_table("value", "prefix", "activity", "sum")``."""
        body = self.get(f"/v1/runs/{run_id}/activity")
        df = _pd().DataFrame(
            body["activity"], columns=["context", "prefix", "activity", "unit", "value"]
        )
        df.attrs["totals"] = body["totals"]
        return df

    def state(self, run_id: str, at: Any = None) -> dict[str, Any]:
        """Replay: the run at ``at`` (epoch seconds, ISO 8601 or a datetime; default now,
        as on the route) as Dask's
        status page showed it. A dict: ``time``, ``sampled_at`` (the sample it comes
        from; both UTC datetimes), ``workers`` (DataFrame: worker, managed, unmanaged,
        spilled, limit bytes, processing), ``prefixes`` (DataFrame: prefix, waiting,
        processing, memory, released, erred), ``thresholds`` (the session's memory fractions) and
        ``samples`` (the run's first and last sample times)."""
        body = self.get(f"/v1/runs/{run_id}/state", at=at)
        pd = _pd()
        workers = [
            {"worker": w["worker"], **w["memory"], "processing": w["processing"]}
            for w in body["workers"]
        ]
        moments = {
            k: None if body.get(k) is None else pd.Timestamp(body[k], unit="s", tz="UTC")
            for k in ("time", "sampled_at")
        }
        return {
            **body,
            **moments,
            "workers": pd.DataFrame(
                workers,
                columns=["worker", "managed", "unmanaged", "spilled", "limit", "processing"],
            ),
            "prefixes": pd.DataFrame(
                body["prefixes"],
                columns=["prefix", "waiting", "processing", "memory", "released", "erred"],
            ),
        }

    def activity_history(
        self, prefix: str | None = None, name: str | None = None, **params: Any
    ) -> Any:
        """Seconds by activity per hour or day of run start (``bucket``), of a prefix and/or
        a job name: one row per time and activity, with ``runs``, ``total`` and ``mean``
        (per run)."""
        body = self.get("/v1/history/activity", prefix=prefix, name=name, **params)
        rows = [
            {"time": p["time"], "runs": p["runs"], "activity": a, **v}
            for p in body["points"]
            for a, v in p["activity"].items()
        ]
        return _times(_pd().DataFrame(rows, columns=["time", "runs", "activity", "total", "mean"]))

    def trace(self, run_id: str) -> dict[str, Any]:
        """The run as Chrome trace-event JSON (save it and open it in ui.perfetto.dev)."""
        return self.get(f"/v1/runs/{run_id}/trace")

    # ------------------------------------------------------------ logs, streams, workers

    def logs(self, run_id: str, limit: int | None = None, **filters: Any) -> Any:
        """The run's log records, oldest first: time, level, worker (``scheduler`` for the
        scheduler's), logger, message, key (the task that logged it). Filters: ``level``
        (that level and above), ``worker``, ``since``, ``until``, ``q`` (text, any case);
        every page is fetched unless ``limit``."""
        rows = list(
            self._pages(f"/v1/runs/{run_id}/logs", "logs", {**filters, "limit": 1000}, limit)
        )
        return _times(
            _pd().DataFrame(rows, columns=["time", "level", "worker", "logger", "message", "key"])
        )

    def streams(self, run_id: str) -> Any:
        """The streams the run's tasks emitted values on (``hindsight.emit``): stream,
        count, numeric (values that are numbers), workers, first, last."""
        return _times(
            _pd().DataFrame(
                self.get(f"/v1/runs/{run_id}/streams")["streams"],
                columns=["stream", "count", "numeric", "workers", "first", "last"],
            )
        )

    def stream(self, run_id: str, stream: str, limit: int | None = None) -> Any:
        """One stream's values in time order: time, worker, key, value (as emitted). The
        numeric values per interval (time, count, sum, mean, min, max) are in
        ``df.attrs["aggregate"]`` (None if no value is a number)."""
        path = f"/v1/runs/{run_id}/streams/{urllib.parse.quote(stream, safe='')}"
        first: list[dict[str, Any]] = []
        rows = list(self._pages(path, "values", {"limit": 1000}, limit, first))
        df = _times(_pd().DataFrame(rows, columns=["time", "worker", "key", "value"]))
        agg = first[0]["aggregate"]
        df.attrs["aggregate"] = (
            None
            if agg is None
            else _times(
                _pd().DataFrame(
                    agg["points"], columns=["time", "count", "sum", "mean", "min", "max"]
                )
            )
        )
        return df

    def lifecycle(self, run_id: str) -> dict[str, Any]:
        """The session's facts and the run's workers: ``session`` (versions, config excerpt,
        scheduler address) and ``workers`` (DataFrame: address, name, joined_at, left_at,
        cause, reason, ...; ``took_down`` lists the run's tasks a departure took down)."""
        body = self.get(f"/v1/runs/{run_id}/lifecycle")
        workers = _pd().DataFrame(body["workers"])
        # the documented columns, even when no worker has left (they came and went with it)
        for column in ("joined_at", "left_at", "cause", "reason", "took_down"):
            if column not in workers:
                workers[column] = None
        return {**body, "workers": _times(workers)}

    # ------------------------------------------------------------ the history lake

    def lake(
        self,
        table: str = "tasks",
        *,
        columns: list[str] | None = None,
        direct: bool = False,
        endpoint_url: str | None = None,
        region: str | None = None,
        files_per_partition: int = 1,
        **filters: Any,
    ) -> Any:
        """A ``dask.dataframe`` of a lake table (tasks, metrics, runs, streams) across runs
        and clusters, one partition per lake file the filters keep (docs/lake.md).

        Filters: cluster, since, until, run, session, prefix, status, worker, name, stream,
        key (a value or a list: any of them), min_/max_duration (seconds of compute),
        min_/max_nbytes, min_/max_value, min_makespan. Nothing is read until you compute;
        on a Dask cluster every worker reads its partitions. Each partition is read
        through the query service (your token, your tenant), or with ``direct=True``
        straight from the blob store with the worker's own credentials (operators;
        ``endpoint_url`` for MinIO and the like). A lake of many small files (a cluster's
        quiet days) scans faster with ``files_per_partition`` > 1: Dask pays a few
        milliseconds per task, a file of a few thousand rows takes about as long to read."""
        import dask.dataframe as dd

        from hindsight import lake as _lake

        f = _filters(filters)
        params = {**f.params(), "columns": ",".join(columns) if columns else None}
        plan = self.get(f"/v1/lake/{table}/files", **params)
        meta = _lake.to_pandas(_lake_schema(plan["schema"]).empty_table())
        if not plan["files"]:
            return dd.from_pandas(meta, npartitions=1)
        reader: Any
        if direct:
            reader = _lake.LocationPart(table, f, columns, endpoint_url, region)
        else:
            reader = _ServicePart(self.url, self.token, self.timeout, params)
        files = plan["files"]
        if files_per_partition > 1:
            groups = [
                files[i : i + files_per_partition]
                for i in range(0, len(files), files_per_partition)
            ]
            return dd.from_map(_Concat(reader), groups, meta=meta, enforce_metadata=False)
        return dd.from_map(reader, files, meta=meta, enforce_metadata=False)

    def lake_rows(
        self,
        table: str = "tasks",
        *,
        columns: list[str] | None = None,
        sort: str | None = None,
        limit: int | None = None,
        **filters: Any,
    ) -> Any:
        """Rows of a lake table as a pandas DataFrame, filtered, sorted and limited by the
        query service: ``lake_rows(prefix="read_parquet", sort="-duration", limit=100)``
        is the 100 slowest read_parquet tasks. Filters as in :meth:`lake`."""
        import pyarrow as pa

        f = _filters(filters)
        params = {
            **f.params(),
            "columns": ",".join(columns) if columns else None,
            "sort": sort,
            "limit": limit,
            "format": "arrow",
        }
        with self._open(f"/v1/lake/{table}", params) as resp:
            return pa.ipc.open_stream(resp.read()).read_all().to_pandas()


def _filters(filters: dict[str, Any]) -> Any:
    """The lake's filters, or the error the service gives a bad one (a bare ValueError)."""
    from hindsight import lake as _lake

    try:
        return _lake.Filters.from_kwargs(**filters)
    except (ValueError, TypeError) as exc:
        raise HindsightError(400, "invalid_parameter", str(exc)) from None


def _lake_schema(encoded: str) -> Any:
    import base64

    import pyarrow as pa

    return pa.ipc.read_schema(pa.py_buffer(base64.b64decode(encoded)))


class _Concat:
    """Reads several planned files into one partition (picklable)."""

    def __init__(self, reader: Any) -> None:
        self.reader = reader

    def __call__(self, files: list[dict[str, Any]]) -> Any:
        import pandas as pd

        return pd.concat([self.reader(f) for f in files], ignore_index=True)


class _ServicePart:
    """Reads one planned lake file through the query service (a Dask task: picklable)."""

    def __init__(self, url: str, token: str | None, timeout: float, params: dict[str, Any]) -> None:
        self.url, self.token, self.timeout, self.params = url, token, timeout, params

    def __call__(self, file: dict[str, Any]) -> Any:
        import pyarrow as pa

        from hindsight.lake import to_pandas

        client = Client(self.url, self.token, self.timeout)
        with client._open(file["path"], self.params) as resp:
            return to_pandas(pa.ipc.open_stream(resp.read()).read_all())


def _param(value: Any, day_end: bool = False) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, date) or hasattr(value, "timestamp"):
        # epoch seconds, a naive time read as UTC everywhere (as the server reads ISO text
        # without a zone): runs(since=dt) sent str(dt), state(at=dt) the local reading; a
        # date as ``until`` includes that day, as the server reads "2026-11-21"
        from hindsight.lake import _epoch

        return repr(_epoch(value, day_end))
    return str(value)
