"""Process facts for the benchmarks, read from /proc (not a benchmark itself)."""

from __future__ import annotations

import os
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


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (threads' children included)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def named(comm: str) -> list[int]:
    """Every process whose command name is ``comm`` (e.g. the machine's ``postgres``)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if (d / "comm").read_text().strip() == comm:
                    out.append(int(d.name))
            except OSError:
                pass
    return out


def pin(pids: list[int], cpus: set[int]) -> dict[int, set[int]]:
    """Restrict ``pids`` to ``cpus`` (children forked later inherit it); returns what each
    had, for :func:`unpin`. Processes that are gone, or not ours to move, are skipped."""
    before = {}
    for p in pids:
        try:
            before[p] = os.sched_getaffinity(p)
            os.sched_setaffinity(p, cpus)
        except OSError:
            before.pop(p, None)
    return before


def unpin(before: dict[int, set[int]]) -> None:
    for p, cpus in before.items():
        try:
            os.sched_setaffinity(p, cpus)
        except OSError:
            pass
