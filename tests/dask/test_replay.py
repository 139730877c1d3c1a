"""Replay end to end: a real LocalCluster (worker processes) records into a real embedded
server; the test snapshots the live scheduler at held moments and reads the same moments
back through ``GET /v1/runs/{id}/state`` (and ``hindsight.Client.state``) only.

The run's tasks block on Dask ``Event``s, so its state holds still while the test
snapshots it and until a later sample is recorded; releasing the events moves it on.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest

from hindsight.client import Client as HindsightClient
from tests.dask.conftest import EmbeddedServer, wait_for_run, wait_until

INTERVAL = 0.25
FIELDS = ("waiting", "processing", "memory", "released", "erred")
# Dask's task states as its status page's progress bars group them.
GROUPS = {"queued": "waiting", "no-worker": "waiting", "forgotten": "released"}
PREFIXES = ("quick", "hold", "combine")
TASKS = 6 + 4 + 2


def quick(x: int) -> int:
    return x


def hold(x: int, event: str) -> int:
    from distributed import Event

    Event(event).wait()
    return x


def hold_later(x: int, event: str) -> int:
    return hold(x, event)


def combine(a: int, b: int) -> int:
    return a + b


def live_snapshot(dask_scheduler: Any) -> dict[str, Any]:
    """What the scheduler shows now: task states of our prefixes, processing per worker."""
    prefixes: dict[str, dict[str, int]] = {}
    for ts in dask_scheduler.tasks.values():
        name = ts.prefix.name
        if name in ("quick", "hold", "combine"):
            row = prefixes.setdefault(
                name, dict.fromkeys(("waiting", "processing", "memory", "released", "erred"), 0)
            )
            state = {"queued": "waiting", "no-worker": "waiting"}.get(ts.state, ts.state)
            row[state] += 1
    workers = {addr: len(ws.processing) for addr, ws in dask_scheduler.workers.items()}
    return {"time": time.time(), "prefixes": prefixes, "workers": workers}


def replayed(body: dict[str, Any]) -> dict[str, Any]:
    return {
        "prefixes": {p["prefix"]: {k: p[k] for k in FIELDS} for p in body["prefixes"]},
        "workers": {w["worker"]: w["processing"] for w in body["workers"]},
    }


@contextlib.contextmanager
def local_zone(zone: str) -> Iterator[None]:
    """This process's local time zone is ``zone`` inside the block."""
    before = os.environ.get("TZ")
    os.environ["TZ"] = zone
    time.tzset()
    try:
        yield
    finally:
        if before is None:
            del os.environ["TZ"]
        else:
            os.environ["TZ"] = before
        time.tzset()


def state(server: EmbeddedServer, run_id: str, at: float) -> dict[str, Any]:
    return server.get(f"/v1/runs/{run_id}/state", at=repr(at))


