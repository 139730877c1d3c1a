"""Real LocalClusters (worker processes) recording into a real embedded Hindsight server:
what the read API returns equals Dask's own task stream for the same run."""

from __future__ import annotations

import operator
import uuid
from collections.abc import Iterator
from typing import Any

import dask
import dask.array as da
import pandas as pd
import pytest
from distributed import Client, LocalCluster, get_task_stream, span

from hindsight.schema import GraphEvent, MetricEvent, RunEvent, WorkerEvent
from tests.dask.conftest import (
    EmbeddedServer,
    recorded_view,
    stored_events,
    stream_view,
    wait_for_run,
    wait_until,
)

CLUSTER_KW: dict[str, Any] = dict(
    n_workers=2,
    threads_per_worker=2,
    processes=True,
    dashboard_address=":0",
    worker_dashboard_address=":0",
)


@pytest.fixture(scope="module")
def recorded(hindsight_server: EmbeddedServer) -> Iterator[tuple[Client, str]]:
    """One cluster for the module, started with the preload and Dask config keys."""
    cluster_name = f"rec-{uuid.uuid4().hex[:8]}"
    config = {
        "hindsight.url": hindsight_server.url,
        "hindsight.cluster": cluster_name,
        "dataframe.shuffle.method": "tasks",
    }
    with dask.config.set(config):
        with LocalCluster(**CLUSTER_KW, scheduler_kwargs={"preload": ["hindsight.dask"]}) as lc:
            with Client(lc) as client:
                yield client, cluster_name


def check_against_task_stream(
    server: EmbeddedServer, cluster: str, name: str, stream: list[dict[str, Any]], status: str
) -> dict[str, Any]:
    run = wait_for_run(server, cluster, name, len(stream), status)
    tasks = server.tasks(run["id"])
    assert recorded_view(tasks) == stream_view(stream)
    return run


def graph_of(events: list[Any], run_key: str) -> dict[str, set[str]]:
    return {
        e.key: set(e.dependencies) for e in events if type(e) is GraphEvent and e.run == run_key
    }


def expected_edges(dsk: Any) -> dict[str, set[str]]:
    out = {}
    for key, node in dict(dsk).items():
        deps = getattr(node, "dependencies", None)
        if deps is None:
            deps = dask.core.get_dependencies(dict(dsk), key)
        out[str(key)] = {str(d) for d in deps}
    return out


def test_array_reduction(recorded, hindsight_server):
    client, cluster = recorded
    x = da.random.random(2000, chunks=10).sum()
    (dsk,) = [x.__dask_graph__()]
    with span("array-reduction"), get_task_stream(client) as ts:
        (result,) = dask.compute(x, optimize_graph=False)
    assert 0 < result < 2000
    run = check_against_task_stream(
        hindsight_server, cluster, "array-reduction", ts.data, "finished"
    )
    assert run["span"] == ["array-reduction"]
    recorded_graph = graph_of(stored_events(hindsight_server, cluster), run["run_key"])
    expected = expected_edges(dsk)
    assert {k: recorded_graph[k] for k in expected} == expected


def inc(i: int) -> int:
    return i + 1


def test_client_map(recorded, hindsight_server):
    client, cluster = recorded
    with span("client-map"), get_task_stream(client) as ts:
        futures = client.map(inc, range(300))
        assert client.gather(futures) == list(range(1, 301))
    check_against_task_stream(hindsight_server, cluster, "client-map", ts.data, "finished")
    del futures


def boom(x: int) -> int:
    raise ValueError(f"boom on {x}")


def test_delayed_graph_with_a_failing_task(recorded, hindsight_server):
    client, cluster = recorded
    parts = [dask.delayed(inc)(i) for i in range(20)]
    bad = dask.delayed(boom)(parts[3])
    total = dask.delayed(sum)([*parts, bad])
    dsk = total.__dask_graph__()
    with span("delayed-error"), get_task_stream(client) as ts:
        with pytest.raises(ValueError, match="boom on 4"):
            dask.compute(total, optimize_graph=False)
    # Dask's stream has the tasks that ran; the sum, erred because ``bad`` did, never ran
    run = wait_for_run(hindsight_server, cluster, "delayed-error", len(ts.data) + 1, "erred")
    tasks = hindsight_server.tasks(run["id"])
    ran = [t for t in tasks if t["startstops"]]
    assert recorded_view(ran) == stream_view(ts.data)
    (erred,) = [t for t in ran if t["status"] == "erred"]
    assert erred["key"] == str(bad.key)
    assert "boom on 4" in erred["exception"]
    assert "raise ValueError" in erred["traceback"]
    # The task that erred without running was not recorded,
    # while Dask's future of it raises (it was missing from tasks, counts and /errors).
    (blamed,) = [t for t in tasks if not t["startstops"]]
    assert (blamed["key"], blamed["status"]) == (str(total.key), "erred")
    assert blamed["attrs"] == {"blame": str(bad.key)} and "boom on 4" in blamed["exception"]
    assert run["error_count"] == 2
    recorded_graph = graph_of(stored_events(hindsight_server, cluster), run["run_key"])
    expected = expected_edges(dsk)
    assert {k: recorded_graph[k] for k in expected} == expected


