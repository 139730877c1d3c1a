"""The run page leads with its explanation, in Chromium: a job of usual runs on a real
LocalCluster, then one whose step got new CPU work in a new function."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests.dashboard.conftest import shoot

USUAL = 4


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, list[str]]]:
    from distributed import Client

    from tests.dask.conftest import EmbeddedServer, wait_until
    from tests.dask.test_explain import JOB, TASKS, _cluster, _job

    server = EmbeddedServer(tmp_path_factory.mktemp("explain-dash") / "data")
    server.start()
    name = f"explain-dash-{uuid.uuid4().hex[:8]}"
    try:
        with _cluster(server, name, 2) as lc, Client(lc) as client:
            for _ in range(USUAL):
                _job(client)
            _job(client, cpu=0.1)

        def all_in() -> list[dict[str, Any]] | None:
            found = [r for r in server.runs(name) if r.get("name") == JOB]
            done = [r for r in found if r["status"] == "finished" and r["task_count"] == TASKS]
            return sorted(done, key=lambda r: r["started_at"]) if len(done) == USUAL + 1 else None

        runs = wait_until(all_in, 120, "every run")
        for r in runs:
            wait_until(
                lambda r=r: (
                    (d := server.get(f"/v1/runs/{r['id']}"))["completeness"]["closed"]
                    and not d["finished_work"]["pending"]
                ),
                120,
                "finished-run work",
            )
        yield server, [r["id"] for r in runs]
    finally:
        server.stop()


def test_the_run_page_leads_with_the_explanation_linked_to_evidence(recorded, page):
    server, ids = recorded
    page.goto(f"{server.url}/runs/{ids[-1]}")
    text = page.inner_text("#explain-text")
    assert text.startswith("slower:") and "longer than its usual" in text
    # before the run's facts: the first thing read under the title
    assert page.evaluate(
        "document.querySelector('#explain').compareDocumentPosition("
        "document.querySelector('.facts')) & Node.DOCUMENT_POSITION_FOLLOWING"
    )
    items = page.query_selector_all("#explain-findings li")
    assert 1 <= len(items) <= 3
    links = {li.get_attribute("class"): li.query_selector("a") for li in items}
    assert "finding-step" in links or "finding-profile" in links, list(links)
    for cls, a in links.items():
        href = a.get_attribute("href")
        if cls == "finding-profile":
            assert href == "#profile"
        if cls == "finding-step":
            assert href.startswith("/history?") and "prefix=step" in href
    page.click("#explain-compare")
    page.wait_for_url("**/compare?**")
    assert f"b={ids[-1]}" in page.url and f"a={ids[-2]}" in page.url
    shoot(page, "explain-compare")
    assert not page.errors, page.errors


def test_each_runs_page_reads_its_own_verdict(recorded, page):
    server, ids = recorded
    # a usual run's verdict is the statistics' (tests/dask/test_explain.py checks them);
    # the page shows the stored explanation as it is
    usual = server.get(f"/v1/runs/{ids[-2]}/explain")
    page.goto(f"{server.url}/runs/{ids[-2]}")
    assert page.inner_text("#explain-text") == f"{usual['verdict']}: {usual['text']}"
    page.goto(f"{server.url}/runs/{ids[0]}")
    assert page.inner_text("#explain-text").startswith("no history:")
    assert page.query_selector("#explain-compare") is None
    assert not page.errors, page.errors
