"""A bench's result (not a benchmark itself): its one JSON line on stdout, and the same line
appended to ``bench/results/NAME.jsonl`` with the date, the commit and a gauge of how fast
the host was, so that figures from different hosts can be told apart."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.lib_workload import encoded_batches
from collector.body import decompress
from hindsight.schema import decode_batch
from hindsight.sender import ZSTD_LEVEL

RESULTS = Path(__file__).resolve().parent / "results"
#: One core's task events/s through decompression and decode-and-validate of the agent's
#: 5,000-event batches: the collector's first step, and what bench/ingest.py reports as
#: ``decode_limit_events_per_s``.
GAUGE = "decode_events_per_s"


def decode_rate(batches: int = 4, rounds: int = 3) -> float:
    """The gauge, measured now: the best of ``rounds`` passes over fixed batches."""
    bodies = encoded_batches(batches, level=ZSTD_LEVEL)
    best = 0.0
    for _ in range(rounds):
        t0 = time.process_time()
        for body in bodies:
            decode_batch(decompress(body, "zstd", 1 << 26))
        best = max(best, batches * 5000 / (time.process_time() - t0))
    return best


def commit() -> str | None:
    """The checked-out commit, when this is a git work tree with git installed."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=RESULTS.parent,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def report(
    bench: str,
    figures: dict[str, Any],
    targets: dict[str, Any],
    met: bool,
    *,
    gauge: float | None = None,
) -> None:
    """Print the bench's JSON line, then append it to its results file with ``date``,
    ``commit``, ``gauge`` (``gauge``: the value when the bench measured it itself) and the
    command line's arguments (a quick run with small sizes is not a full one)."""
    line = {"bench": bench, "figures": figures, "targets": targets, "met": met}
    print(json.dumps(line), flush=True)
    record = {
        **line,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": commit(),
        "gauge": {"name": GAUGE, "value": round(decode_rate() if gauge is None else gauge)},
        "argv": sys.argv[1:],
    }
    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / f"{bench}.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")