def test_dataframe_shuffle_outside_any_span(recorded, hindsight_server):
    """Work outside a span (dataframes drop span annotations under query planning) is
    one run per scheduler computation, named "default"."""
    client, cluster = recorded
    import dask.dataframe as dd

    before = {r["id"] for r in hindsight_server.runs(cluster)}
    pdf = pd.DataFrame({"k": [i % 37 for i in range(3000)], "v": range(3000)})
    ddf = dd.from_pandas(pdf, npartitions=8).shuffle(on="k", npartitions=8)
    with get_task_stream(client) as ts:
        out = ddf.groupby("k").v.sum().compute()
    assert out.sum() == pdf.v.sum()

    def new_run() -> dict[str, Any] | None:
        runs = [r for r in hindsight_server.runs(cluster) if r["id"] not in before]
        done = [r for r in runs if r["status"] == "finished" and r["task_count"] >= len(ts.data)]
        return done[0] if done else None

    run = wait_until(new_run, 60, "the default run of the shuffle")
    assert run["name"] == "default"
    assert recorded_view(hindsight_server.tasks(run["id"])) == stream_view(ts.data)
    prefixes = {p["prefix"] for p in hindsight_server.get(f"/v1/runs/{run['id']}")["prefixes"]}
    assert any("shuffle" in p for p in prefixes), prefixes


def test_workers_sessions_and_samples_are_recorded(recorded, hindsight_server):
    client, cluster = recorded
    workers = set(client.scheduler_info()["workers"])

    def sampled() -> bool:
        events = stored_events(hindsight_server, cluster)
        return workers <= {e.worker for e in events if type(e) is MetricEvent}

    wait_until(sampled, 30, "metric samples of every worker")
    events = stored_events(hindsight_server, cluster)
    joined = {e.address for e in events if type(e) is WorkerEvent and e.event == "joined"}
    assert workers <= joined
    by_worker = {}
    for e in events:
        if type(e) is MetricEvent:
            by_worker.setdefault(e.worker, {}).update(e.values)
    for w in workers:
        # scheduler view and worker-side spill/disk detail
        assert {"memory.managed", "memory.process", "cpu", "tasks.processing"} <= set(by_worker[w])
        assert {"spill.disk_bytes", "disk.free_bytes"} <= set(by_worker[w])
    assert any(type(e) is RunEvent and e.event == "started" for e in events)


def test_spilling_run_under_a_small_memory_limit(hindsight_server):
    cluster_name = f"spill-{uuid.uuid4().hex[:8]}"
    config = {
        "hindsight.url": hindsight_server.url,
        "hindsight.cluster": cluster_name,
        "hindsight.sample-interval": 0.2,
        # Spill early (target fraction of a 1 GiB limit), never pause or kill the worker.
        "distributed.worker.memory.target": 0.02,
        "distributed.worker.memory.spill": 0.03,
        "distributed.worker.memory.pause": False,
        "distributed.worker.memory.terminate": False,
    }
    with dask.config.set(config):
        with (
            LocalCluster(
                **{**CLUSTER_KW, "n_workers": 1},
                memory_limit="1GiB",
                scheduler_kwargs={"preload": ["hindsight.dask"]},
            ) as lc,
            Client(lc) as client,
        ):
            x = da.random.random((60, 125_000), chunks=(1, 125_000))  # 60 chunks of 1 MB
            with span("spill"), get_task_stream(client) as ts:
                persisted = x.persist()
                total = persisted.sum().compute()
            assert total > 0
            run = check_against_task_stream(
                hindsight_server, cluster_name, "spill", ts.data, "finished"
            )
            (worker,) = client.scheduler_info()["workers"]

            def spilled() -> bool:
                events = stored_events(hindsight_server, cluster_name)
                return any(
                    type(e) is MetricEvent
                    and e.worker == worker
                    and e.values.get("spill.disk_bytes", 0) > 0
                    for e in events
                )

            wait_until(spilled, 30, "a sample showing bytes spilled to disk")
            del persisted
    assert run["task_count"] == len(ts.data)


