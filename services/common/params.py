"""Query-string parsing with clear 400s (and size caps on every parameter)."""

from __future__ import annotations

import re
from datetime import UTC, date, datetime

from flask import request

from hindsight.schema import MAX_TIME, valid_name
from services.common.errors import ApiError

MAX_PARAM = 256


def bad(name: str, message: str) -> ApiError:
    return ApiError(400, "invalid_parameter", f"{name}: {message}")


def only_args(*names: str) -> None:
    """400 for a parameter the route does not take: a misspelled filter (``clusters=``)
    ignored would give an unfiltered answer that looks like an answer.
    Names starting with ``_`` (cache busters) pass."""
    for given in request.args:
        if given not in names and not given.startswith("_"):
            takes = f"it takes {', '.join(names)}" if names else "it takes none"
            raise bad(given[:64], f"not a parameter of this route ({takes})")


def arg(name: str, max_length: int = MAX_PARAM) -> str | None:
    value = request.args.get(name)
    if value is None or value == "":
        return None
    if len(value) > max_length:
        raise bad(name, f"longer than {max_length} characters")
    return value


# Numbers as an API writes them: Python's int() and float() also take "1_000", " 5" and
# other scripts' digits ("١٢"), which no client means.
_INT = re.compile(r"[+-]?[0-9]+", re.ASCII)
_FLOAT = re.compile(
    r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?|[+-]?(nan|inf|infinity)", re.I
)


def _float(value: str) -> float:
    if not _FLOAT.fullmatch(value):
        raise ValueError(value)
    return float(value)


def int_arg(name: str, default: int, lo: int, hi: int) -> int:
    value = arg(name)
    if value is None:
        return default
    try:
        if not _INT.fullmatch(value):
            raise ValueError(value)
        n = int(value)
    except ValueError:
        raise bad(name, "must be an integer") from None
    if not lo <= n <= hi:
        raise bad(name, f"must be between {lo} and {hi}")
    return n


def _is_date(value: str) -> bool:
    """A day alone in an ISO 8601 form Python reads (2026-11-21, 20261121, 2026-W47-6)."""
    try:
        date.fromisoformat(value)
    except ValueError:
        return False
    return True


def time_arg(name: str) -> float | None:
    """Unix epoch seconds, or an ISO 8601 date/time (UTC unless it says otherwise). A
    date alone given as ``until`` means the end of that day."""
    value = arg(name)
    if value is None:
        return None
    try:
        if len(value) == 8 and value.isdigit() and _is_date(value):
            # 20261126 is a day (as seconds it is 1970, when nothing was recorded)
            raise ValueError(value)
        t = _float(value)
    except ValueError:
        # An unencoded "+01:00" offset arrives as " 01:00": put the plus back.
        value = re.sub(r"(T[\d:.]+) (\d{2}:?\d{2})$", r"\1+\2", value.replace("Z", "+00:00"))
        try:
            dt = datetime.fromisoformat(value)
        except ValueError:
            raise bad(name, "must be epoch seconds or an ISO 8601 time") from None
        if dt.tzinfo is None:
            dt = dt.replace(tzinfo=UTC)
        t = dt.timestamp()
        if name == "until" and _is_date(value):
            # A day named alone as the upper bound includes that day (bounds are exclusive).
            t += 86400.0
    # The times a batch may carry (NaN, infinities and years past 5138 failed date maths)
    if not 0 <= t <= MAX_TIME:
        raise bad(name, f"must be a time between 1970 and the year 5138 (0 to {MAX_TIME:.0f} s)")
    return t


def choice_arg(name: str, choices: tuple[str, ...]) -> str | None:
    value = arg(name)
    if value is not None and value not in choices:
        raise bad(name, f"must be one of {', '.join(choices)}")
    return value


def name_arg(name: str) -> str | None:
    value = arg(name)
    if value is not None and not valid_name(value):
        raise bad(name, "not a valid name")
    return value


def float_arg(name: str, lo: float | None = None, hi: float | None = None) -> float | None:
    """A finite number, optionally bounded."""
    value = arg(name)
    if value is None:
        return None
    try:
        x = _float(value)
    except ValueError:
        raise bad(name, "must be a number") from None
    if x != x or x in (float("inf"), float("-inf")):
        raise bad(name, "must be a finite number")
    if (lo is not None and x < lo) or (hi is not None and x > hi):
        if hi is None:
            raise bad(name, f"must be at least {lo:g}")
        if lo is None:
            raise bad(name, f"must be at most {hi:g}")
        raise bad(name, f"must be between {lo:g} and {hi:g}")
    return x


def bool_arg(name: str) -> bool | None:
    """``true``/``false`` (also 1/0, yes/no)."""
    value = arg(name)
    if value is None:
        return None
    lowered = value.lower()
    if lowered in ("true", "1", "yes"):
        return True
    if lowered in ("false", "0", "no"):
        return False
    raise bad(name, "must be true or false")


def label_arg(name: str, max_length: int = MAX_PARAM) -> str | None:
    """Free text (a prefix, a worker address, a metric name), length-capped and without
    control characters (Postgres refuses NUL in text; no recorded label holds one)."""
    value = arg(name, max_length)
    if value is not None and any(ord(ch) < 32 for ch in value):
        raise bad(name, "contains control characters")
    return value
