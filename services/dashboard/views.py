"""Dashboard pages (HTML), served by the query service and the embedded server.

Same auth as the API: the read scope, from a bearer header or from a token the user enters
once on /login (kept in an HttpOnly, SameSite=Strict cookie). An embedded server on
loopback without tokens needs neither.
"""

from __future__ import annotations

import functools
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import bokeh.util.paths
import msgspec
from flask import (
    Blueprint,
    Response,
    abort,
    redirect,
    render_template,
    request,
    send_from_directory,
    url_for,
)
from markupsafe import Markup
from sqlalchemy import func, select

from services.common.params import arg, choice_arg, float_arg, name_arg, time_arg
from services.common.web import LOGIN_COOKIE, ApiError, db, store
from services.dashboard import plots, side_plots, task_stream, time_plots, why_plots
from services.dashboard.colours import PrefixColours
from storage.analysis import flame, tasks
from storage.analysis.outcome import facts_of
from storage.analysis.profile import Profile, merge_into
from storage.analysis.runfacts import DEFAULT_SPAN, display_name
from storage.core import models as m
from storage.core.tokens import Principal
from storage.query import activity, explain, history, replay
from storage.query import compare as comparison
from storage.query import runs as queries
from storage.query.runs import BadCursor, RunFilters, makespan_column
from storage.query.task_stream import MAX_RECTS
from storage.runs import profiles, runcode, runfile, runlogs, streamtiles
from storage.runs.facts import grouped_graph, page_facts

bp = Blueprint(
    "dashboard",
    __name__,
    template_folder="templates",
    static_folder="static",
    static_url_path="/assets/ui",
)

COOKIE = LOGIN_COOKIE
BOKEH_STATIC = Path(bokeh.util.paths.bokehjs_path())


def _warm_up(state: Any) -> None:
    """Pay at start-up, not on the first run page a user opens, for what the first page
    loads lazily: pyarrow's dataset module (and pandas with it, ~0.4 s) and its Parquet
    reader (~0.1 s more on a first read), SQLAlchemy's mapper configuration (~0.15 s), the
    run page's template, and Bokeh's per-class property defaults of every figure the page
    draws (a tiny run's whole page built once: with only some figures warmed, the first
    page of a 100k-task run took ~0.52 s on the server, later ones ~0.37 s). The figures
    are warmed once per process, the template once per app."""
    import pyarrow.dataset  # noqa: F401
    from sqlalchemy.orm import configure_mappers

    configure_mappers()
    _warm_figures()
    state.app.jinja_env.get_template("run.html")


@functools.cache
def _warm_figures() -> None:
    """Once per process (tests create many apps)."""
    plots.warm_up()
    data = runfile.sample_run(through_parquet=True)
    facts = facts_of(data)
    metrics = tasks.metric_series(data, METRIC_POINTS)
    items = plots.run_page_items(data, facts["critical"], facts["progress"], metrics)
    time_plots.time_plots_item(
        facts["progress"], metrics, items["origin"], items["x_end"], PrefixColours([])
    )


class LoginRequired(Exception):
    """The page needs a read token the browser has not given."""


def principal() -> Principal:
    st = store()
    if st.open_principal is not None:
        return st.open_principal
    header = request.headers.get("Authorization", "")
    token = (
        header[7:].strip()
        if header.lower().startswith("bearer ")
        else request.cookies.get(COOKIE, "")
    )
    found = st.principal_for(token) if token else None
    if found is None or "read" not in found.scopes:
        raise LoginRequired()
    return found


class ScriptJson(Markup):
    """JSON text for a <script> block, false when it is ``null`` (nothing to draw): the
    templates' ``{% if plot %}`` then show their "nothing to show" text (the string "null"
    was true, and an empty box was drawn instead)."""

    def __bool__(self) -> bool:
        return str(self) != "null"


def script_json(obj: Any) -> ScriptJson:
    """JSON for a <script> block: key order kept (BokehJS needs each model defined before it
    is referenced, which sorted keys break) and ``<>&`` escaped so data cannot close the
    block or open a comment (quotes are harmless inside a script). msgspec encodes a run
    page's ~11 MB in ~6 ms (``json.dumps`` took ~30); Bokeh's JSON carries no bare NaN."""
    text = _encode(obj)
    for ch, esc in ((b"<", b"\\u003c"), (b">", b"\\u003e"), (b"&", b"\\u0026")):
        text = text.replace(ch, esc)
    return ScriptJson(text.decode())


