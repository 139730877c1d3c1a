"""Replay in real headless Chromium: the run page's time slider redraws the status page
(bytes and processing per worker, progress bars by prefix) and the task stream at the
slider's time, on a run recorded from a real Dask cluster. Screenshots go to
test-artifacts/dashboard/ (docs/screenshots/replay.png keeps a copy)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests.dashboard.conftest import ARTIFACTS, assert_painted_as_tasks, shoot

pytestmark = pytest.mark.browser


def load(i: int) -> int:
    time.sleep(0.15)
    return i


def transform(x: int) -> list[int]:
    time.sleep(0.1)
    return [x] * 10_000


def total(parts: list[list[int]]) -> int:
    return sum(len(p) for p in parts)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, str]]:
    import dask
    from distributed import Client, LocalCluster, span

    from tests.dask.conftest import EmbeddedServer, wait_for_run

    server = EmbeddedServer(tmp_path_factory.mktemp("replay-dash") / "data")
    server.start()
    cluster = f"replay-dash-{uuid.uuid4().hex[:8]}"
    try:
        config = {"hindsight.url": server.url, "hindsight.cluster": cluster,
                  "hindsight.sample-interval": 0.2}  # fmt: skip
        with dask.config.set(config), LocalCluster(
            n_workers=2, threads_per_worker=2, processes=True, dashboard_address=":0",
            scheduler_kwargs={"preload": ["hindsight.dask"]},
        ) as lc, Client(lc) as client:  # fmt: skip
            with span("nightly"):
                loaded = client.map(load, range(24), pure=False)
                parts = client.map(transform, loaded, pure=False)
                assert client.submit(total, parts).result() == 24 * 10_000
        run = wait_for_run(server, cluster, "nightly", 49)
        yield server, run["id"]
    finally:
        server.stop()


def progress_rows(page: Any) -> dict[str, str]:
    return page.evaluate(
        """() => Object.fromEntries(
                 Array.from(document.querySelectorAll('#replay-progress .replay-row'))
                 .map(r => [r.dataset.prefix, r.dataset.counts]))"""
    )


def visible_tasks(page: Any) -> int:
    return page.evaluate(
        """() => { for (const d of Bokeh.documents) {
                       const s = d.get_model_by_name('task-stream-source');
                       if (s) return Array.from(s.data.alpha).filter(a => a > 0).length;
                   }
                   return -1; }"""
    )


def shown(page: Any) -> int:
    return int(page.get_attribute("#replay", "data-shown") or 0)


def move_slider(page: Any, at: float) -> None:
    before = shown(page)
    page.locator("#replay-slider").fill(repr(at))
    page.wait_for_function(
        f"() => Number(document.getElementById('replay').dataset.shown) > {before}"
    )


def test_moving_the_slider_redraws_the_status_page_at_that_time(recorded, page):
    server, run_id = recorded
    run = server.get(f"/v1/runs/{run_id}")
    page.goto(f"{server.url}/runs/{run_id}")
    page.wait_for_selector("#replay[data-shown]", timeout=60_000)
    # The slider starts at the run's last sample: everything done, every task drawn.
    end = progress_rows(page)
    assert set(end) == {"load", "transform", "total"}
    for counts in end.values():
        waiting, processing, *_ = map(int, counts.split(","))
        assert waiting == processing == 0
    full = visible_tasks(page)  # a rectangle per phase (compute, transfer)
    assert full >= run["task_count"]
    workers = page.locator("#replay-memory .replay-row")
    assert workers.count() == 2
    assert page.locator("#replay-processing .replay-row").count() == 2

    # A sixth of the way in: some tasks waiting or processing, fewer tasks drawn, and the
    # bars are the API's numbers at the time the slider asked for.
    slider = page.locator("#replay-slider")
    hi = float(slider.get_attribute("max"))  # seconds from the run's first sample
    move_slider(page, hi / 6)
    at = float(page.get_attribute("#replay", "data-at"))
    # "s into the run" counts from the run's start, not from its first sample.
    label = page.locator("#replay-time").text_content()
    assert f"({at - run['started_at']:.1f} s into the run)" in label, label
    middle = progress_rows(page)
    assert middle != end
    api = server.get(f"/v1/runs/{run_id}/state", at=repr(at))
    assert middle == {
        p["prefix"]: ",".join(
            str(p[k]) for k in ("waiting", "processing", "memory", "released", "erred")
        )
        for p in api["prefixes"]
    }
    assert any(int(c.split(",")[0]) + int(c.split(",")[1]) > 0 for c in middle.values())
    drawn = visible_tasks(page)
    assert 0 <= drawn < full
    assert_painted_as_tasks(page, "task-stream-source")  # the image is cut there too
    busy = page.evaluate(
        "() => Array.from(document.querySelectorAll('#replay-processing .replay-row'))"
        ".map(r => Number(r.dataset.processing))"
    )
    assert busy == [w["processing"] for w in api["workers"]]
    widths = page.evaluate(
        "() => Array.from(document.querySelectorAll('#replay-memory .seg.managed'))"
        ".map(s => s.style.width)"
    )
    assert len(widths) == 2
    shoot(page, "run-replay")
    # the slider, the status page and the task stream up to the slider's time
    top = page.locator("#replay").bounding_box()
    stream = page.locator("#timeline canvas").first.bounding_box()
    bottom = stream["y"] + min(stream["height"], 260)
    clip = {"x": 0, "y": top["y"], "width": 1400, "height": bottom - top["y"]}
    page.screenshot(path=str(ARTIFACTS / "replay.png"), clip=clip, full_page=True)

    # Back to the end: the bars and the stream come back.
    move_slider(page, hi)
    assert progress_rows(page) == end
    assert visible_tasks(page) == full
    assert assert_painted_as_tasks(page, "task-stream-source") > 0
    assert page.errors == []
