"""Headless Chromium (Debian's) for the dashboard tests: a browser per module, a page per
test that collects console errors, and screenshots into test-artifacts/dashboard/."""

from __future__ import annotations

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
