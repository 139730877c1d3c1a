"""Axes that read at a glance: bytes as "977 KiB" and "1.43 MiB" on ticks a power of two
apart, seconds since the run's start as "0 0.5 1 1.5 s", "2:30" or "1:02:30", and ranges of
non-negative data that start at 0 (an all-zero series spans 0 to 1, not -1 to 1)."""

from __future__ import annotations

import logging
import math
from typing import Any

from bokeh.models import (
    AdaptiveTicker,
    CompositeTicker,
    CustomJSHover,
    CustomJSTickFormatter,
    DataRange1d,
)

logger = logging.getLogger(__name__)

#: ``bytes(b)``: three significant digits in binary units; 0 as "0" (an axis' origin).
BYTES_JS = """
function bytes(b) {
  if (b === 0 || !isFinite(b)) return String(b);
  const units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
  let v = Math.abs(b), i = 0;
  while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
  const digits = i === 0 ? 0 : v >= 100 ? 0 : v >= 10 ? 1 : 2;
  return (b < 0 ? "-" : "") + Number(v.toFixed(digits)) + " " + units[i];
}
"""

#: ``clock(ticks)``: seconds under two minutes, as many decimals as the ticks need to differ
#: and the unit on the last, as a ruler reads ("0", "0.5", "1", "1.5 s": a unit on every
#: tick ran them together on a phone); else "m:ss" or "h:mm:ss".
CLOCK_JS = """
function clock(ticks) {
  const most = Math.max(...ticks.map(Math.abs));
  if (most < 120) {
    let d = 0;
    while (d < 4 && ticks.some(t => Math.abs(Math.round(t * 10 ** d) - t * 10 ** d) > 1e-6)) d++;
    return ticks.map((t, i) => Number(t.toFixed(d)) + (i === ticks.length - 1 ? " s" : ""));
  }
  const two = n => String(n).padStart(2, "0");
  return ticks.map(t => {
    const sign = t < 0 ? "-" : "", s = Math.round(Math.abs(t));
    const h = Math.floor(s / 3600), m = Math.floor(s / 60) % 60, sec = s % 60;
    return sign + (h ? h + ":" + two(m) : String(m)) + ":" + two(sec);
  });
}
"""


def byte_formatter() -> CustomJSTickFormatter:
    """Tick labels of a byte axis."""
    return CustomJSTickFormatter(code=BYTES_JS + "return bytes(tick);")


def byte_hover() -> CustomJSHover:
    """A hover field's bytes (``formatters={"$y": byte_hover()}``)."""
    return CustomJSHover(code=BYTES_JS + "return bytes(value);")


def byte_ticker() -> AdaptiveTicker:
    """Ticks a power of two apart (256 KiB, 512 KiB, 768 KiB, 1 MiB), never a fraction of
    a byte."""
    return AdaptiveTicker(base=1024, mantissas=[2**i for i in range(10)], min_interval=1)


def bytes_axis(fig: Any) -> None:
    """Make ``fig``'s y axis a byte axis."""
    fig.yaxis.ticker = byte_ticker()
    fig.yaxis.formatter = byte_formatter()


def clock_ticker() -> CompositeTicker:
    """Ticks 1-2-5 apart under ten seconds; from ten seconds on 10, 15, 20 or 30 seconds,
    minutes or hours apart (base 60)."""
    return CompositeTicker(
        tickers=[
            AdaptiveTicker(mantissas=[1, 2, 5], base=10, max_interval=10),
            AdaptiveTicker(mantissas=[1, 2, 5, 10, 15, 20, 30], base=60, min_interval=10),
        ]
    )


def clock_formatter() -> CustomJSTickFormatter:
    """Tick labels of seconds since the run's start (see :data:`CLOCK_JS`)."""
    return CustomJSTickFormatter(code=CLOCK_JS + "return clock(ticks)[index];")


def clock_axis(fig: Any) -> None:
    """Make ``fig``'s x axis read seconds since the run's start."""
    fig.xaxis.ticker = clock_ticker()
    fig.xaxis.formatter = clock_formatter()


def from_zero(name: str | None = None) -> DataRange1d:
    """A y range for non-negative data: from 0 to a little past the largest value, 0 to 1
    when every value is 0."""
    return DataRange1d(start=0, default_span=2, name=name)


def format_bytes(b: float) -> str:
    """``b`` as :data:`BYTES_JS` writes it: "977 KiB", "1.43 MiB", "0"."""
    if b == 0:
        return "0"
    if not math.isfinite(b):
        return str(b)
    units = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")
    v, i = abs(b), 0
    while v >= 1024 and i < len(units) - 1:
        v /= 1024
        i += 1
    digits = 0 if i == 0 or v >= 100 else 1 if v >= 10 else 2
    return f"{'-' if b < 0 else ''}{float(f'{v:.{digits}f}'):g} {units[i]}"


def format_seconds(s: float) -> str:
    """A duration in three significant digits: "850 µs", "12.5 ms", "3.2 s", "2.5 min"."""
    for unit, scale in (("min", 60.0), ("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if abs(s) >= scale or unit == "µs":
            return f"{float(f'{s / scale:.3g}'):g} {unit}"
    raise AssertionError("unreachable")
