"""Why a run was slow, in real headless Chromium: the run page's flame graph, activity
view and submitting code, the compare page's profile difference, and the history page's
seconds by activity over time, on two runs of one job recorded from a real Dask cluster.
Screenshots go to test-artifacts/dashboard/ (docs/screenshots/ keeps copies)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests.dashboard.conftest import ARTIFACTS, shoot, sources

pytestmark = pytest.mark.browser


def parse_rows(n: int) -> int:
    deadline = time.thread_time() + 0.15
    while time.thread_time() < deadline:
        n += 1
    return n


def validate(n: int) -> int:
    deadline = time.thread_time() + 0.15
    while time.thread_time() < deadline:
        n -= 1
    return n


def load_v1(i: int) -> int:
    return parse_rows(i)


def load_v2(i: int) -> int:
    return validate(parse_rows(i))


def upload(i: int) -> int:
    time.sleep(0.1)
    return i


BOTH = "one of: parse_rows, validate"


def tasks_left(dask_scheduler: Any) -> int:
    return len(dask_scheduler.tasks)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, str, str, str]]:
    """Two runs of the job "etl": the second also validates what it parses (a new hot
    function). Yields the server, the cluster and both run ids."""
    import dask
    from distributed import Client, LocalCluster, span

    from tests.dask.conftest import EmbeddedServer, wait_until

    server = EmbeddedServer(tmp_path_factory.mktemp("why-dash") / "data")
    server.start()
    cluster = f"why-dash-{uuid.uuid4().hex[:8]}"
    nframes = "distributed.diagnostics.computations.nframes"
    before = dask.config.get(nframes)
    try:
        config = {"hindsight.url": server.url, "hindsight.cluster": cluster}
        with dask.config.set(config), LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0",
            scheduler_kwargs={"preload": ["hindsight.dask"]},
        ) as lc, Client(lc) as client:  # fmt: skip
            for load in (load_v1, load_v2):
                with span("etl"):
                    loaded = client.map(load, range(6), pure=False)
                    client.gather(client.map(upload, loaded, pure=False))
                del loaded
                # Dask attaches tasks to a live task group of the same name (and so to the
                # earlier span): let the first run's tasks be forgotten first.
                wait_until(lambda: not client.run_on_scheduler(tasks_left), 30, "a clean slate")
        wait_until(lambda: len([r for r in server.runs(cluster) if r["task_count"] == 12]) == 2,
                   60, "both runs")  # fmt: skip
        runs = sorted(server.runs(cluster), key=lambda r: r["started_at"])
        for r in runs:
            wait_until(lambda r=r: server.get(f"/v1/runs/{r['id']}")["completeness"]["closed"],
                       60, "final batches")  # fmt: skip
        yield server, cluster, runs[0]["id"], runs[1]["id"]
    finally:
        dask.config.set({nframes: before})
        server.stop()


def test_run_page_draws_the_flame_graph_activity_and_code(recorded, page):
    server, _cluster, _v1, v2 = recorded
    api = server.get(f"/v1/runs/{v2}/profile")
    page.goto(f"{server.url}/runs/{v2}")
    page.wait_for_selector("body[data-complete='1']", timeout=60_000)
    data = sources(page)
    flame = data["profile-source"]
    # a frame per prefix, then every frame of each prefix's call tree
    names = set(flame["name"])
    # load_v2's two pure-Python callees: where one profile cycle (a second) saw both, Dask's
    # tree cannot tell their samples apart
    assert {"load_v2", "upload", BOTH} <= names
    per_prefix = {n: server.get(f"/v1/runs/{v2}/profile", prefix=n) for n in ("load_v2", "upload")}
    assert sum(p["samples"] for p in per_prefix.values()) == api["samples"]
    widest: dict[str, float] = {}
    for name, left, right in zip(flame["name"], flame["left"], flame["right"], strict=True):
        widest[name] = max(widest.get(name, 0.0), right - left)
    assert widest["load_v2"] == pytest.approx(per_prefix["load_v2"]["samples"] / api["samples"])
    hottest = page.locator("#hottest tr.hot-row").first.inner_text()
    assert hottest.split("\t")[0] in (BOTH, "parse_rows", "validate")
    shoot(page, "run-why")
    for section, name in (("#profile", "flame-graph"), ("#why", "activity")):
        page.locator(section).screenshot(path=str(ARTIFACTS / f"{name}.png"))
    # clicking a frame zooms to it
    profile_x_end = (
        "() => Bokeh.documents.flatMap(d => Array.from(d.all_models))"
        ".find(m => m.name === 'profile-x').end"
    )
    x0 = page.evaluate(profile_x_end)
    canvas = page.locator("#profile canvas").first
    canvas.scroll_into_view_if_needed()
    box = canvas.bounding_box()
    page.mouse.click(box["x"] + box["width"] * 0.3, box["y"] + box["height"] * 0.75)
    page.wait_for_function(profile_x_end + " < 0.999")
    assert x0 == 1
    # Dask's fine performance metrics view: seconds by activity, split by prefix
    act = data["activity-source"]
    rows = server.get(f"/v1/runs/{v2}/activity")["activity"]
    expected = {(r["activity"], r["prefix"]) for r in rows
                if r["unit"] == "seconds" and r["context"] == "execute"
                and r["value"] > 0}  # fmt: skip
    assert set(zip(act["activity"], act["prefix"], strict=True)) == expected
    assert page.locator("tr.activity-row").count() >= 2
    # the submitting code, its submitting line marked
    assert page.locator("details.code").count() >= 1
    submitted = page.locator("details.code .submit-line").all_text_contents()
    assert any("client.map(load" in line for line in submitted)
    assert page.errors == []


def test_compare_page_draws_the_profile_difference(recorded, page):
    server, _cluster, v1, v2 = recorded
    page.goto(f"{server.url}/compare?a={v1}&b={v2}")
    page.wait_for_selector("body[data-rendered='1']", timeout=60_000)
    diff = sources(page)["profile-diff-source"]
    frames = dict(zip(diff["name"], diff["colour"], strict=True))
    # validate is new in b, with parse_rows: drawn red (b spends a larger share on the
    # frame of the two than a's none)
    red = frames[BOTH]
    assert int(red[1:3], 16) > int(red[5:7], 16)
    shoot(page, "compare-profile")
    assert page.errors == []


def test_history_page_plots_seconds_by_activity_of_a_prefix(recorded, page):
    server, cluster, _v1, _v2 = recorded
    page.goto(f"{server.url}/history?bucket=hour&prefix=upload")
    page.wait_for_selector("body[data-rendered='1']", timeout=60_000)
    lines = [v for k, v in sources(page).items() if k.startswith("activity-history-")]
    points = server.get("/v1/history/activity", prefix="upload", bucket="hour")["points"]
    assert len(lines) == len({a for p in points for a in p["activity"]}) >= 2
    assert page.locator("#activity-history canvas").count() >= 1
    shoot(page, "history-activity")
    assert page.errors == []
