"""A run's failures, grouped by what failed."""

from __future__ import annotations

import json
import re
from typing import Any

from storage.analysis.rundata import RunData

# Numbers and ids in an exception's text: "bad record 17", "TaskID(98b3...) was
# cancelled", "0x7f3a..." are one error each, not one per task. Possessive, so a long run
# of hex letters costs one pass (it backtracked: 23 s on a 64 KB message).
_VARIES = re.compile(r"0x[0-9a-fA-F]++|\b(?=[a-fA-F]*+[0-9])[0-9a-fA-F]++\b")
# ... except a number that names the error: an exit status, an HTTP or SQL code, a signal,
# a device ("exit status 1" and "exit status 137" are different failures).
_NAMED_BY = re.compile(
    r"(?:status|code|errno|sqlstate|signal|exit|device|http\w*|error)\W{0,3}$", re.IGNORECASE
)


def error_fingerprint(text: str) -> str:
    """The exception text with its numbers and hex ids as ``#``: what groups errors."""

    def mask(m: re.Match[str]) -> str:
        return m.group(0) if _NAMED_BY.search(text, max(0, m.start() - 16), m.start()) else "#"

    return _VARIES.sub(mask, text)


def errors(data: RunData) -> list[dict[str, Any]]:
    """Erred tasks grouped by exception text, its numbers and hex ids set aside (the first
    text is the group's ``exception``; ``messages`` counts the distinct texts), largest
    group first."""
    import pyarrow.compute as pc

    groups: dict[str, dict[str, Any]] = {}
    fingerprints: dict[str, str] = {}  # per distinct text (a failed task's dependents share it)
    columns = ["key", "prefix", "status", "worker", "exception", "traceback", "attrs"]
    # Filter in Arrow first, a row group at a time: a 100k-task run has a handful of
    # failures, not 100k Python rows, and a big run's columns are not all held.
    erred = (
        r
        for t in data.parts("tasks", columns)
        for r in t.filter(pc.equal(t["status"], "erred")).to_pylist()
    )
    for r in erred:
        exc = r["exception"] or "(no exception recorded)"
        fp = fingerprints.get(exc)
        if fp is None:
            fp = fingerprints[exc] = error_fingerprint(exc)
        g = groups.get(fp)
        if g is None:
            g = groups[fp] = {
                "exception": exc,
                "count": 0,
                "retried": 0,
                "messages": 0,
                "prefixes": {},
                "workers": set(),
                "keys": [],
                "traceback": r["traceback"],
            }
        g["count"] += 1
        if r["attrs"] and json.loads(r["attrs"]).get("retried") is True:
            g["retried"] += 1  # an attempt Dask's retries= ran again
        g["prefixes"][r["prefix"]] = g["prefixes"].get(r["prefix"], 0) + 1
        if r["worker"]:
            g["workers"].add(r["worker"])
        if len(g["keys"]) < 10:
            g["keys"].append(r["key"])
    for fp in fingerprints.values():  # each distinct text once
        groups[fp]["messages"] += 1
    out = sorted(groups.values(), key=lambda g: (-g["count"], g["exception"]))
    for g in out:
        g["workers"] = sorted(g["workers"])
    return out