_encode = msgspec.json.Encoder().encode


@bp.app_template_filter("when")
def when(ts: float | None) -> str:
    if ts is None:
        return "—"
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S")


@bp.app_template_filter("seconds")
def seconds(value: float | None) -> str:
    if value is None:
        return "—"
    if value < 1:
        return f"{value * 1000:.0f} ms"
    if value < 120:
        return f"{value:.1f} s"
    return f"{value / 60:.1f} min"


@bp.errorhandler(LoginRequired)
def _to_login(exc: LoginRequired) -> Any:
    return redirect(url_for("dashboard.login", next=request.full_path.rstrip("?")))


@bp.get("/")
def runs_page() -> Any:
    p = principal()
    try:
        filters = RunFilters(
            cluster=name_arg("cluster"),
            status=choice_arg("status", queries.RUN_STATUSES),
            since=time_arg("since"),
            until=time_arg("until"),
        )
        sort = choice_arg("sort", queries.RUN_SORTS) or "-started_at"  # was ignored
        runs, next_cursor = queries.list_runs(db(), p.tenant_id, filters, 50, arg("cursor"), sort)
    except (ApiError, BadCursor) as exc:
        message = exc.message if isinstance(exc, ApiError) else "bad cursor"
        return render_template("error.html", message=message), 400
    clusters = [c["name"] for c in queries.list_clusters(db(), p.tenant_id)]
    args = {k: v for k, v in request.args.items() if k != "cursor" and v}
    # Dask's span "default" names no job (its runs are fingerprinted by their prefixes)
    named = {r["name"] for r in runs if r["name"] and r["name"] != DEFAULT_SPAN}
    trends = name_trends(p.tenant_id, named)
    for r in runs:
        r["trend"] = sparkline(trends.get(r["name"], []), r["id"]) if r["name"] in named else None
    return render_template(
        "runs.html",
        runs=runs,
        clusters=clusters,
        filters=filters,
        args=args,
        sort=sort,
        next_cursor=next_cursor,
    )


TREND_RUNS = 20


def name_trends(tenant_id: int, names: set[str]) -> dict[str, list[tuple[str, float]]]:
    """The latest makespans of each named job on the page, oldest first, in one query (a
    named run's fingerprint is its name)."""
    if not names:
        return {}
    ranked = (
        select(
            m.Run.name,
            m.Run.public_id,
            m.Run.started_at,
            makespan_column().label("makespan"),
            func.row_number()
            .over(partition_by=m.Run.name, order_by=m.Run.started_at.desc())
            .label("n"),
        )
        .where(m.Run.tenant_id == tenant_id, m.Run.name.in_(sorted(names)))
        .subquery()
    )
    out: dict[str, list[tuple[str, float]]] = {}
    for name, rid, _, makespan, _ in db().execute(
        select(ranked).where(ranked.c.n <= TREND_RUNS).order_by(ranked.c.name, ranked.c.started_at)
    ):
        if makespan is not None:
            out.setdefault(name, []).append((rid, makespan))
    return out


def sparkline(
    points: list[tuple[str, float]], current: str, width: int = 90, height: int = 18
) -> Markup | None:
    """An inline SVG of a job's makespans, this run's point in red."""
    if len(points) < 2:
        return None
    values = [v for _, v in points]
    lo, hi = min(values), max(values)
    span = (hi - lo) or 1.0
    step = (width - 4) / (len(points) - 1)
    xy = [(2 + i * step, height - 2 - (v - lo) / span * (height - 4)) for i, v in enumerate(values)]
    line = " ".join(f"{x:.1f},{y:.1f}" for x, y in xy)
    dots = "".join(
        f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.2" fill="#d62728"/>'
        for (rid, _), (x, y) in zip(points, xy, strict=True)
        if rid == current
    )
    title = f"makespan of the last {len(points)} runs of this job: {lo:.3g}-{hi:.3g} s"
    return Markup(
        f'<svg class="trend" width="{width}" height="{height}" role="img" '
        f'aria-label="{title}"><title>{title}</title>'
        f'<polyline points="{line}" fill="none" stroke="#1f77b4" stroke-width="1.2"/>{dots}</svg>'
    )


