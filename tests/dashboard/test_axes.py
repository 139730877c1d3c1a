"""The dashboard's axes, colours and legends without a browser: bytes and durations as
the plots write them, lines broken where samples are missing, a colour per prefix."""

from __future__ import annotations

import math

import pytest

from services.dashboard.axes import format_bytes, format_seconds
from services.dashboard.colours import PREFIX_PALETTE, PrefixColours
from services.dashboard.plots import _envelopes, progress_series, with_gaps


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (0, "0"),
        (1, "1 B"),
        (1000, "1000 B"),
        (1024, "1 KiB"),
        (512 * 1024, "512 KiB"),
        (1_000_000, "977 KiB"),
        (1.431 * 2**20, "1.43 MiB"),
        (1.5 * 2**20, "1.5 MiB"),
        (12.34 * 2**30, "12.3 GiB"),
        (-2048, "-2 KiB"),
    ],
)
def test_bytes_read_in_binary_units_to_three_digits(value, text):
    """The memory axes read "976.563KiB / 1.431MiB"."""
    assert format_bytes(value) == text


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (0.00085, "850 µs"),
        (0.0125, "12.5 ms"),
        (3.2, "3.2 s"),
        (45.678, "45.7 s"),
        (150, "2.5 min"),
    ],
)
def test_durations_read_in_their_unit_to_three_digits(value, text):
    assert format_seconds(value) == text


def test_a_line_breaks_where_samples_are_missing():
    xs, ys = with_gaps([0, 1, 2, 5, 6], [1, 2, 3, 4, 5])
    assert xs[:3] == [0, 1, 2] and math.isnan(xs[3]) and xs[4:] == [5, 6]
    assert math.isnan(ys[3]) and ys[4:] == [4, 5]
    # samples a little late are not missing
    assert with_gaps([0, 1, 2.4, 3.4], [0, 0, 0, 0])[0] == [0, 1, 2.4, 3.4]


def test_two_samples_are_not_a_gap():
    assert with_gaps([0.0, 5.0], [1, 2]) == ([0.0, 5.0], [1, 2])


def test_a_prefix_line_starts_where_the_prefix_does():
    """A prefix's progress starts at zero at the bucket before its first completion, not
    as a flat zero from the run's start."""
    progress = {"bucket_seconds": 1.0, "times": [1.0, 2.0, 3.0, 4.0],
                "prefixes": {"a": [1, 1, 0, 0], "b": [0, 0, 2, 1]}}  # fmt: skip
    got = {
        s["worker"]: [(p["time"], p["value"]) for p in s["points"]]
        for s in progress_series(progress)
    }
    assert got["a"] == [(0.0, 0), (1.0, 1), (2.0, 2), (3.0, 2), (4.0, 2)]
    assert got["b"] == [(2.0, 0), (3.0, 2), (4.0, 3)]


def test_prefixes_take_distinct_colours_by_name():
    """Parse_chunk and call_api were both teal (Dask hashes a prefix
    into 18 viridis colours). Sorted by name, a page's prefixes take the palette in turn:
    twenty distinct colours, and the same prefix the same colour whatever order a page
    meets them in."""
    names = [f"prefix-{i:02d}" for i in range(20)]
    colours = PrefixColours(reversed(names))
    assert [colours[n] for n in names] == list(PREFIX_PALETTE)
    assert (
        PrefixColours(["parse_chunk", "call_api"])["parse_chunk"]
        == PrefixColours(["call_api", "parse_chunk", "call_api"])["parse_chunk"]
    )
    assert len(set(PREFIX_PALETTE)) == len(PREFIX_PALETTE) == 20


def test_a_prefix_met_late_takes_the_next_colour_and_keeps_it():
    colours = PrefixColours(["a", "b"])
    late = colours["zzz"]
    assert late not in (colours["a"], colours["b"]) and colours["zzz"] == late
    assert "zzz" in colours and "other" not in colours
    many = PrefixColours(f"p{i:03d}" for i in range(60))
    assert len(set(many.mapping().values())) == 60


def test_a_downsampled_series_has_its_min_max_band_broken_where_samples_are_missing():
    """A point standing for a bin of samples shows their range: a spike between two points
    is still drawn; the band breaks where the line does, and a series of single samples
    (min equal to max) has none."""
    pts = [{"time": t, "value": t, "min": t - 1, "max": t + 5} for t in (0, 1, 2, 5, 6)]
    single = [{"time": t, "value": 3.0, "min": 3.0, "max": 3.0} for t in (0, 1, 2)]
    band = _envelopes(
        [{"worker": "a", "points": pts}, {"worker": "b", "points": single}], 0, {"a": "red"}
    )
    assert band["xs"] == [[0, 1, 2, 2, 1, 0], [5, 6, 6, 5]]
    assert band["ys"] == [[5, 6, 7, 1, 0, -1], [10, 11, 5, 4]]
    assert band["colour"] == ["red", "red"]
