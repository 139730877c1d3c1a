"""A finished run's detail object: its replay samples and profile leave the index for one
object when it finishes, every route answers as before, a late batch writes a new version
(the old one stays until the grace period's second pass) and reads in between merge both.
On both stacks."""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import func, select

from storage.core import models as m
from storage.jobs import finish
from storage.runs import detail as run_detail
from tests.helpers import auth, example, post
from tests.storage.jobs.test_finish import apps, own_stack, stack, store_of  # noqa: F401

T0 = 1_700_000_000.0


def state(t: float, done: int) -> dict[str, Any]:
    return {
        "kind": "state",
        "run": "r",
        "time": t,
        "prefixes": [{"prefix": "inc", "waiting": 5 - done, "memory": done}],
        "workers": [{"worker": "tcp://w:1", "managed": 1000 * done, "limit": 10**9}],
    }


def batch(seq: int, events: list[dict[str, Any]]) -> dict[str, Any]:
    return example(cluster="c", session="s", agent="scheduler-1", seq=seq, events=events)


def first_batch() -> dict[str, Any]:
    events: list[dict[str, Any]] = [
        {"kind": "run", "event": "started", "id": "r", "name": "job-r", "time": T0}
    ]
    for i in range(5):
        events.append(
            {"kind": "task", "key": f"inc-{i}", "prefix": "inc", "status": "memory", "run": "r",
             "worker": "tcp://w:1", "thread": 7, "nbytes": 28,
             "startstops": [{"action": "compute", "start": T0 + i, "stop": T0 + i + 0.5}]}
        )  # fmt: skip
    events += [state(T0 + i, i) for i in range(5)]
    events.append({"kind": "run", "event": "finished", "id": "r", "time": T0 + 5})
    return batch(0, events)


def index_rows(app: Any, run_id: str) -> dict[str, int]:
    with store_of(app).sessions() as db:
        rid = db.execute(select(m.Run.id).where(m.Run.public_id == run_id)).scalar_one()
        return {
            t.__tablename__: db.execute(
                select(func.count()).select_from(t).where(t.run_id == rid)
            ).scalar_one()
            for t in (m.RunState, m.RunProfile)
        }


def objects(app: Any, run_id: str) -> list[str]:
    return sorted(k for k in store_of(app).blobs.list("compact/") if f"/{run_id}/detail/" in k)


def answers(query: Any, token: str, run_id: str) -> dict[str, Any]:
    def get(url: str) -> Any:
        resp = query.get(url, headers=auth(token))
        assert resp.status_code == 200, (url, resp.json)
        return resp.json

    return {
        "samples": get(f"/v1/runs/{run_id}/state?at={T0 + 2.5}")["samples"],
        "state": get(f"/v1/runs/{run_id}/state?at={T0 + 2.5}")["prefixes"],
        "end": get(f"/v1/runs/{run_id}/state?at={T0 + 5}")["prefixes"],
        "profile": get(f"/v1/runs/{run_id}/profile")["samples"],
    }


def finished_run(apps: Any, make_token: Any) -> tuple[Any, ...]:  # noqa: F811
    """The first batch's run, finished: the apps, the store, a token, the run and the name
    of its one detail object."""
    collector, query, app = apps
    token = make_token()
    st = store_of(app)
    assert post(collector, first_batch(), token=token).status_code == 202
    finish.drain(st.sessions, st.blobs)
    (run,) = query.get("/v1/runs", headers=auth(token)).json["runs"]
    (first,) = objects(app, run["id"])
    return collector, query, app, st, token, run, first


def test_a_finished_runs_detail_moves_into_one_object_and_reads_the_same(apps, make_token):  # noqa: F811
    collector, query, app = apps
    token = make_token()
    st = store_of(app)
    assert post(collector, first_batch(), token=token).status_code == 202
    (run,) = query.get("/v1/runs", headers=auth(token)).json["runs"]
    before = answers(query, token, run["id"])
    assert before["samples"]["samples"] == 5 and index_rows(app, run["id"])["run_states"] == 5

    finish.drain(st.sessions, st.blobs)
    run_detail.clear_cache()
    assert index_rows(app, run["id"]) == {"run_states": 0, "run_profiles": 0}
    (key,) = objects(app, run["id"])
    stored = run_detail.decode_detail(st.blobs.get(key))
    assert [s.time for s in stored.states] == [T0 + i for i in range(5)]
    assert [(p.prefix, p.worker) for p in stored.profiles] == [("", "")]  # built, empty
    assert answers(query, token, run["id"]) == before


def test_a_late_batch_writes_a_new_version_in_place_of_the_old(
    apps,  # noqa: F811
    make_token,
):
    collector, query, app, st, token, run, first = finished_run(apps, make_token)
    # a reader that read the run (and its digest) before the new version
    with st.sessions() as db:
        stale = db.execute(select(m.Run).where(m.Run.public_id == run["id"])).scalar_one()
        db.expunge(stale)

    # a sample that arrives after the run finished: in the index, read with the object's
    late = batch(1, [state(T0 + 4.5, 4)])
    assert post(collector, late, token=token).status_code == 202
    assert index_rows(app, run["id"])["run_states"] == 1
    got = answers(query, token, run["id"])
    assert got["samples"]["samples"] == 6

    # its finish writes a new version, moves the row, and deletes the old version
    assert finish.run_due(st.sessions, st.blobs, now=time.time()) == 1
    (current,) = objects(app, run["id"])
    assert current != first
    assert index_rows(app, run["id"])["run_states"] == 0
    run_detail.clear_cache()
    assert answers(query, token, run["id"]) == got
    # the reader holding the old digest reads the new one when the old object is gone
    with st.sessions() as db:
        assert len(run_detail.read(db, st.blobs, stale).states) == 6


def test_a_profile_gone_stale_after_the_move_gets_a_new_object_not_index_rows(
    apps,  # noqa: F811
    make_token,
):
    """A later worker batch in the run's window makes its stored profile stale; the read
    that rebuilds it writes a new version of the object (keeping the one it replaced for
    readers that named it), and no profile row comes back into the index."""
    collector, query, app, st, token, run, first = finished_run(apps, make_token)
    metric = {"kind": "metric", "worker": "tcp://w:1", "time": T0 + 2, "values": {"cpu": 1.0}}
    body = example(cluster="c", session="s", agent="worker-1", seq=0, events=[metric])
    assert post(collector, body, token=token).status_code == 202

    resp = query.get(f"/v1/runs/{run['id']}/profile", headers=auth(token))
    assert resp.status_code == 200, resp.json
    assert index_rows(app, run["id"])["run_profiles"] == 0
    versions = objects(app, run["id"])
    assert first in versions and len(versions) == 2
    again = query.get(f"/v1/runs/{run['id']}/profile", headers=auth(token))
    assert again.json == resp.json and objects(app, run["id"]) == versions  # not stale now


def test_the_cache_is_bounded_by_bytes():
    cache = run_detail._Cache(limit=100)
    d = run_detail.Detail(run_detail.FORMAT, "x")
    for i in range(5):
        cache.put(f"k{i}", d, 40)
    assert cache.get("k0") is None and cache.get("k4") is d
    assert sum(n for _, n in cache._items.values()) <= 100