@bp.get("/runs/<run_id>")
def run_page(run_id: str) -> Any:
    found = _found_or_none(principal(), run_id)
    if found is None:
        return render_template("error.html", message=f"no run {run_id!r}"), 404
    run, cluster, session = found
    detail = queries.run_detail(
        db(), run, cluster, session, silence=store().settings.silent_agents_seconds
    )
    # tables read as a panel needs them: a big finished run's panels come from its stored
    # facts, rollups and tiles, not its tasks table
    data = runfile.load_run(db(), store().blobs, run, lazy=True)
    facts = page_facts(db(), store().blobs, run, data)
    critical = facts["critical"]
    live = detail["status"] == "running"
    tiles, big, most = _stream_tiles(run, data, live)
    colours = _page_colours(detail, data, tiles, big)
    items = plots.run_page_items(
        data,
        critical,
        facts["progress"],
        # a small run's time range is fitted to its samples too; a big run's is its span
        None if big else tasks.metric_series(data, METRIC_POINTS),
        inline_keys=live,
        colours=colours,
        windowed=task_stream.windowed_stream(
            tiles, f"/v1/runs/{run.public_id}/task-stream", colours, min(most, MAX_RECTS)
        )
        if big
        else None,
    )
    # the plots under the stream, fetched once the first view is drawn
    time_plots_url = url_for(
        "dashboard.run_time_plots",
        run_id=run.public_id,
        origin=repr(float(items["origin"])),
        end=repr(float(items["x_end"])),
    )
    dag, grouped = items["dag"], None
    if dag is None and items["counts"]["dag_nodes"] > plots.DAG_MAX_NODES:
        # past the node budget: the graph's shape by prefix, stored when the run finished
        grouped = grouped_graph(db(), store().blobs, run, data)
        dag = plots.grouped_dag_item(grouped, colours)
    stream = items["stream"]
    if not live and not big:  # the page requests the hover's keys (``stream_keys``)
        stream = {**stream, "keys_url": f"/runs/{run.public_id}/stream-keys"}
    same_job = [
        queries.run_summary(r, cluster, session) for r in comparison.previous_runs(db(), run, 19)
    ]
    trend = plots.makespan_trend(
        [*same_job, queries.run_summary(run, cluster, session)], run.public_id
    )
    return render_template(
        "run.html",
        run=detail,
        trend=script_json(trend),
        previous=same_job[0] if same_job else None,
        timeline=script_json(items["timeline"]),
        time_plots=script_json(time_plots_url),
        stream=script_json({"task-stream-source": stream}),
        dag=script_json(dag),
        dag_grouped=grouped if dag is not None else None,
        counts=items["counts"],
        critical=critical,
        errors=facts["errors"],
        outcome=facts.get("outcome"),
        unclosed=detail["completeness"].get("unclosed_worker_agents", []),
        dag_max=plots.DAG_MAX_NODES,
        live=live,
        refresh=_refresh_seconds(),
        **why_slow(run, colours),
        **side_records(run, data),
        **replay_slider(run, detail, items["origin"], colours),
        explained=None if live else explained(run),
    )


#: Points a time plot's series is downsampled to (min-max envelopes per point).
METRIC_POINTS = 300


def _stream_tiles(run: m.Run, data: runfile.RunData, live: bool) -> tuple[Any, bool, int]:
    """A run's task-stream tiles (None while it runs), whether its page fetches the stream
    in windows (more start/stops than ``page_stream_rects``), and that setting."""
    tiles = None if live else streamtiles.ensure(db(), store().blobs, run, lambda: data.tasks)
    most = store().settings.page_stream_rects
    return tiles, tiles is not None and tiles["count"] > most, most


def _page_colours(
    detail: dict[str, Any], data: runfile.RunData, tiles: Any, big: bool
) -> PrefixColours:
    """One colour per prefix, the same in every plot of a run page (and of its time plots,
    fetched apart)."""
    named = tiles["prefixes"] if big else data.tasks.column("prefix").to_pylist()
    return PrefixColours([*named, *(p["prefix"] for p in detail["prefixes"])])