def test_reduce_of_a_tree(recorded, hindsight_server):
    """A deeper graph: transfers between workers show up as transfer startstops."""
    client, cluster = recorded
    leaves = [dask.delayed(inc)(i) for i in range(64)]
    while len(leaves) > 1:
        leaves = [
            dask.delayed(operator.add)(a, b) for a, b in zip(leaves[::2], leaves[1::2], strict=True)
        ]
    with span("tree"), get_task_stream(client) as ts:
        (value,) = dask.compute(leaves[0])
    assert value == sum(range(1, 65))
    run = check_against_task_stream(hindsight_server, cluster, "tree", ts.data, "finished")
    tasks = hindsight_server.tasks(run["id"])
    stream = {str(r["key"]): [dict(s) for s in r["startstops"]] for r in ts.data}
    for t in tasks:
        assert [s["action"] for s in t["startstops"]] == [s["action"] for s in stream[t["key"]]]


def test_keys_past_the_protocols_limit_stay_distinct(recorded, hindsight_server):
    """Keys longer than 4,096 characters were cut there, so
    keys sharing their first 4,096 characters came back as one task."""
    from hindsight.dask.records import KEY_MAX, key_text

    client, cluster = recorded
    keys = [f"long-{'x' * 5000}-{i}" for i in range(3)]
    with span("long-keys"), get_task_stream(client) as ts:
        futures = [client.submit(inc, i, key=k) for i, k in enumerate(keys)]
        total = client.submit(sum, futures, key="long-total")
        assert total.result() == 6
    run = wait_for_run(hindsight_server, cluster, "long-keys", len(ts.data))
    recorded_keys = {t["key"] for t in hindsight_server.tasks(run["id"])}
    assert len(recorded_keys) == 4  # three long keys and the total
    assert recorded_keys == {key_text(k) for k in keys} | {"long-total"}
    assert all(key_text(k).startswith(k[:4000]) for k in keys)
    assert all(len(k) <= KEY_MAX for k in recorded_keys)
    edges = graph_of(stored_events(hindsight_server, cluster), run["run_key"])
    assert edges["long-total"] == {key_text(k) for k in keys}


def late_boom(x: int) -> int:
    import time

    time.sleep(0.3)
    raise ValueError(f"late boom on {x}")


def test_a_run_whose_last_task_erred_ends_when_that_task_did(recorded, hindsight_server):
    """A run's end was Dask's Span.stop, which counts only
    the tasks that succeeded, so a run whose last task erred ended before that task did."""
    client, cluster = recorded
    with span("ends-in-error"), get_task_stream(client) as ts:
        quick = client.map(inc, range(4), key=[f"quick-{i}" for i in range(4)])
        assert client.gather(quick) == [1, 2, 3, 4]
        with pytest.raises(ValueError, match="late boom"):
            client.submit(late_boom, 1, key="late-boom").result()
    run = wait_for_run(hindsight_server, cluster, "ends-in-error", len(ts.data), "erred")
    last = max(ss["stop"] for t in ts.data for ss in t["startstops"])
    assert run["finished_at"] == pytest.approx(last, abs=1e-3)


def test_numbers_past_what_the_protocol_holds_do_not_cost_the_batch():
    """A result whose sizeof passed 2**53 (a lazy table
    reporting 10 PB) had the collector refuse the whole batch (400), and the agent dropped
    it: 307 events, a run's name and most of its tasks. A worker metric of inf likewise."""
    from hindsight.dask.records import task_event
    from hindsight.dask.values import put_number
    from hindsight.schema import Batch, decode_batch, encode_batch

    ev = task_event("huge-0", "huge", "huge", "r", "memory", "tcp://w:1", 2**60, 10**16,
                     "Table", [], None, None)  # fmt: skip
    values: dict[str, float] = {}
    for name, value in (("memory.managed", float("inf")), ("cpu", 50), ("nan", float("nan"))):
        put_number(values, name, value)
    assert values == {"cpu": 50.0}
    batch = Batch(schema=1, cluster="c", session="s", agent="a", seq=0, events=[ev])
    (got,) = decode_batch(encode_batch(batch)).events  # what the collector validates
    assert got.key == "huge-0" and got.nbytes is None and got.thread is None


def test_a_graph_is_stamped_when_the_scheduler_received_it():
    """Dask stamps ``update-graph-{time}`` on arrival, before it materialises and orders
    the graph (seconds, for a big one) and calls plugins: a later stamp made tasks of a
    graph submitted at once look submitted after their dependencies had ended."""
    import time

    from hindsight.dask.records import received_at

    assert received_at("update-graph-1795000000.5") == 1795000000.5
    for other in (None, "update-graph-soon", "update-graph-1e99", "client-retry-1.0", 3.0):
        before = time.time()
        assert before <= received_at(other) <= time.time()
