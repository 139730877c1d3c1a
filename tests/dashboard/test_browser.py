"""Every dashboard page in real headless Chromium (Debian's), on runs recorded from a real
Dask cluster: the plots render with the right rows and glyphs, and nothing errs in the
console. Screenshots go to test-artifacts/dashboard/."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests.dashboard.conftest import assert_painted_as_tasks, shoot

pytestmark = pytest.mark.browser


def inc(x: int) -> int:
    return x + 1


def fail(x: int) -> int:
    raise ValueError(f"bad record {x}")


# A key as long as generated ones get (a tuple with a path or a token in it), unbroken.
LONG_KEY = ("inc-long", "<i>" + "k" * 400, 1)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, str]]:
    """An embedded server holding two runs of a real LocalCluster: an array reduction and a
    map in which one task fails."""
    import dask
    import dask.array as da
    from distributed import Client, LocalCluster, span

    from tests.dask.conftest import EmbeddedServer, wait_for_run

    server = EmbeddedServer(tmp_path_factory.mktemp("dash") / "data")
    server.start()
    cluster = f"dash-{uuid.uuid4().hex[:8]}"
    try:
        config = {"hindsight.url": server.url, "hindsight.cluster": cluster}
        with dask.config.set(config), LocalCluster(
            n_workers=2, threads_per_worker=2, processes=True, dashboard_address=":0",
            worker_dashboard_address=":0", scheduler_kwargs={"preload": ["hindsight.dask"]},
        ) as lc, Client(lc) as client:  # fmt: skip
            with span("array-sum"):
                assert da.ones((4000,), chunks=20).sum().compute() == 4000
            with span("map-with-failure"):
                futures = client.map(inc, range(150)) + [client.submit(fail, 1)]
                futures.append(client.submit(inc, 2, key=LONG_KEY))
                client.gather(futures, errors="skip")
            del futures
        wait_for_run(server, cluster, "array-sum", 200)
        wait_for_run(server, cluster, "map-with-failure", 152, status="erred")
        yield server, cluster
    finally:
        server.stop()


def test_runs_page_lists_every_run(recorded, page):
    server, cluster = recorded
    page.goto(f"{server.url}/?cluster={cluster}")
    rows = page.locator("tr.run-row")
    assert rows.count() == len(server.runs(cluster)) >= 2
    assert page.locator("td.status-erred").count() == 1
    # a short word is never broken across lines (not "runnin|g" in every row at 1280 px)
    for width in (1280, 390):
        page.set_viewport_size({"width": width, "height": 800})
        lines = page.evaluate(
            """() => [...document.querySelectorAll("tr.run-row td")].filter(td => td.textContent
                 .trim().length && td.textContent.trim().length <= 9 && !td.querySelector("input"))
                 .map(td => { const r = document.createRange(); r.selectNodeContents(td);
                              return new Set([...r.getClientRects()]
                                  .map(q => Math.round(q.top))).size; })"""
        )
        assert lines and max(lines) == 1, (width, lines)
    shoot(page, "runs")
    assert page.errors == []


def model_counts(page: Any) -> dict[str, Any]:
    return page.evaluate(
        """() => {
            const out = {lines: {}};
            for (const doc of Bokeh.documents) {
                for (const m of doc.all_models) {
                    if (m.name === 'task-stream-source') {
                        out.glyphs = m.data.x.length;
                        out.colours = Array.from(new Set(m.data.colour));
                    }
                    if (m.name === 'task-stream-rows') out.rows = m.ticks.length;
                    if (m.name === 'dag-nodes') { out.dag_nodes = m.data.key.length; out.dag = m; }
                    if (m.name && m.type === 'ColumnDataSource' && m.data.xs)
                        out.lines[m.name] = m.data.xs.length;
                }
            }
            if (out.dag) {
                out.dag_red = out.dag.data.line.filter(c => c === 'red').length; delete out.dag;
            }
            return out;
        }"""
    )


@pytest.mark.parametrize("name", ["array-sum", "map-with-failure"])
def test_run_page_draws_the_run(recorded, page, name):
    server, cluster = recorded
    run = server.run_named(cluster, name)
    tasks = server.tasks(run["id"])
    page.goto(f"{server.url}/?cluster={cluster}")
    page.get_by_role("link", name=name).click()
    # every figure: those below the first view are embedded after it
    page.wait_for_selector("body[data-complete='1']", timeout=30_000)
    model = model_counts(page)
    rows = {f"{t['worker']}-{t['thread']}" for t in tasks}
    workers = {t["worker"] for t in tasks}
    assert model["glyphs"] == sum(len(t["startstops"]) for t in tasks)
    # every pixel one task covers alone has its colour; on a loaded machine a run of 1 ms
    # tasks may have none wider than a pixel, then every task is painted where it is
    assert (
        assert_painted_as_tasks(page, "task-stream-source") > 0
        or assert_painted_as_tasks(page, "task-stream-source", colours=False) > 0
    )
    # The hover's task keys arrive after the paint: a rectangle per phase of each task.
    page.wait_for_selector("body[data-keys='1']", timeout=30_000)
    keys = page.evaluate(
        "() => Array.from(Bokeh.documents[0].get_model_by_name('task-stream-source').data.key)"
    )
    assert sorted(keys) == sorted(t["key"] for t in tasks for _ in t["startstops"])
    # Zoomed in on a tenth of the run around its longest opaque task (the middle tenth can be
    # a gap on a loaded machine: nothing to check there), the stream is painted again at that
    # resolution (the range set as Bokeh's zoom and pan tools set it: else it snaps back to
    # the data's extent at the next data change).
    lo, hi, mid = page.evaluate(
        """() => { const s = Bokeh.documents[0].get_model_by_name('task-stream-source').data;
                   let lo = Infinity, hi = -Infinity, widest = -1;
                   for (let i = 0; i < s.x.length; i++) {
                       lo = Math.min(lo, s.x[i] - s.width[i] / 2);
                       hi = Math.max(hi, s.x[i] + s.width[i] / 2);
                       if (s.alpha[i] === 1 && (widest < 0 || s.width[i] > s.width[widest]))
                           widest = i;
                   }
                   return [lo, hi, s.x[widest]]; }"""
    )
    start, end = mid - (hi - lo) * 0.05, mid + (hi - lo) * 0.05
    set_run_time = """([start, end]) => {
        for (const m of Bokeh.documents[0].all_models)
            if (m.name === 'run-time') {
                m.have_updated_interactively = true;
                m.setv({start, end});
            }
    }"""
    page.evaluate(set_run_time, [start, end])
    # The image starts at the view's start, or at the data's first edge when the view starts
    # before it (the widest task can be the run's first: a cold worker's, on a loaded machine).
    page.wait_for_function(
        """(start) => {
            const p = Bokeh.documents[0].get_model_by_name('painted-task-stream-source');
            return p.data.x.length === 1 && p.data.x[0] === start; }""",
        arg=max(start, lo),
    )
    assert assert_painted_as_tasks(page, "task-stream-source") > 0
    # Panned past the run's end: nothing painted, nothing erring.
    page.evaluate(set_run_time, [hi + 10, hi + 20])
    page.wait_for_function(
        "() => Bokeh.documents[0].get_model_by_name('painted-task-stream-source')"
        ".data.x.length === 0"
    )
    assert model["rows"] == len(rows)
    assert page.locator("#timeline canvas").count() >= 1
    # a line per prefix in progress, per worker in memory/CPU/processing
    assert model["lines"]["progress"] == len({t["prefix"] for t in tasks})
    for kind in ("memory-managed", "memory-unmanaged", "cpu", "tasks"):
        assert model["lines"][kind] == len(workers), (kind, model["lines"])
    # memory ticks read as bytes (they read 1.5e+9 before)
    ticks = page.evaluate(
        """() => { const fig = Bokeh.documents.flatMap(d => [...d.all_models]).find(
                     m => m.name === 'memory-managed' && m.left !== undefined);
                   return fig.left[0].formatter.doFormat(
                       [0, 512 * 1024, 1.5 * 2 ** 30], {loc: 0}); }"""
    )
    assert [t.replace(" ", "") for t in ticks] == ["0", "512KiB", "1.5GiB"], ticks
    # the DAG: every task a node, the critical path outlined in red
    critical = server.get(f"/v1/runs/{run['id']}/critical-path")
    assert model["dag_nodes"] == len(tasks)
    assert model["dag_red"] == len({s["key"] for s in critical["segments"]}) >= 1
    # colour-by dropdown (a Bokeh Select inside the shadow DOM) recolours the nodes
    before = page.evaluate(
        "() => Bokeh.documents.map(d => d.get_model_by_name('dag-nodes')).find(m => m)"
        ".data.colour.slice()"
    )
    page.locator("select").select_option("worker")
    after = page.evaluate(
        "() => Bokeh.documents.map(d => d.get_model_by_name('dag-nodes')).find(m => m)"
        ".data.colour.slice()"
    )
    assert after != before and len(set(after)) == len(workers)
    if name == "map-with-failure":
        assert "black" in model["colours"]  # the failed task, as Dask draws it
        assert page.locator("tr.error-group").count() == 1
        assert "bad record" in page.locator("#errors").inner_text()
    assert page.locator("#prefixes tbody tr").count() == len({t["prefix"] for t in tasks})
    trace = server.get(f"/v1/runs/{run['id']}/trace")
    assert page.locator("#perfetto").get_attribute("href") == f"/v1/runs/{run['id']}/trace"
    assert trace["traceEvents"]
    shoot(page, f"run-{name}")
    assert page.errors == []


def test_compare_two_runs_picked_in_the_table(recorded, page):
    server, cluster = recorded
    a, b = server.run_named(cluster, "array-sum"), server.run_named(cluster, "map-with-failure")
    page.goto(f"{server.url}/?cluster={cluster}")
    page.get_by_label("compare array-sum").check()
    page.get_by_label("compare map-with-failure").check()
    page.get_by_role("button", name="compare").click()
    page.wait_for_selector("body[data-rendered='1']", timeout=30_000)
    facts = page.locator("#compare-facts").inner_text()
    assert "array-sum" in facts and "map-with-failure" in facts
    # no prefix in common: each side's prefixes listed as only-in-A / only-in-B
    a_prefixes = {t["prefix"] for t in server.tasks(a["id"])}
    b_prefixes = {t["prefix"] for t in server.tasks(b["id"])}
    shown = page.locator("tr.prefix-new").count() + page.locator("tr.prefix-missing").count()
    assert shown == len(a_prefixes ^ b_prefixes)
    streams = page.evaluate(
        """() => Array.from(Bokeh.documents[0].all_models)
                .filter(m => m.name && m.name.startsWith('compare-stream-')
                             && m.data.x.length > 0).length"""
    )
    assert streams == 2
    # array-sum's tasks are fractions of a ms in a ~350 ms run: a pixel that one opaque
    # task fills alone may not exist (the colour check can then find none to check), so
    # both sides are checked as painted where tasks are and blank where none is
    for side in ("compare-stream-0", "compare-stream-1"):
        assert assert_painted_as_tasks(page, side, colours=False) > 0
    shoot(page, "compare")
    assert page.errors == []


def test_history_page_draws_each_cluster(recorded, page):
    server, cluster = recorded
    page.goto(f"{server.url}/history?bucket=hour")
    page.wait_for_selector("body[data-rendered='1']", timeout=30_000)
    points = server.get("/v1/history/clusters", bucket="hour")["points"]
    clusters = {p["cluster"] for p in points}
    assert cluster in clusters
    assert page.locator("tr.history-row").count() == len(points)
    lines = page.evaluate(
        "() => Array.from(Bokeh.documents[0].all_models)"
        ".filter(m => m.name === 'history-runs-line').length"
    )
    assert lines == len(clusters)
    shoot(page, "history")
    assert page.errors == []


def test_a_running_run_updates_itself_rides_out_a_restart_and_freezes(tmp_path, page):
    """Post half a run; the open page reloads when more arrives, keeps polling while the
    server restarts, and stops fetching while frozen."""
    from hindsight.sender import Sender
    from tests.dask.conftest import EmbeddedServer, wait_until
    from tests.helpers import example

    server = EmbeddedServer(tmp_path / "data")
    server.start()
    try:

        def batch(seq: int, n: int) -> dict[str, Any]:
            started: dict[str, Any] = {"kind": "run", "event": "started", "id": "live",
                                       "name": "live-run", "time": 1.8e9}  # fmt: skip
            events: list[dict[str, Any]] = [started] if seq == 0 else []
            events += [{"kind": "task", "key": f"inc-{seq}-{i}", "prefix": "inc",
                        "status": "memory", "run": "live", "worker": "tcp://w:1", "thread": 1,
                        "startstops": [{"action": "compute", "start": 1.8e9 + seq + i * 0.01,
                                        "stop": 1.8e9 + seq + i * 0.01 + 0.005}]}
                       for i in range(n)]  # fmt: skip
            return example(cluster="live", session="s1", agent="a", seq=seq, events=events)

        with Sender(server.url) as s:
            assert s.send(as_json(batch(0, 5))).status == 202
        run = wait_until(lambda: server.run_named("live", "live-run"), 30, "the run")
        page.goto(f"{server.url}/runs/{run['id']}?refresh=0.5")
        page.wait_for_selector("body[data-rendered='1']")
        assert page.locator("#live").count() == 1

        # the collector restarts under the open page; it keeps polling, then sees new tasks
        server.stop()
        page.wait_for_function(
            "() => document.getElementById('live-note').textContent.includes('unreachable')"
        )
        server.start()
        with Sender(server.url) as s:
            assert s.send(as_json(batch(1, 7))).status == 202
        page.wait_for_function(rendered_with(12), timeout=30_000)

        # frozen: the loop ticks on but fetches nothing, so new data does not reload it
        page.locator("#freeze").check()
        fetches = page.evaluate("() => window.hsLive.fetches")
        ticks = page.evaluate("() => window.hsLive.ticks")
        with Sender(server.url) as s:
            assert s.send(as_json(batch(2, 3))).status == 202
        page.wait_for_function(f"() => window.hsLive.ticks >= {ticks + 3}")
        assert page.evaluate("() => window.hsLive.fetches") == fetches
        assert (
            page.evaluate(
                "() => Bokeh.documents[0].get_model_by_name('task-stream-source').data.x.length"
            )
            == 12
        )
        # unfrozen: it catches up
        page.locator("#freeze").uncheck()
        page.wait_for_function(rendered_with(15), timeout=30_000)
        shoot(page, "live")
    finally:
        server.stop()
    # what the restart cut: the page's polls, or the figures it loads after its first view
    # (refused while down; reset, empty or short when the old process died mid-answer)
    cut = ("Failed to fetch", "ERR_CONNECTION_REFUSED", "ERR_EMPTY_RESPONSE",
           "ERR_CONNECTION_RESET", "ERR_CONTENT_LENGTH_MISMATCH")  # fmt: skip
    assert [e for e in page.errors if not any(c in e for c in cut)] == []


def rendered_with(glyphs: int) -> str:
    """A page-side test that the page has rendered ``glyphs`` task-stream glyphs; false (not
    an error) while a live reload has no document body or Bokeh document yet."""
    return (
        "() => { try { return document.body.dataset.rendered === '1' && Bokeh.documents[0]"
        f".get_model_by_name('task-stream-source').data.x.length === {glyphs}; }} "
        "catch (e) { return false; } }"
    )


def as_json(obj: Any) -> bytes:
    import json

    return json.dumps(obj).encode()


# Text with no place to break, as a checkout's path is ("/check/work/main/tests/...py:46"
# in the submitting-code summary must not make a run page wider than a phone's 390 px).
LONG_WORD = "/" + "x" * 120 + ".py:46"


def test_pages_fit_a_phone(recorded, page):
    """At 390 px the tables scroll inside themselves rather than widen the runs list (to
    624 px) or a run page (to 530). Paragraphs, summaries and facts wrap a word longer than
    the screen, wherever the run's code lives."""
    server, cluster = recorded
    run = server.run_named(cluster, "array-sum")
    page.set_viewport_size({"width": 390, "height": 800})
    for path, drawn in ((f"/?cluster={cluster}", None), (f"/runs/{run['id']}", "complete"),
                        ("/history?bucket=hour", "rendered")):  # fmt: skip
        page.goto(server.url + path)
        if drawn:  # the pages with figures say when every figure is drawn
            page.wait_for_selector(f"body[data-{drawn}='1']", timeout=60_000)
        width = page.evaluate("document.documentElement.scrollWidth")
        assert width <= 390, (path, width)
        texts = page.evaluate(
            """word => { const found = document.querySelectorAll(
                 "main p, main summary, main .facts div, main h1, main h2, main h3, main label");
               found.forEach(e => e.append(" " + word)); return found.length; }""",
            LONG_WORD,
        )
        width = page.evaluate("document.documentElement.scrollWidth")
        assert texts > 0 and width <= 390, (path, texts, width)
    assert page.errors == []