@bp.get("/runs/<run_id>/time-plots")
def run_time_plots(run_id: str) -> Any:
    """The run page's plots under its task stream (progress, memory, CPU, tasks processing)
    as a Bokeh JSON item (``null``: none), which the page fetches once its first view is
    drawn: they were most of the browser's work before it (6 of a page's 7 plots laid out
    and painted), and of the server's. ``origin`` and ``end``: the stream's time origin
    and its range's end, which these plots share."""
    found = _found_or_none(principal(), run_id)
    if found is None:
        raise ApiError(404, "not_found", f"no run {run_id!r}")
    origin, end = float_arg("origin"), float_arg("end", lo=0.0)
    if origin is None or end is None:
        raise ApiError(400, "invalid_parameter", "origin and end are required")
    run, cluster, session = found
    detail = queries.run_detail(
        db(), run, cluster, session, silence=store().settings.silent_agents_seconds
    )
    data = runfile.load_run(db(), store().blobs, run, lazy=True)
    facts = page_facts(db(), store().blobs, run, data)
    tiles, big, _ = _stream_tiles(run, data, detail["status"] == "running")
    item = time_plots.time_plots_item(
        facts["progress"],
        tasks.metric_series(data, METRIC_POINTS),
        origin,
        end,
        _page_colours(detail, data, tiles, big),
    )
    return Response(_encode(item), mimetype="application/json")


def explained(run: m.Run) -> dict[str, Any]:
    """The run's explanation (stored when it finished) and, per top finding, a link to its
    evidence: the profile on this page, the prefix's history, the compare page against
    the latest usual run."""
    out = explain.explanation(db(), store().blobs, run)
    usual = out["baseline"]["runs"][-1] if out["baseline"]["runs"] else None
    compare = url_for("dashboard.compare_page", a=usual, b=run.public_id) if usual else None
    top = []
    for f in out["findings"][:3]:
        if f["kind"] == "profile":
            link = "#profile"
        elif f["kind"] in ("step", "data") and f["prefix"]:
            link = url_for("dashboard.history_page", prefix=f["prefix"], name=run.name)
        elif f["kind"] == "activity":
            link = "#activity"
        else:
            link = compare
        top.append({**f, "link": link})
    return {**out, "top": top, "compare": compare}


@bp.get("/runs/<run_id>/stream-keys")
def stream_keys(run_id: str) -> Any:
    """The run's task keys in the order of its task stream's ``k`` indices (a JSON array),
    which the run page requests while it builds its figures: they were half of a 100k-task
    run's page (5.7 of 11.3 MB), read before anything was drawn."""
    found = _found_or_none(principal(), run_id)
    if found is None:
        raise ApiError(404, "not_found", f"no run {run_id!r}")
    data = runfile.load_run(db(), store().blobs, found[0])
    return Response(
        msgspec.json.encode(task_stream.stream_keys(data.tasks)), mimetype="application/json"
    )


def replay_slider(
    run: m.Run, detail: dict[str, Any], origin: float, colours: PrefixColours
) -> dict[str, Any]:
    """The replay slider's range (the run's state samples) and what its script needs, its
    prefixes in the page's ``colours``."""
    samples = replay.sample_times(db(), run, store().blobs)
    if not samples["samples"]:
        return {"replay": None}
    first, last = samples["first"], samples["last"]
    names = {p["prefix"] for p in detail["prefixes"]}
    last_state = replay.state_at(db(), run, last, blobs=store().blobs)
    names |= {p["prefix"] for p in last_state["prefixes"]}
    opts = {
        "url": f"/v1/runs/{run.public_id}/state",
        "start": first,
        "last": last,
        "origin": origin,
        # "s into the run" counts from the run's start, not the first sample: the label
        # reads where the cursor stands on the task stream's axis
        "run_start": run.started_at if run.started_at is not None else first,
        "colours": {name: colours[name] for name in sorted(names)},
    }
    return {"replay": {**samples, "opts": script_json(opts)}}


def why_slow(run: m.Run, colours: PrefixColours) -> dict[str, Any]:
    """The run page's profile flame graph, fine-performance-metrics view and code, its
    prefixes in the page's ``colours``."""
    trees = profiles.load_prefixes(db(), store().blobs, run)
    whole = Profile()
    for tree in trees.values():
        merge_into(whole, tree)
        whole.interval = tree.interval
    hottest = [f for f in flame.top(whole, 10) if f["self"]]
    merged = why_plots.by_prefix(trees)
    act = activity.run_activity(db(), run.id)
    return {
        "profile": script_json(
            why_plots.flame_graph(
                merged,
                "Profile: samples by task prefix and call stack "
                "(click a frame to zoom in, reset to zoom out)",
                "profile",
                colours,
            )
        ),
        "profile_samples": merged.samples,
        "profile_seconds": merged.samples * merged.interval,
        "hottest": hottest,
        "activity_plot": script_json(why_plots.activity_chart(act["activity"], colours=colours)),
        "activity_totals": [t for t in act["totals"] if t["unit"] == "seconds"],
        "activity_partial": {p: c for p, c in act["coverage"].items() if c < activity.FULL},
        "code": runcode.run_code(db(), run.id),
    }