@pytest.fixture(scope="module")
def recorded(hindsight_server: EmbeddedServer) -> dict[str, Any]:
    import dask
    from distributed import Client, Event, LocalCluster, span

    server = hindsight_server
    cluster = f"replay-{uuid.uuid4().hex[:8]}"
    config = {
        "hindsight.url": server.url,
        "hindsight.cluster": cluster,
        "hindsight.sample-interval": INTERVAL,
        "hindsight.flush-interval": INTERVAL,
    }
    out: dict[str, Any] = {"cluster": cluster, "held": []}
    with dask.config.set(config), LocalCluster(
        n_workers=2, threads_per_worker=3, processes=True, dashboard_address=":0",
        scheduler_kwargs={"preload": ["hindsight.dask"]},
    ) as lc, Client(lc) as client:  # fmt: skip
        events = [Event(f"{cluster}-first", client), Event(f"{cluster}-second", client)]
        quicks = [dask.delayed(quick)(i) for i in range(6)]
        holds = [dask.delayed(hold)(i, events[i // 2].name) for i in range(4)]
        combines = [dask.delayed(combine)(holds[i], holds[i + 2]) for i in range(2)]
        with span("replay"):
            futures = client.compute([*quicks, *combines])

        def run_id() -> str | None:
            run = server.run_named(cluster, "replay")
            return run["id"] if run else None

        out["run"] = rid = wait_until(run_id, 60, "the run in the index")

        def held(check: Any) -> dict[str, Any]:
            """Once the live state satisfies ``check``, snapshot it, then wait until the
            API has a sample taken one interval later (the state cannot move meanwhile)."""
            snap = wait_until(
                lambda: (s := client.run_on_scheduler(live_snapshot)) and check(s) and s,
                60,
                "the held state",
            )
            until = snap["time"] + INTERVAL
            wait_until(
                lambda: (state(server, rid, time.time())["sampled_at"] or 0) >= until,
                60,
                "a sample after the snapshot",
            )
            out["held"].append(snap)
            return snap

        def prefix(s: dict[str, Any], name: str, field: str) -> int:
            return s["prefixes"].get(name, {}).get(field, 0)

        # All quick tasks done, the four holds blocked on their events.
        held(lambda s: prefix(s, "quick", "memory") == 6 and prefix(s, "hold", "processing") == 4)
        events[0].set()
        held(lambda s: prefix(s, "hold", "memory") == 2 and prefix(s, "hold", "processing") == 2)
        events[1].set()
        client.gather(futures)
        # Another run starts at once, before the scheduler sees this one done (up to one
        # interval later): its tasks are not this run's end (at the end of a run, neither
        # worker reads as "processing" the next run's tasks).
        later = Event(f"{cluster}-later", client)
        with span("later"):
            nexts = [client.submit(hold_later, i, later.name) for i in range(2)]
        # The run's end is recorded while its results are still held.
        wait_for_run(server, cluster, "replay", TASKS)
        out["final"] = client.run_on_scheduler(live_snapshot)
        later.set()
        client.gather(nexts)
    return out


def test_replay_equals_the_live_scheduler_at_held_moments(hindsight_server, recorded):
    server = hindsight_server
    rid = recorded["run"]
    for snap in recorded["held"]:
        at = snap["time"] + INTERVAL
        body = state(server, rid, at)
        # The sample is the one taken within one sampling interval of the moment asked.
        assert snap["time"] - INTERVAL <= body["sampled_at"] <= at
        assert body["time"] == pytest.approx(at)
        assert replayed(body) == {"prefixes": snap["prefixes"], "workers": snap["workers"]}
        # The same through the Python client, as DataFrames.
        got = HindsightClient(server.url).state(rid, at=at)
        workers = dict(zip(got["workers"].worker, got["workers"].processing, strict=True))
        assert workers == snap["workers"]
        hold_row = got["prefixes"].set_index("prefix").loc["hold"]
        assert {k: int(hold_row[k]) for k in FIELDS} == snap["prefixes"]["hold"]
        # A naive datetime is UTC here as in every other parameter (state() and
        # runs(since=) alike, whatever the machine's zone).
        naive = datetime.fromtimestamp(at, UTC).replace(tzinfo=None)
        with local_zone("America/New_York"):
            got = HindsightClient(server.url).state(rid, at=naive)["time"]
            assert got.timestamp() == pytest.approx(at) and str(got.tz) == "UTC"
    first, second = recorded["held"]
    assert first["prefixes"]["hold"]["processing"] == 4
    assert second["prefixes"]["hold"]["memory"] == 2


def test_states_sum_to_the_run_and_nothing_is_left_after_it(hindsight_server, recorded):
    server = hindsight_server
    run = wait_for_run(server, recorded["cluster"], "replay", TASKS)
    detail = server.get(f"/v1/runs/{run['id']}")
    assert detail["graph_count"] == TASKS
    samples = state(server, run["id"], run["finished_at"])["samples"]
    assert samples["samples"] >= 3
    moments = [run["started_at"], samples["first"], run["finished_at"], samples["last"]]
    moments += [snap["time"] for snap in recorded["held"]]
    lo, hi = samples["first"], samples["last"]
    moments += [lo + (hi - lo) * i / 7 for i in range(8)]
    for at in moments:
        body = state(server, run["id"], at)
        assert {p["prefix"] for p in body["prefixes"]} == set(PREFIXES), at
        assert sum(p[k] for p in body["prefixes"] for k in FIELDS) == TASKS, (at, body)
    # A moment outside the run is no moment of it: a 400 saying when it ran, not every task
    # waiting.
    import requests

    url = f"{server.url}/v1/runs/{run['id']}/state"
    for at in (run["started_at"] - 1, max(run["finished_at"], samples["last"]) + 60):
        resp = requests.get(url, params={"at": repr(at)}, timeout=30)
        assert resp.status_code == 400, resp.text
        assert "outside the run" in resp.json()["error"]["message"]
    # At its start, before the first sample, no task had finished, by their records.
    before = state(server, run["id"], run["started_at"])
    assert sum(p["memory"] + p["released"] + p["erred"] for p in before["prefixes"]) == 0
    # From the run's end on: nothing waiting or processing, on any worker either; what
    # was in memory at the end is what the scheduler held when the run was gathered.
    final = recorded["final"]["prefixes"]
    for at in (run["finished_at"], samples["last"]):
        body = state(server, run["id"], at)
        for p in body["prefixes"]:
            assert p["waiting"] == p["processing"] == 0, body
            assert p["erred"] == 0
        assert all(w["processing"] == 0 for w in body["workers"]), body
        got = {p["prefix"]: p["memory"] for p in body["prefixes"]}
        assert got == {name: final.get(name, {}).get("memory", 0) for name in PREFIXES}
    assert {w["worker"] for w in body["workers"]} == set(recorded["final"]["workers"])
    assert all(w["memory"]["limit"] > 0 for w in body["workers"])
    assert set(body["thresholds"]) == {"target", "spill", "pause", "terminate"}


def test_state_at_a_moment_given_as_epoch_or_iso_or_now(hindsight_server, recorded):
    import requests

    url = f"{hindsight_server.url}/v1/runs/{recorded['run']}/state"
    resp = requests.get(url, params={"at": "yesterday"}, timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_parameter"
    # Without a moment: now, so a finished run's last sample.
    now = requests.get(url, timeout=30).json()
    assert now["sampled_at"] == now["samples"]["last"]
    # A whole second within the run, as an ISO 8601 time.
    moment = datetime.fromtimestamp(math.ceil(now["samples"]["first"]), UTC)
    resp = requests.get(url, params={"at": moment.isoformat()}, timeout=30)
    assert resp.status_code == 200 and resp.json()["time"] == moment.timestamp()
