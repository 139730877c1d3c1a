"""A big finished run's task stream in Chromium: bins at overview, the start/stops
themselves with their keys as the user zooms in, fetched from the task-stream route."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import msgspec

from tests.dashboard.conftest import shoot

T0 = 1_795_000_000.0
WORKERS = [f"tcp://10.0.0.{i}:4000" for i in range(4)]
#: The page fetches windows of a stream past this many start/stops (the setting's default
#: is 50,000; a test's run is a few thousand).
PAGE_RECTS = 400


def big_run(
    n: int, run: str = "big"
) -> tuple[list[dict[str, Any]], list[tuple[str, float, float]]]:
    """A finished run of ``n`` tasks on 4 workers x 2 threads, and its compute phases."""
    rng = random.Random(5)
    clock = {(w, t): T0 for w in WORKERS for t in (1, 2)}
    events: list[dict[str, Any]] = [
        {"kind": "run", "event": "started", "id": run, "name": f"{run}-stream", "time": T0}
    ]
    phases = []
    for i in range(n):
        lane = rng.choice(sorted(clock))
        start = clock[lane] + rng.random() * 0.005
        stop = start + 0.01 + rng.random() * 0.03
        clock[lane] = stop
        prefix = ("load", "inc")[i % 2]
        key = f"('{prefix}-x', {i})"
        events.append(
            {
                "kind": "task",
                "key": key,
                "prefix": prefix,
                "status": "memory",
                "run": run,
                "worker": lane[0],
                "thread": lane[1],
                "nbytes": 8,
                "startstops": [{"action": "compute", "start": start, "stop": stop}],
            }  # fmt: skip
        )
        phases.append((key, start, stop))
    end = max(clock.values()) + 0.05
    events.append({"kind": "run", "event": "finished", "id": run, "time": end})
    return events, phases


def test_a_big_runs_stream_zooms_from_bins_to_its_start_stops(tmp_path: Path, page: Any):
    from hindsight.sender import Sender
    from tests.dask.conftest import EmbeddedServer, wait_until
    from tests.helpers import example

    server = EmbeddedServer(
        tmp_path / "data",
        env={
            "HINDSIGHT_PAGE_STREAM_RECTS": str(PAGE_RECTS),
            "HINDSIGHT_FINISH_SETTLE_SECONDS": "0",
        },
    )
    server.start()
    try:
        events, phases = big_run(3000)
        with Sender(server.url) as s:
            for seq, i in enumerate(range(0, len(events), 1000)):
                body = example(cluster="big", session="s", seq=seq, events=events[i : i + 1000])
                assert s.send(msgspec.json.encode(body)).status == 202
        run = wait_until(lambda: server.run_named("big", "big-stream"), 30, "the run")

        def finished() -> bool:
            work = server.get(f"/v1/runs/{run['id']}")["finished_work"]
            return work["done_at"] is not None and not work["pending"]

        wait_until(finished, 60, "the run's finished-run work")
        page.goto(f"{server.url}/runs/{run['id']}")
        page.wait_for_selector("body[data-complete='1']", timeout=60_000)
        assert page.evaluate("document.body.dataset.streamMode") == "bins"
        src = "Bokeh.documents[0].get_model_by_name('task-stream-source')"
        shown = page.evaluate(f"{src}.data.x.length")
        # bins of the eight worker threads, no more of them than the plot is wide in pixels
        assert 0 < shown <= 8 * 1400
        busy = page.evaluate(f"Array.from({src}.data.alpha).filter(a => a > 0).length")
        assert busy == shown
        shoot(page, "big-stream-bins")

        # zoom into a quarter of a second: the page asks for that window and draws its
        # start/stops, keys and all
        a, b = 4.0, 4.25
        page.evaluate(
            f"""() => {{ const r = Bokeh.documents[0].get_model_by_name('run-time');
                        r.setv({{start: {a}, end: {b}}}); }}"""
        )
        page.wait_for_selector("body[data-stream-mode='rects']", timeout=30_000)
        origin = min(start for _, start, _ in phases)
        want = {k for k, s, e in phases if s - origin < b and e - origin > a}
        keys = page.evaluate(f"Array.from({src}.data.key)")
        assert set(keys) == want and len(keys) == len(want) > 5
        # the hover names the task under the pointer
        x, y = page.evaluate(
            f"""() => {{
                const doc = Bokeh.documents[0], src = {src};
                const i = src.data.x.findIndex(x => x > {a + 0.1});
                const fig = [...doc.all_models].find(m => m.renderers !== undefined
                    && m.renderers.some(r => r.data_source === src));
                const view = Bokeh.index.find_one(fig);
                const box = view.canvas_view.el.getBoundingClientRect();
                window.hsHovered = src.data.key[i];
                return [box.left + view.frame.x_scale.compute(src.data.x[i]),
                        box.top + view.frame.y_scale.compute(src.data.y[i])];
            }}"""
        )
        page.mouse.move(x, y)
        hovered = page.evaluate("window.hsHovered")
        page.locator(".bk-tooltip-content").filter(has_text=hovered).wait_for(timeout=10_000)
        shoot(page, "big-stream-rects")

        # and back out to the whole run: bins again
        page.evaluate(
            """() => { const r = Bokeh.documents[0].get_model_by_name('run-time');
                       r.setv({start: 0, end: r.end * 1000}); }"""
        )
        page.wait_for_selector("body[data-stream-mode='bins']", timeout=30_000)
        assert page.errors == []

        # compared with a small run: the big one's stream in windows, the small one's whole
        small_events, small_phases = big_run(150, "small")
        with Sender(server.url) as s:
            body = example(cluster="small", session="s2", seq=0, events=small_events)
            assert s.send(msgspec.json.encode(body)).status == 202
        small = wait_until(lambda: server.run_named("small", "small-stream"), 30, "the small run")
        page.goto(f"{server.url}/compare?a={small['id']}&b={run['id']}")
        page.wait_for_selector("body[data-rendered='1']", timeout=60_000)
        assert page.evaluate("document.body.dataset.streamMode") == "bins"
        shown = page.evaluate(
            """() => [0, 1].map(i => Bokeh.documents[0]
                .get_model_by_name('compare-stream-' + i).data.x.length)"""
        )
        assert shown[0] == len(small_phases) and 0 < shown[1] <= 8 * 1400
        shoot(page, "big-stream-compare")
        assert page.errors == []
    finally:
        server.stop()