#: Log records shown on the run page (the rest through the API, filtered and paged).
PAGE_LOGS = 200


def side_records(run: m.Run, data: runfile.RunData) -> dict[str, Any]:
    """The run page's log records, emitted values (plot), workers and session facts."""
    extras = runlogs.load(db(), store().blobs, run)
    logs = runlogs.log_page(extras.logs, runlogs.LogFilters(), 0, PAGE_LOGS)
    streams = runlogs.stream_names(extras.streams)
    numeric = sorted((s for s in streams if s["numeric"]), key=lambda s: -s["numeric"])
    series = []
    for s in numeric[: side_plots.MAX_PLOTTED]:
        agg = runlogs.aggregate(runlogs.one_stream(extras.streams, s["stream"]), 60)
        if agg is not None:
            series.append((s["stream"], agg))
    t0 = runlogs.window(run)[0]
    return {
        "logs": logs,
        "streams": streams,
        "streams_plot": script_json(side_plots.streams_chart(series, t0)),
        "streams_unplotted": len(numeric) - len(series),
        "lifecycle": runlogs.lifecycle(db(), store().blobs, run, lambda: data.tasks),
        "causes": runlogs.CAUSES,
        "session_info": runlogs.session_facts(db(), run) or {},
    }


def _refresh_seconds() -> float:
    """How often a live page polls: ``?refresh=S`` (0.5 to 600), default 5."""
    try:
        value = float(request.args.get("refresh", "5"))
    except ValueError:
        return 5.0
    return min(600.0, max(0.5, value)) if value == value else 5.0


def _found_or_none(p: Principal, run_id: str | None) -> Any:
    if not run_id or len(run_id) > 64:
        return None
    return queries.find_run(db(), p.tenant_id, run_id)


#: Runs a "compare" of more than two offers the pairs of.
MAX_PICKED = 6


def _pick_two(found: list[Any]) -> str:
    """A page of the pairs of the ticked runs, each earlier one as A."""
    runs = sorted(
        (
            {
                "id": run.public_id,
                "label": display_name(run.name, run.run_key) or run.run_key,
                "started_at": run.started_at,
            }
            for run, _c, _s in found
        ),
        key=lambda r: r["started_at"] or 0.0,
    )
    pairs = [(a, b) for i, a in enumerate(runs) for b in runs[i + 1 :]]
    return render_template("compare_pick.html", runs=runs, pairs=pairs)


@bp.get("/compare")
def compare_page() -> Any:
    """Two runs side by side: facts, per-prefix deltas (highlighted past 20%), task streams."""
    p = principal()
    ids = request.args.getlist("run") or [request.args.get("a", ""), request.args.get("b", "")]
    ids = [i for i in ids if i]
    if len(ids) < 2:
        return render_template("error.html", message="pick two runs to compare"), 400
    found = [_found_or_none(p, i) for i in ids[:MAX_PICKED]]
    if any(f is None for f in found):
        return render_template("error.html", message="no such run"), 404
    if len(ids) > 2:  # ticked more than two in the runs list: offer the pairs
        return _pick_two(found), 400
    if request.args.getlist("run"):  # ticked in the runs list: the earlier run is A, as
        # on a run page's "compare with the previous run" (newest-first order made a
        # slowdown read as "better")
        found.sort(key=lambda f: (f[0].started_at is None, f[0].started_at or 0.0))
    (a, ca, sa), (b, cb, sb) = found  # type: ignore[misc]
    result = comparison.compare(db(), a, b)
    datas = [runfile.load_run(db(), store().blobs, r, lazy=True) for r in (a, b)]
    # a big finished run's stream is fetched by the page in windows, as on its run page,
    # and its tasks are not read here (a 10^7-task run's are gigabytes)
    most = store().settings.page_stream_rects
    indexes = [
        streamtiles.ensure(db(), store().blobs, r, lambda d=d: d)
        for r, d in zip((a, b), datas, strict=True)
    ]
    big = [i is not None and i["count"] > most for i in indexes]
    tables = [None if large else d.tasks for d, large in zip(datas, big, strict=True)]
    colours = PrefixColours(
        [
            p
            for t, i, large in zip(tables, indexes, big, strict=True)
            for p in (i["prefixes"] if large else t.column("prefix").to_pylist())
        ]
    )
    windowed = tuple(
        task_stream.windowed_stream(
            i, f"/v1/runs/{r.public_id}/task-stream", colours, min(most, MAX_RECTS)
        )
        if large
        else None
        for r, i, large in zip((a, b), indexes, big, strict=True)
    )
    streams, stream_data = plots.side_by_side(
        tables[0],
        tables[1],
        display_name(a.name, a.run_key) or a.run_key,
        display_name(b.name, b.run_key) or b.run_key,
        windowed,  # type: ignore[arg-type]
        colours,
    )
    diff = flame.diff(profiles.load(db(), store().blobs, a), profiles.load(db(), store().blobs, b))
    title = (
        "Profile of B against A: widths are B's samples; red where B spends a larger share,"
        " blue smaller"
    )
    return render_template(
        "compare.html",
        a=queries.run_summary(a, ca, sa),
        b=queries.run_summary(b, cb, sb),
        cmp=result,
        streams=script_json(streams),
        stream_data=script_json(stream_data),
        profile_diff=script_json(why_plots.diff_graph(diff, title, "profile-diff")),
    )


