"""One agent in a process of its own, for the spool adoption tests (locks are per process).

``python -m tests.sdk.spool_agent hold URL SPOOL CLUSTER N``: an agent that cannot reach
the collector spools N events of one run (:func:`run_events`, in batches of 10), prints its
directory and stays alive, holding the directory, until it is killed or its stdin closes.

``python -m tests.sdk.spool_agent adopt URL SPOOL CLUSTER``: an agent starts, waits for its
adoption thread's first complete look at the spool root, prints what it found and closes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from typing import Any

from hindsight.agent import Agent
from hindsight.config import Settings
from hindsight.schema import CustomEvent, RunEvent, StartStop, TaskEvent


def settings(url: str, spool_dir: str, cluster: str) -> Settings:
    return Settings(
        url=url,
        cluster=cluster,
        spool_dir=spool_dir,
        flush_events=10,
        flush_interval=0.05,
        close_timeout=0.5,
    )


def task_key(i: int) -> str:
    return f"('inc', {i})"


def run_events(run: str, n: int) -> list[Any]:
    """``n`` events of one finished run named ``run``: its start, ``n - 2`` tasks
    (:func:`task_key` 0, 1, ...), its end."""
    t0 = time.time() - n
    tasks = [
        TaskEvent(key=task_key(i), prefix="inc", status="memory", run=run, worker="tcp://w:1",
                  startstops=[StartStop("compute", t0 + i, t0 + i + 0.5)])
        for i in range(n - 2)
    ]  # fmt: skip
    return [
        RunEvent("started", run, t0 - 1, name=run),
        *tasks,
        RunEvent("finished", run, t0 + n),
    ]


def hold(url: str, spool_dir: str, cluster: str, n: int) -> None:
    agent = Agent(settings(url, spool_dir, cluster), session="held", name="held")
    for event in run_events("held", n):
        agent.add(event)
    directory = os.path.join(spool_dir, agent.name)
    deadline = time.monotonic() + 60
    while True:
        try:
            files = [f for f in os.listdir(directory) if f.endswith(".hsb")]
        except FileNotFoundError:
            files = []
        if len(files) == n // 10:
            break
        if time.monotonic() > deadline:
            raise SystemExit(f"only {len(files)} batches spooled")
        time.sleep(0.02)
    print(json.dumps({"agent": agent.name, "directory": directory}), flush=True)
    sys.stdin.read()


def adopt(url: str, spool_dir: str, cluster: str) -> None:
    agent = Agent(settings(url, spool_dir, cluster), session="adopter", name="adopter")
    agent.add(CustomEvent(stream="adopter", time=0.0, value=0))
    assert agent.adoption is not None
    if not agent.adoption.scanned.wait(60):
        raise SystemExit("adoption never finished a look at the spool root")
    found = {
        "live": agent.adoption.live,
        "deliveries": [dataclasses.asdict(d) for d in agent.adoption.deliveries],
    }
    print(json.dumps(found), flush=True)
    agent.close()


if __name__ == "__main__":
    mode, url, spool_dir, cluster, *rest = sys.argv[1:]
    if mode == "hold":
        hold(url, spool_dir, cluster, int(rest[0]))
    else:
        adopt(url, spool_dir, cluster)
