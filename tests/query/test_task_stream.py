"""GET /v1/runs/{id}/task-stream: a window of a run's task stream, as its start/stops or
as bins that add up to them, read from the tiles built when the run finished."""

from __future__ import annotations

import random
from typing import Any

import pytest

from storage.query import task_stream
from storage.runs import runfile, streamtiles
from tests.helpers import auth, example, post

T0 = 1_795_000_000.0
WORKERS = [f"tcp://10.0.0.{i}:4000" for i in range(4)]


def stream_run(n: int, *, seed: int = 3, finished: bool = True) -> tuple[list[dict], list[tuple]]:
    """Batches of a run of ``n`` tasks on 4 workers x 2 threads, a third of them with a
    transfer first, and every start/stop as (key, action, start, stop)."""
    rng = random.Random(seed)
    clock = {(w, t): T0 for w in WORKERS for t in (1, 2)}
    events: list[dict[str, Any]] = [
        {"kind": "run", "event": "started", "id": "r", "name": "stream", "time": T0}
    ]
    phases = []
    for i in range(n):
        lane = rng.choice(sorted(clock))
        start = clock[lane] + rng.random() * 0.01
        stop = start + rng.expovariate(1 / 0.05)
        clock[lane] = stop
        ss = [{"action": "compute", "start": start, "stop": stop}]
        if i % 3 == 0:
            ss.insert(0, {"action": "transfer", "start": start - 0.02, "stop": start - 0.001})
        key = f"('{('load', 'inc', 'sum')[i % 3]}-x', {i})"
        events.append(
            {
                "kind": "task",
                "key": key,
                "prefix": ("load", "inc", "sum")[i % 3],
                "status": "memory",
                "run": "r",
                "worker": lane[0],
                "thread": lane[1],
                "nbytes": 8,
                "startstops": ss,
            }  # fmt: skip
        )
        phases += [(key, p["action"], p["start"], p["stop"]) for p in ss]
    if finished:
        end = max(clock.values()) + 0.1
        events.append({"kind": "run", "event": "finished", "id": "r", "time": end})
    batches = [
        example(cluster="c", session="s", seq=j, events=events[i : i + 1000])
        for j, i in enumerate(range(0, len(events), 1000))
    ]
    return batches, phases


@pytest.fixture
def run_of(clients, make_token):
    def _make(n: int, **kw: Any) -> tuple[Any, dict, str, list[tuple]]:
        collector, query = clients
        token = make_token()
        batches, phases = stream_run(n, **kw)
        for body in batches:
            assert post(collector, body, token=token).status_code == 202
        (run,) = query.get("/v1/runs", headers=auth(token)).json["runs"]
        return query, auth(token), run["id"], phases

    return _make


def clipped(phases: list[tuple], a: float, b: float) -> float:
    return sum(max(0.0, min(stop, b) - max(start, a)) for _, _, start, stop in phases)


def test_a_narrow_windows_rects_are_exactly_its_start_stops(run_of):
    query, h, rid, phases = run_of(1500)
    a, b = T0 + 2.0, T0 + 3.0
    resp = query.get(f"/v1/runs/{rid}/task-stream?start={a}&stop={b}", headers=h)
    assert resp.status_code == 200, resp.json
    body = resp.json
    assert body["mode"] == "rects"
    r = body["rects"]
    lanes = body["lanes"]
    got = {
        (k, act, s, e, lanes[ln]["worker"])
        for k, act, s, e, ln in zip(
            r["key"], r["action"], r["start"], r["stop"], r["lane"], strict=True
        )
    }
    want = {(k, act, s, e) for k, act, s, e in phases if s < b and e > a}
    assert {g[:4] for g in got} == want and len(r["key"]) == len(want) > 10
    assert {ln["worker"] for ln in lanes} == set(WORKERS)
    assert set(r["prefix"]) <= {"load", "inc", "sum"}
    assert body["count"] == len(want)


def test_the_whole_runs_bins_add_up_to_its_seconds(run_of):
    query, h, rid, phases = run_of(2000)
    resp = query.get(f"/v1/runs/{rid}/task-stream?width=300&max_rects=100", headers=h)
    body = resp.json
    assert resp.status_code == 200 and body["mode"] == "bins"
    bins = body["bins"]
    assert len(bins["edges"]) == 301 and len(bins["busy"]) == len(body["lanes"]) == 8
    assert all(len(row) == 300 for row in bins["busy"])
    assert bins["edges"][0] == pytest.approx(min(p[2] for p in phases))
    assert bins["edges"][-1] == pytest.approx(max(p[3] for p in phases))
    total = sum(map(sum, bins["busy"]))
    assert total == pytest.approx(clipped(phases, body["start"], body["stop"]), rel=0.01)
    # a bin's dominant category names a prefix or the transfer action; idle bins none
    names = body["names"]
    assert set(names) == {"load", "inc", "sum", "transfer"}
    for busy_row, top_row, n_row in zip(bins["busy"], bins["prefix"], bins["count"], strict=True):
        for busy, top, n in zip(busy_row, top_row, n_row, strict=True):
            assert (top >= 0) == (busy > 0 or n > 0)
    assert sum(map(sum, bins["count"])) == len(phases)