@bp.get("/history")
def history_page() -> Any:
    """Trends across runs and clusters, from the index's hourly rollups."""
    p = principal()
    bucket = request.args.get("bucket", "day")
    if bucket not in history.BUCKETS:
        return render_template("error.html", message="bucket must be hour or day"), 400
    try:
        since, until = time_arg("since"), time_arg("until")
    except ApiError as exc:
        return render_template("error.html", message=exc.message), 400
    rows = history.cluster_history(db(), p.tenant_id, bucket, since, until)
    # Fine performance metrics of a prefix and/or a job over time (issue 9).
    prefix, job = request.args.get("prefix") or None, request.args.get("name") or None
    activity_plot = None
    if prefix or job:
        points = activity.history(
            db(), p.tenant_id, bucket=bucket, prefix=prefix, name=job, since=since, until=until
        )
        what = " of ".join(x for x in (prefix and f"prefix {prefix}", job and f"job {job}") if x)
        activity_plot = why_plots.activity_history_chart(
            points, f"Seconds per run by activity, {what}, per {bucket}", activity.BUCKETS[bucket]
        )
    return render_template(
        "history.html",
        rows=rows,
        bucket=bucket,
        plot=script_json(plots.cluster_history(rows, 3600 * history.BUCKETS[bucket])),
        activity_plot=script_json(activity_plot),
        prefix=prefix or "",
        job=job or "",
    )


@bp.route("/login", methods=["GET", "POST"])
def login() -> Any:
    target = request.values.get("next", "/")
    if not target.startswith("/") or target.startswith("//"):
        target = "/"
    if request.method == "GET":
        return render_template("login.html", next=target, error=None)
    token = request.form.get("token", "").strip()
    found = store().principal_for(token) if token and len(token) < 512 else None
    if found is None or "read" not in found.scopes:
        return render_template(
            "login.html", next=target, error="unknown token, or it lacks the read scope"
        ), 401
    resp = redirect(target)
    resp.set_cookie(
        COOKIE,
        token,
        httponly=True,
        samesite="Strict",
        secure=request.is_secure,
        max_age=30 * 86400,
    )
    return resp


@bp.app_context_processor
def _signed_in() -> dict[str, bool]:
    """Whether the page offers "sign out": a login cookie on a server that needs tokens."""
    return {"signed_in": bool(request.cookies.get(COOKIE)) and store().open_principal is None}


@bp.post("/logout")
def logout() -> Any:
    resp = redirect(url_for("dashboard.login"))
    resp.delete_cookie(COOKIE)
    return resp


@bp.get("/assets/bokeh/<path:filename>")
def bokeh_static(filename: str) -> Response:
    """BokehJS from the installed bokeh wheel: no CDN, no network at view time."""
    if not filename.startswith("js/"):
        abort(404)
    return send_from_directory(BOKEH_STATIC, filename, max_age=86400)


def _error_page(exc: Any, headers: dict[str, str]) -> Any:
    """A wrong page address in a browser: the dashboard's error page, not the API's JSON."""
    message = {404: "no such page", 405: "this page does not take that method"}.get(
        exc.code, exc.description or exc.name
    )
    return render_template("error.html", message=message), exc.code or 500, headers


bp.record_once(lambda state: state.app.extensions.setdefault("hindsight.error_page", _error_page))
# Last, so that the template filters above are registered when it compiles the template.
bp.record_once(_warm_up)
