"""One colour per task prefix on a page, the same in every plot of it.

Dask hashes a prefix into an 18-colour viridis palette (``distributed.diagnostics.
progress_stream.color_of``): two prefixes of a run often shared a colour, and neighbouring
viridis colours (the purples of an array run's ``ones``, ``sum`` and ``sum-partial``) are
hard to tell apart. Here a page's prefixes, sorted by name, take :data:`PREFIX_PALETTE`'s
colours in turn: distinct for the first 20 prefixes, and a prefix of the same job keeps its
colour from run to run. The task stream's other colours keep Dask's meaning: transfers
red, disk reads and writes orange, other actions grey, failed computations black.
"""

from __future__ import annotations

import colorsys
import functools
import hashlib
import logging
from collections.abc import Iterable

logger = logging.getLogger(__name__)

#: Twenty colours, each as far (CIELAB) from those before it as a pool of Category20(b,c),
#: ColorBrewer and Tol colours allowed; saturated reds and oranges, greys, black and white
#: left out (the task stream's transfers, disk actions, other actions, failures and its
#: background). The first ten are the most distinct.
PREFIX_PALETTE = (
    "#1f77b4",
    "#2ca02c",
    "#aa4499",
    "#bcbd22",
    "#17becf",
    "#843c39",
    "#637939",
    "#a6761d",
    "#a1d99b",
    "#de9ed6",
    "#009e73",
    "#e7298a",
    "#6b6ecf",
    "#882255",
    "#8da0cb",
    "#a6d854",
    "#e7ba52",
    "#999933",
    "#ffd92f",
    "#117733",
)
#: The task stream's phases other than compute (Dask's colours, translucent as Dask's).
ACTION_COLOURS = {
    "transfer": ("red", 0.4),
    "disk-read": ("orange", 0.4),
    "disk-write": ("orange", 0.4),
}
OTHER_ACTION = ("gray", 0.4)
ERRED = "black"
#: Categories other than prefixes (workers, clusters, types), in turn (Category20's
#: strong colours, then its light ones).
WORKER_PALETTE = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
    "#aec7e8",
    "#ffbb78",
    "#98df8a",
    "#ff9896",
    "#c5b0d5",
    "#c49c94",
)

# distributed.utils.palette (viridis, 18 colours): the flame graph's colours by file, and
# the ramps of numbers (the task graph coloured by duration or bytes)
PALETTE = (
    "#440154",
    "#471669",
    "#472A79",
    "#433C84",
    "#3C4D8A",
    "#355D8C",
    "#2E6C8E",
    "#287A8E",
    "#23898D",
    "#1E978A",
    "#20A585",
    "#2EB27C",
    "#45BF6F",
    "#64CB5D",
    "#88D547",
    "#AFDC2E",
    "#D7E219",
    "#FDE724",
)


@functools.lru_cache(maxsize=4096)
def colour_of(name: str) -> str:
    """Dask's colour for a name (``distributed.diagnostics.progress_stream.color_of``): the
    flame graph colours frames by their file with it, as Dask does. Prefixes take a page's
    :class:`~services.dashboard.colours.PrefixColours` instead."""
    n = int(hashlib.md5(name.encode()).hexdigest()[:8], 16)
    return PALETTE[n % len(PALETTE)]


def extra_colour(i: int) -> str:
    """The ``i``-th colour past the palette: hues a golden angle apart, at two lightnesses."""
    hue = (0.58 + i * 0.381966) % 1.0
    light = 0.42 if i % 2 else 0.62
    r, g, b = colorsys.hls_to_rgb(hue, light, 0.55)
    return f"#{round(r * 255):02x}{round(g * 255):02x}{round(b * 255):02x}"


class PrefixColours:
    """A page's prefix colours: the prefixes known when the page is built, sorted, take the
    palette in turn; a prefix first met later (one plot's only) takes the next colour.
    Every plot of a page reads the same instance."""

    def __init__(self, prefixes: Iterable[str | None] = ()) -> None:
        self._of: dict[str, str] = {}
        for p in sorted({p or "" for p in prefixes}):
            self[p]

    def __getitem__(self, prefix: str | None) -> str:
        p = prefix or ""
        colour = self._of.get(p)
        if colour is None:
            n = len(self._of)
            colour = PREFIX_PALETTE[n] if n < len(PREFIX_PALETTE) else extra_colour(n)
            self._of[p] = colour
        return colour

    def __contains__(self, prefix: object) -> bool:
        return prefix in self._of

    def mapping(self) -> dict[str, str]:
        """{prefix: colour} of every prefix given a colour so far."""
        return dict(self._of)