def hover_task(page: Any, source: str, where: str) -> None:
    """Move the mouse onto the middle of the first task of ``source`` whose key matches the
    page-side predicate ``where`` (``k => ...``), as a user points at it."""
    x, y = page.evaluate(
        f"""() => {{
            const doc = Bokeh.documents[0], src = doc.get_model_by_name('{source}');
            const i = src.data.key.findIndex({where});
            const fig = [...doc.all_models].find(m => m.renderers !== undefined
                && m.renderers.some(r => r.data_source === src));
            const view = Bokeh.index.find_one(fig);
            const box = view.canvas_view.el.getBoundingClientRect();
            return [box.left + view.frame.x_scale.compute(src.data.x[i]),
                    box.top + view.frame.y_scale.compute(src.data.y[i])];
        }}"""
    )
    page.mouse.move(x, y)


def test_task_stream_hover_shows_a_long_key_whole_on_screen(recorded, page):
    """A key longer than the screen is wide (a tuple holding a path or a token) was one
    line in the hover, running off the page (2,533 px wide, from x=-1,875): it wraps within
    the screen, all of it shown, as text (a key is the user's data, not markup)."""
    server, cluster = recorded
    run = server.run_named(cluster, "map-with-failure")
    page.goto(f"{server.url}/runs/{run['id']}")
    page.wait_for_selector("body[data-keys='1']", timeout=60_000)
    # the stream's legend is refitted once every figure is drawn, which may move its frame:
    # hover where the task is after that
    page.wait_for_selector("body[data-complete='1']", timeout=60_000)
    hover_task(page, "task-stream-source", "k => k.includes('kkkk')")
    tip = page.locator(".bk-tooltip-content").filter(has_text="kkkk")
    tip.wait_for(timeout=10_000)
    box = tip.bounding_box()
    text = "".join(tip.inner_text().split())
    assert "<i>" + "k" * 400 in text, text
    assert "inc-long" in text and "seconds" in text
    shoot(page, "hover-long-key")
    assert box["x"] >= 0 and box["x"] + box["width"] <= page.viewport_size["width"], box
    assert page.errors == []


