"""Legends above their plots, off the data: Bokeh lays a legend out in a fixed number of
columns, so the server picks them for a wide screen and the page refits them to the plot's
width (``fitLegends`` in static/hindsight.js), the plot taller by the rows its legend
takes, its frame keeping the height it was given."""

from __future__ import annotations

import logging
from typing import Any

from bokeh.models import Legend, LegendItem

logger = logging.getLogger(__name__)

ROW_PX = 16  # a row of entries: label_height + spacing below
PAD_PX = 4
MARGIN_PX = 4
#: The frame width the server lays legends out for; the page refits them to its own.
WIDE_PX = 1100
CHAR_PX = 6.2  # a character of 8pt Helvetica, about
SWATCH_PX = 12


def legend_height(rows: int) -> int:
    """Pixels a legend of ``rows`` rows takes above its plot."""
    return rows * ROW_PX + 2 * (PAD_PX + MARGIN_PX) if rows else 0


def legend_above(
    fig: Any, entries: list[tuple[str, Any, int | None]], name: str, title: str | None = None
) -> Legend:
    """A horizontal legend above ``fig``'s frame, an entry per (label, renderer, index of
    the renderer's row whose colours it shows, or None for the renderer's own);
    ``fig.height`` grows by it."""
    items = [LegendItem(label=label, renderers=[r], index=i) for label, r, i in entries]
    longest = max((len(label) for label, _, _ in entries), default=1)
    col_px = SWATCH_PX + 5 + CHAR_PX * longest + 10
    ncols = max(1, min(len(items), int(WIDE_PX // col_px)))
    rows = -(-len(items) // ncols)
    legend = Legend(
        items=items,
        orientation="horizontal",
        ncols=ncols,
        title=title,
        title_text_font_size="8pt",
        title_text_font_style="normal",
        label_text_font_size="8pt",
        label_height=ROW_PX - 2,
        glyph_height=SWATCH_PX,
        glyph_width=SWATCH_PX,
        label_standoff=5,
        spacing=2,
        padding=PAD_PX,
        margin=MARGIN_PX,
        border_line_alpha=0,
        background_fill_alpha=0,
        location="top_left",
        name=name,
        tags=[{"fit": fig.height}],
    )
    fig.add_layout(legend, "above")
    fig.height = fig.height + legend_height(rows) + (ROW_PX if title else 0)
    return legend
