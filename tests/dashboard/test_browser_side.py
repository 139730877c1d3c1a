"""The run page's log records, emitted values plot and workers panel in real headless
Chromium, on runs recorded from a real Dask cluster: one whose tasks emit values and log a
warning, one whose worker is killed mid-run. Screenshots go to test-artifacts/dashboard/."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests.dashboard.conftest import ARTIFACTS, shoot, sources
from tests.dask.test_logs_streams import die, emitting, inc

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, str, str]]:
    import dask
    from distributed import Client, LocalCluster, span
    from distributed.scheduler import KilledWorker

    from tests.dask.conftest import EmbeddedServer, wait_for_run, wait_until

    server = EmbeddedServer(tmp_path_factory.mktemp("side-dash") / "data")
    server.start()
    cluster = f"side-dash-{uuid.uuid4().hex[:8]}"
    try:
        config = {"hindsight.url": server.url, "hindsight.cluster": cluster,
                  "distributed.scheduler.allowed-failures": 0}  # fmt: skip
        with dask.config.set(config), LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0",
            scheduler_kwargs={"preload": ["hindsight.dask"]},
        ) as lc, Client(lc) as client:  # fmt: skip
            with span("emits"):
                client.gather(client.map(emitting, range(20), key=[f"e-{i}" for i in range(20)]))
            emits = wait_for_run(server, cluster, "emits", 20)

            def streamed() -> bool:
                got = server.get(f"/v1/runs/{emits['id']}/streams")["streams"]
                return sum(s["count"] for s in got) == 40

            wait_until(streamed, 60, "every emitted value")
            with span("killed"):
                victim = sorted(client.scheduler_info()["workers"])[0]
                # long keys: Dask's log of the lost results lists them, unbroken
                kept = client.map(inc, range(4), key=[f"kept-{'k' * 400}-{i}" for i in range(4)],
                                  workers=[victim], allow_other_workers=True)  # fmt: skip
                doomed = client.submit(die, kept, workers=[victim])
                with pytest.raises(KilledWorker):
                    doomed.result(timeout=60)
                client.gather(kept)
                del kept, doomed
        killed = wait_for_run(server, cluster, "killed", 5, status="erred")
        yield server, emits["id"], killed["id"]
    finally:
        server.stop()


def test_run_page_shows_logs_emitted_values_and_a_killed_worker(recorded, page):
    server, emits, killed = recorded
    page.goto(f"{server.url}/runs/{emits}")
    page.wait_for_selector("body[data-complete='1']", timeout=60_000)
    # the plot draws what the stream route aggregates
    agg = server.get(f"/v1/runs/{emits}/streams/progress", buckets=60)["aggregate"]
    plotted = sources(page)["streams-0-source"]
    assert sum(plotted["count"]) == 20 == sum(p["count"] for p in agg["points"])
    assert sum(plotted["sum"]) == sum(range(20))
    assert page.locator("#streams-plot canvas").count() >= 1
    assert page.locator("#streams tr.stream-row").all_inner_texts()[1].startswith("progress")
    # the worker's warning, next to the errors; the filter box narrows the table
    rows = page.locator("#logs tr.log-row")
    assert any("task 3 looks odd" in t for t in rows.all_inner_texts())
    page.fill("#log-filter", "looks odd")
    assert page.locator("#logs tr.log-row:not([hidden])").count() == 1
    page.locator("#streams-section").screenshot(path=str(ARTIFACTS / "emitted-values.png"))
    assert page.errors == []

    page.goto(f"{server.url}/runs/{killed}")
    page.wait_for_selector("body[data-complete='1']", timeout=60_000)
    gone = page.locator("#lifecycle tr.left-during-run")
    assert gone.count() == 1
    text = gone.inner_text()
    assert "killed or crashed" in text and "1 failed (KilledWorker)" in text
    assert "results lost, recomputed" in text
    assert page.locator("#session-facts").inner_text().startswith("Scheduler tcp://")
    assert any("marked as failed" in t for t in page.locator("#logs tr.log-row").all_inner_texts())
    # long keys and log lines wrap: the page is no wider than the window (it was 9,000 px)
    assert page.evaluate("document.documentElement.scrollWidth") <= page.viewport_size["width"]
    shoot(page, "run-side")
    page.locator("#workers-section").screenshot(path=str(ARTIFACTS / "workers-lifecycle.png"))
    assert page.errors == []