def test_history_legend_names_every_cluster_without_squashing_a_plot(tmp_path, page):
    """One legend above the first plot names every cluster, in rows, and that plot's frame
    is as tall as the others (a legend inside each 170 px plot runs off its bottom with five
    clusters)."""
    import requests

    from tests.dask.conftest import EmbeddedServer
    from tests.helpers import encode
    from tests.query.test_runs import T0, run_batch

    server = EmbeddedServer(tmp_path / "data")
    server.start()
    try:
        clusters = [f"cluster-number-{i}" for i in range(8)]
        for i, c in enumerate(clusters):
            body = encode(run_batch(c, f"s{i}", f"r{i}", 0, t=T0 + i))  # all in one hour
            resp = requests.post(f"{server.url}/v1/batches", data=body, timeout=30, headers={
                "Content-Type": "application/json", "Content-Encoding": "zstd"})  # fmt: skip
            assert resp.status_code == 202, resp.text
        page.goto(f"{server.url}/history?bucket=hour&since=2020-01-01")
        page.wait_for_selector("body[data-rendered='1']", timeout=30_000)
        js = """() => { const doc = Bokeh.documents[0];
                 const legends = Array.from(doc.all_models).filter(m => m.type === 'Legend');
                 const heights = ['runs', 'tasks', 'errors', 'compute_seconds'].map(
                   f => Bokeh.index.find_one(doc.get_model_by_name('history-' + f))
                          .frame.bbox.height);
                 const plot = Bokeh.index.find_one(doc.get_model_by_name('history-runs'));
                 const boxes = legends.map(l => { const b = Bokeh.index.find_one(l).bbox;
                   return [b.top, b.bottom, b.left, b.right]; });
                 return {labels: legends.flatMap(l => l.items.map(i => i.label.value)), heights,
                         boxes, frame_top: plot.frame.bbox.top,
                         canvas: [plot.bbox.width, plot.bbox.height]}; }"""
        got = page.evaluate(js)
        assert sorted(got["labels"]) == clusters
        # the legend is whole on the canvas and above the data, and the plot under it is
        # not squashed by it; on a phone too (six names a row ran off a 390 px screen)
        for width in (1400, 390):
            page.set_viewport_size({"width": width, "height": 900})
            page.wait_for_function(
                "(w) => Bokeh.index.find_one(Bokeh.documents[0].get_model_by_name("
                "'history-runs')).bbox.width <= w",
                arg=width,
            )
            got = page.evaluate(js)
            ((top, bottom, left, right),) = got["boxes"]
            canvas_width, _ = got["canvas"]
            assert 0 <= top and bottom <= got["frame_top"], got
            assert 0 <= left and right <= canvas_width, (width, got)
            assert min(got["heights"]) >= 0.9 * max(got["heights"]), got["heights"]
        # runs all in one hour: the time axis spans hours, not +-1 ms
        span = page.evaluate(
            "() => { const r = Bokeh.documents[0].get_model_by_name('history-time');"
            " return r.end - r.start; }"
        )
        assert span >= 3600 * 1000
        shoot(page, "history-many-clusters")
        assert page.errors == []
    finally:
        server.stop()
