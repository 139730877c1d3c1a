"""Process facts for the benchmarks, read from /proc (not a benchmark itself)."""

from __future__ import annotations

from pathlib import Path


def rss_bytes(pids: list[int]) -> int:
    """The summed resident memory of ``pids`` (processes that are gone count 0)."""
    total = 0
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total