def test_a_run_compacted_in_many_row_groups_gets_the_same_stream(run_of, monkeypatch):
    # a big run's tiles are built from its copy a row group at a time: the prefixes,
    # actions and lanes coded in one part must mean the same in the next
    monkeypatch.setattr(runfile, "BUILD_CHUNK", 250)
    query, h, rid, phases = run_of(3000)
    a, b = T0 + 2.0, T0 + 9.0
    body = query.get(f"/v1/runs/{rid}/task-stream?start={a}&stop={b}", headers=h).json
    assert body["mode"] == "rects"
    r, lanes, names = body["rects"], body["lanes"], body["names"]
    got = {
        (k, act, s, e)
        for k, act, s, e in zip(r["key"], r["action"], r["start"], r["stop"], strict=True)
    }
    assert got == {(k, act, s, e) for k, act, s, e in phases if s < b and e > a}
    by_key = {p[0]: p for p in phases}
    for k, pre, ln in zip(r["key"], r["prefix"], r["lane"], strict=True):
        assert pre == ("load", "inc", "sum")[int(k.rsplit(", ", 1)[1][:-1]) % 3], k
        assert lanes[ln]["worker"] in WORKERS and k in by_key
    assert set(names) == {"load", "inc", "sum", "transfer"} and len(lanes) == 8
    whole = query.get(f"/v1/runs/{rid}/task-stream?width=300&max_rects=100", headers=h).json
    assert sum(map(sum, whole["bins"]["busy"])) == pytest.approx(
        clipped(phases, whole["start"], whole["stop"]), rel=0.01
    )
    assert sum(map(sum, whole["bins"]["count"])) == len(phases)


@pytest.mark.parametrize("dense", [True, False], ids=["dense-level-0", "merged-level-0"])
def test_a_windows_bins_add_up_to_its_clipped_seconds_from_the_pyramid_too(
    run_of, monkeypatch, dense
):
    if not dense:  # many cells x categories: level 0 merged from sparse slices
        monkeypatch.setattr(streamtiles, "DENSE_ADD_MAX", 0)
        monkeypatch.setattr(streamtiles, "SLICE", 500)
    query, h, rid, phases = run_of(3000)
    a, b = T0 + 3.3, T0 + 17.7
    want = clipped(phases, a, b)
    url = f"/v1/runs/{rid}/task-stream?start={a}&stop={b}&width=200&max_rects=10"
    exact = query.get(url, headers=h).json
    assert exact["mode"] == "bins" and exact["source"] == "rects"
    assert sum(map(sum, exact["bins"]["busy"])) == pytest.approx(want, rel=1e-6)
    # past EXACT_MAX start/stops a window is binned from the pyramid built at finish
    monkeypatch.setattr(task_stream, "EXACT_MAX", 100)
    tiled = query.get(url, headers=h).json
    assert tiled["mode"] == "bins" and tiled["source"].startswith("pyramid")
    assert sum(map(sum, tiled["bins"]["busy"])) == pytest.approx(want, rel=0.01)
    # the same dominant category as the exact answer in most busy bins
    same = total = 0
    for er, tr, eb in zip(
        exact["bins"]["prefix"], tiled["bins"]["prefix"], exact["bins"]["busy"], strict=True
    ):
        for e, t, busy in zip(er, tr, eb, strict=True):
            if busy > 0:
                total += 1
                same += e == t
    assert same / total > 0.8


def test_a_running_run_answers_from_its_tasks_as_they_are(run_of):
    query, h, rid, phases = run_of(500, finished=False)
    body = query.get(f"/v1/runs/{rid}/task-stream", headers=h).json
    assert body["mode"] == "rects" and len(body["rects"]["key"]) == len(phases)


@pytest.mark.parametrize(
    "args",
    [
        "width=0",
        "width=4001",
        "width=abc",
        "start=abc",
        "max_rects=50001",
        f"start={T0 + 5}&stop={T0 + 5}",
        f"start={T0 + 5}&stop={T0 + 1}",
    ],  # fmt: skip
)
def test_bad_parameters_are_400_json(run_of, args):
    query, h, rid, _ = run_of(50)
    resp = query.get(f"/v1/runs/{rid}/task-stream?{args}", headers=h)
    assert resp.status_code == 400 and resp.json["error"]["code"], resp.data[:200]


def test_an_unknown_run_is_404(run_of):
    query, h, _, _ = run_of(5)
    resp = query.get("/v1/runs/00000000-0000-0000-0000-000000000000/task-stream", headers=h)
    assert resp.status_code == 404


def test_a_run_without_threads_has_a_lane_per_worker_and_an_empty_run_none(clients, make_token):
    collector, query = clients
    token = make_token()
    events: list[dict[str, Any]] = [
        {"kind": "run", "event": "started", "id": "r", "name": "no-threads", "time": T0},
        *(
            {
                "kind": "task",
                "key": f"t-{i}",
                "prefix": "t",
                "status": "memory",
                "run": "r",
                "worker": WORKERS[i % 2],
                "nbytes": 8,
                "startstops": [{"action": "compute", "start": T0 + i, "stop": T0 + i + 0.5}],
            }  # fmt: skip
            for i in range(6)
        ),
        {"kind": "run", "event": "finished", "id": "r", "time": T0 + 7},
        {"kind": "run", "event": "started", "id": "e", "name": "empty", "time": T0},
        {"kind": "run", "event": "finished", "id": "e", "time": T0 + 1},
    ]
    body = example(cluster="c", session="s", seq=0, events=events)
    assert post(collector, body, token=token).status_code == 202
    runs = {r["name"]: r["id"] for r in query.get("/v1/runs", headers=auth(token)).json["runs"]}
    got = query.get(f"/v1/runs/{runs['no-threads']}/task-stream", headers=auth(token)).json
    assert got["lanes"] == [{"worker": w, "thread": None} for w in sorted(WORKERS[:2])]
    assert sorted(got["rects"]["key"]) == [f"t-{i}" for i in range(6)]
    empty = query.get(f"/v1/runs/{runs['empty']}/task-stream", headers=auth(token))
    assert empty.status_code == 200, empty.json
    assert empty.json["mode"] == "rects" and empty.json["rects"]["key"] == []
    assert empty.json["lanes"] == []
