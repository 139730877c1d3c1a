"""Headless Chromium (Debian's) for the dashboard tests: a browser per module, a page per
test that collects console errors, and screenshots into test-artifacts/dashboard/."""

from __future__ import annotations

import math
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "dashboard"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]  # fmt: skip


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not Path(CHROMIUM).exists():
        pytest.skip(
            f"Chromium not found at {CHROMIUM} (make test installs Debian's chromium where it can)"
        )
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser: Any, tmp_path: Path) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    pg = context.new_page()
    pg.errors = []  # type: ignore[attr-defined]
    pg.on("console", lambda m: m.type == "error" and pg.errors.append(m.text))
    pg.on("pageerror", lambda e: pg.errors.append(str(e)))
    yield pg
    context.close()


def shoot(page: Any, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def sources(page: Any) -> dict[str, Any]:
    """Every named Bokeh ColumnDataSource on the page: {name: data}."""
    return page.evaluate(
        """() => {
            const out = {};
            for (const doc of Bokeh.documents)
                for (const m of doc.all_models)
                    if (m.name && m.type === 'ColumnDataSource') out[m.name] = m.data;
            return out;
        }"""
    )


NAMED = {"red": (255, 0, 0), "orange": (255, 165, 0), "gray": (128, 128, 128), "black": (0, 0, 0)}


def rgb(colour: str) -> tuple[int, int, int]:
    if colour in NAMED:
        return NAMED[colour]
    n = int(colour.lstrip("#"), 16)
    return (n >> 16) & 255, (n >> 8) & 255, n & 255


def assert_painted_as_tasks(page: Any, source: str, colours: bool = True) -> int:
    """The task stream ``source`` is painted as its per-task rectangles are: in the painted
    image (``painted-SOURCE``), along the middle of each row, a pixel is coloured exactly
    where a visible task rectangle of that row covers it, and a pixel one opaque rectangle
    covers alone has that rectangle's colour. Returns how many pixels were checked for
    colour (with ``colours`` false: how many were checked as painted, for a run whose tasks
    may all be narrower than a pixel, where no pixel is one rectangle's alone)."""
    got = page.evaluate(
        """(name) => {
            const find = n => { for (const d of Bokeh.documents) { const m = d.get_model_by_name(n);
                                if (m) return m.data; } return null; };
            const t = find(name), p = find('painted-' + name);
            const img = p.image[0], [H, W] = img.shape, rows = p.dh[0], lines = [];
            for (let y = 0; y < rows; y++) {
                const r = Math.min(H - 1, Math.floor((y + 0.5) * H / rows));
                lines.push(Array.from(img.slice(r * W, (r + 1) * W)));
            }
            return {lo: p.x[0], dw: p.dw[0], W, lines,
                    tasks: {x: Array.from(t.x), width: Array.from(t.width), y: Array.from(t.y),
                            colour: Array.from(t.colour), alpha: Array.from(t.alpha)}};
        }""",
        source,
    )
    t, width = got["tasks"], got["W"]
    scale = width / got["dw"]
    covers: list[list[list[tuple[float, float, str]]]] = [
        [[] for _ in range(width)] for _ in got["lines"]
    ]
    columns = (t["x"], t["width"], t["y"], t["colour"], t["alpha"])
    for x, w, y, colour, alpha in zip(*columns, strict=True):
        a, b = (x - w / 2 - got["lo"]) * scale, (x + w / 2 - got["lo"]) * scale
        if alpha <= 0 or b <= a:
            continue
        for px in range(max(0, math.floor(a)), min(width - 1, math.ceil(b) - 1) + 1):
            cover = min(b, px + 1) - max(a, px)
            if cover > 0:
                covers[y][px].append((cover, alpha, colour))
    checked = painted = 0
    for y, line in enumerate(got["lines"]):
        for px, value in enumerate(line):
            shown = value >> 24
            rects = covers[y][px]
            if not rects:
                assert shown == 0, (y, px, "painted where no task is")
            elif max(c * al for c, al, _ in rects) >= 0.02:
                assert shown > 0, (y, px, "a task not painted", rects)
                painted += 1
            if len(rects) == 1 and rects[0][0] >= 1 - 1e-9 and rects[0][1] == 1.0:
                assert (value & 255, (value >> 8) & 255, (value >> 16) & 255, shown) == (
                    *rgb(rects[0][2]),
                    255,
                )
                checked += 1
    return checked if colours else painted


@pytest.fixture
def apps(stack):
    """The collector's and the query service's test clients, in process."""
    from collector.app import create_app as collector_app
    from services.query.app import create_app as query_app

    return collector_app(stack).test_client(), query_app(stack).test_client()
