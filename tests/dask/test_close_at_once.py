"""Batch scripts end as ``compute()`` then ``client.close(); cluster.close()`` at once. The
record of their last second must be whole (the fine metrics of the last wave of tasks
included), and closing must cost no more than an unrecorded cluster's close, the collector
up or not."""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

from tests.dask.conftest import EmbeddedServer, free_port, wait_for_run, wait_until

N = 8


def parse(i: int) -> int:
    return i


def enrich(x: int) -> int:
    deadline = time.process_time() + 0.25  # CPU: thread-cpu
    n = 0
    while time.process_time() < deadline:
        n += 1
    return x + (n > 0)


def call_api(x: int) -> int:
    time.sleep(0.5)  # waiting: thread-noncpu
    return x


def aggregate(xs: list[int]) -> int:
    time.sleep(0.3)
    return sum(xs)


def pipeline(config: dict[str, Any], n_workers: int = 2) -> float:
    """The script: build, compute, close everything at once. Returns the close's seconds."""
    import dask
    from distributed import Client, LocalCluster, span

    with dask.config.set(config):
        cluster = LocalCluster(
            n_workers=n_workers,
            threads_per_worker=2,
            processes=True,
            dashboard_address=":0",
            scheduler_kwargs={"preload": ["hindsight.dask"]} if config else {},
        )
        client = Client(cluster)
        parsed = [dask.delayed(parse)(i) for i in range(N)]
        enriched = [dask.delayed(enrich)(p) for p in parsed]
        called = [dask.delayed(call_api)(e) for e in enriched]
        with span("close-at-once"):
            total = dask.delayed(aggregate)(called).compute()
        assert total == sum(range(N)) + N
        began = time.perf_counter()
        client.close()
        cluster.close()
        return time.perf_counter() - began


def test_fine_metrics_of_a_script_that_closes_at_once_are_whole(
    hindsight_server: EmbeddedServer, tmp_path
):
    server = hindsight_server
    cluster = f"close-{uuid.uuid4().hex[:8]}"
    config = {
        "hindsight.url": server.url,
        "hindsight.cluster": cluster,
        "hindsight.spool-dir": str(tmp_path / "spool"),
    }
    pipeline(config)
    run = wait_for_run(server, cluster, "close-at-once", 3 * N + 1)
    # Every prefix's thread seconds (cpu and noncpu) are the task records' compute seconds.
    compute: dict[str, float] = {}
    for t in server.tasks(run["id"]):
        for ph in t["startstops"]:
            if ph["action"] == "compute":
                compute[t["prefix"]] = compute.get(t["prefix"], 0.0) + ph["stop"] - ph["start"]

    def thread_seconds() -> dict[str, float]:
        rows = server.get(f"/v1/runs/{run['id']}/activity")["activity"]
        out: dict[str, float] = {}
        for r in rows:
            if r["context"] == "execute" and r["unit"] == "seconds":
                if r["activity"] in ("thread-cpu", "thread-noncpu"):
                    out[r["prefix"]] = out.get(r["prefix"], 0.0) + r["value"]
        return out

    def whole() -> dict[str, float] | None:
        got = thread_seconds()
        return got if set(got) >= {"enrich", "call_api", "aggregate"} else None

    # Replay at any moment: each prefix's finished tasks are the records' that ended by then.
    records = server.tasks(run["id"])
    ends = sorted(max(ph["stop"] for ph in t["startstops"]) for t in records)
    samples = server.get(f"/v1/runs/{run['id']}/state")["samples"]
    hi = max(t for t in (run["finished_at"], samples["last"]) if t is not None)
    moments = [ends[0] - 0.001, *ends[:: max(1, len(ends) // 6)], ends[-1]]
    for at in [min(m, hi) for m in moments]:
        state = server.get(f"/v1/runs/{run['id']}/state", at=repr(at))
        done = {p["prefix"]: p["memory"] + p["released"] for p in state["prefixes"]}
        for prefix in {t["prefix"] for t in records}:
            expected = sum(
                1
                for t in records
                if t["prefix"] == prefix and max(ph["stop"] for ph in t["startstops"]) <= at
            )
            assert done.get(prefix, 0) == expected, (prefix, at, state)

    got = wait_until(whole, 30, "the run's activity")
    for prefix in ("enrich", "call_api", "aggregate"):
        assert abs(got[prefix] - compute[prefix]) <= 0.15 * compute[prefix], (prefix, got, compute)
    activity = server.get(f"/v1/runs/{run['id']}/activity")
    assert activity["partial"] is False, activity["coverage"]


def test_closing_with_the_collector_unreachable_costs_no_more_than_unrecorded(tmp_path, caplog):
    unreachable = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    spool = tmp_path / "spool"
    config = {
        "hindsight.url": unreachable,
        "hindsight.cluster": f"away-{uuid.uuid4().hex[:8]}",
        "hindsight.spool-dir": str(spool),
        "hindsight.adopt-spools": False,
    }
    plain = pipeline({})
    with caplog.at_level(logging.WARNING, logger="hindsight"):
        recorded = pipeline(config)
    assert recorded <= plain + 2.0, (recorded, plain)
    # Nothing was lost: the batches wait in the spool, and the log says where and how to
    # send them, once per agent that kept some.
    assert any(spool.rglob("*")), "nothing spooled"
    told = [r.getMessage() for r in caplog.records if "hindsight spool push" in r.getMessage()]
    assert told and str(spool) in told[0], told
