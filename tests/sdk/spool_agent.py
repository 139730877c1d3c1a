"""One agent in a process of its own, for the spool adoption tests (locks are per process).

``python -m tests.sdk.spool_agent hold URL SPOOL N``: an agent whose batches the collector
refuses with 503 spools N events (in batches of 10), prints its directory and stays alive,
holding the directory, until it is killed or its stdin closes.

``python -m tests.sdk.spool_agent adopt URL SPOOL``: an agent starts, waits for its adoption
thread's first complete look at the spool root, prints what it found and closes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

from hindsight.agent import Agent
from hindsight.config import Settings
from hindsight.schema import CustomEvent


def settings(url: str, spool_dir: str) -> Settings:
    return Settings(
        url=url,
        cluster="adopt-test",
        spool_dir=spool_dir,
        flush_events=10,
        flush_interval=0.05,
        close_timeout=0.5,
    )


def hold(url: str, spool_dir: str, n: int) -> None:
    agent = Agent(settings(url, spool_dir), session="held", name="held")
    for i in range(n):
        agent.add(CustomEvent(stream="held", time=float(i), value=i))
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


def adopt(url: str, spool_dir: str) -> None:
    agent = Agent(settings(url, spool_dir), session="adopter", name="adopter")
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
    mode, url, spool_dir, *rest = sys.argv[1:]
    if mode == "hold":
        hold(url, spool_dir, int(rest[0]))
    else:
        adopt(url, spool_dir)
